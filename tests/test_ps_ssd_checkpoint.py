"""SSD tables in a server's life and in checkpoints: ``PSServer.stop()`` closes them (the tier
can be reopened in the same process), delta saves and delta serving exports cover both tiers,
and a full save streams the cold rows."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rocksdict")

from ps_server import PSClient, PSServer
from ps_server.core.factory import make_table
from ps_server.core.initializers import Uniform
from ps_server.core.optimizers import Adagrad
from ps_server.core.ssd_table import SsdSparseTable

sys.path.insert(0, str(Path(__file__).parent))
from test_ps_ssd_table import _config


@pytest.mark.timeout(60)
def test_server_stop_closes_ssd_tables_and_frees_their_directories(tmp_path: Path) -> None:
    server = PSServer(host="127.0.0.1", port=0, ssd_root=str(tmp_path))
    port = server.start()
    client = PSClient([f"127.0.0.1:{port}"], timeout_s=20)
    try:
        client.create_table(
            "emb",
            8,
            Adagrad(lr=0.05),
            Uniform(-0.01, 0.01),
            num_shards=8,
            seed=3,
            storage="ssd",
            cache_rows=200,
        )
        keys = np.arange(2000, dtype=np.int64)
        client.pull_sparse("emb", keys)
        table = server.state.tables["emb"]
        assert isinstance(table, SsdSparseTable) and table.stats()["cold_rows"] > 1500
    finally:
        client.close()
        server.stop()
    thread = table.queue.thread
    assert thread is None or not thread.is_alive()
    assert table.cold._db is None and table.cold._lock_file is None
    again = make_table(_config("ssd"), ssd_root=str(tmp_path))  # same tier directory
    assert isinstance(again, SsdSparseTable) and again.cold.path == table.cold.path
    assert np.array_equal(again.pull(keys[:10]), again.initial_values(keys[:10]))
    again.close()
    server.stop()  # idempotent
