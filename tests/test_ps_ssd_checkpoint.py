"""SSD tables in a server's life and in checkpoints: ``PSServer.stop()`` closes them (the tier
can be reopened in the same process), delta saves and delta serving exports cover both tiers,
and a full serving export streams the cold rows."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rocksdict")

from ps_server import PSClient, PSServer
from ps_server.checkpoint import load, save
from ps_server.checkpoint.save_load import take_snapshot, write_snapshot
from ps_server.checkpoint.series import commit
from ps_server.checkpoint.serving import load_serving
from ps_server.core.factory import make_table
from ps_server.core.initializers import Uniform
from ps_server.core.optimizers import Adagrad
from ps_server.core.ssd_table import SsdSparseTable
from ps_server.core.table import ChangeLog
from ps_server.errors import SsdTierError, TableInputError

sys.path.insert(0, str(Path(__file__).parent))
from test_ps_ssd_table import _assert_same_rows, _config, _drive, _pair, _rows


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


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _ssd(root: Path, name: str, cache_rows: int = 200) -> SsdSparseTable:
    (root / name).mkdir(parents=True, exist_ok=True)
    table = make_table(_config("ssd", cache_rows=cache_rows), ssd_root=str(root / name))
    assert isinstance(table, SsdSparseTable)
    return table


@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [True, False], ids=["background", "in-call"])
def test_delta_saves_load_as_the_memory_tables_do(tmp_path: Path, background: bool) -> None:
    mem, ssd = _pair(_mkdir(tmp_path / "tier"), show_decay_rate=0.9)
    ssd.background = background
    _drive([mem, ssd], steps=30, num_keys=4000)
    for t, d in ((mem, "mem"), (ssd, "ssd")):
        save(tmp_path / d / "base", [t])
    for i in range(3):  # changes in both tiers, cold deletions included
        _drive([mem, ssd], steps=20, num_keys=6000 + 1000 * i, seed=10 + i)
        if i == 1:
            for t in (mem, ssd):
                t.end_day()
            assert mem.shrink(0) == ssd.shrink(0) > 0
        for t, d in ((mem, "mem"), (ssd, "ssd")):
            save(tmp_path / d / f"delta{i}", [t], mode="delta")
        stats = ssd.stats()
        assert stats["cold_rows"] > 3000
        m_delta = make_table(_config())
        s_delta = make_table(_config())
        s_delta_read = load(tmp_path / "ssd" / f"delta{i}", [s_delta])
        m_delta_read = load(tmp_path / "mem" / f"delta{i}", [m_delta])
        assert s_delta_read == m_delta_read  # the same changed rows
        assert 0 < s_delta_read["emb"] < mem.num_rows
    # base + deltas, into a memory table and into an SSD table: the SSD table's chain loads
    # exactly as the memory table's does
    chains = []
    for d in ("mem", "ssd"):
        for into in (make_table(_config()), _ssd(tmp_path / "into", d, cache_rows=150)):
            load(tmp_path / d / "base", [into])
            for i in range(3):
                load(tmp_path / d / f"delta{i}", [into])
            chains.append(into)
    for into in chains[1:]:
        _assert_same_rows(chains[0], into)
    live, loaded = _rows(mem), _rows(chains[0])
    for f in ("keys", "values", "state", "unseen_days"):
        assert np.array_equal(live[f], loaded[f]), f
    ssd.close()


@pytest.mark.timeout(120)
def test_serving_export_delta_chain_of_an_ssd_table(tmp_path: Path) -> None:
    mem, ssd = _pair(_mkdir(tmp_path / "tier"))
    _drive([mem, ssd], steps=30, num_keys=4000)
    with pytest.raises(TableInputError, match="full export first"):
        take_snapshot([ssd], "delta", ChangeLog.EXPORT)
    dirs: dict[str, list[Path]] = {"mem": [], "ssd": []}
    for i in range(3):
        mode = "all" if i == 0 else "delta"
        for t, d in ((mem, "mem"), (ssd, "ssd")):
            out = tmp_path / d / f"export{i}"
            write_snapshot(out, take_snapshot([t], mode, ChangeLog.EXPORT), kind="serving")
            commit(out, i)
            dirs[d].append(out)
        if i == 1:
            save(tmp_path / "ckpt", [ssd])  # a save does not break the export chain
            assert mem.shrink(2) == ssd.shrink(2)
        _drive([mem, ssd], steps=16, num_keys=6000, seed=20 + i)
    served = {d: load_serving(dirs[d])[0]["emb"] for d in dirs}
    keys = np.arange(8000, dtype=np.int64)
    np.testing.assert_array_equal(served["ssd"].pull(keys), served["mem"].pull(keys))
    assert served["ssd"].num_rows == served["mem"].num_rows > 3000
    ssd.close()


@pytest.mark.timeout(60)
def test_a_lost_delta_save_is_carried_by_the_next(tmp_path: Path) -> None:
    mem, ssd = _pair(_mkdir(tmp_path / "tier"))
    _drive([mem, ssd], steps=20, num_keys=3000)
    for t, d in ((mem, "mem"), (ssd, "ssd")):
        save(tmp_path / d / "base", [t])
    _drive([mem, ssd], steps=12, num_keys=3000, seed=3)
    lost = take_snapshot([ssd], "delta", ChangeLog.SAVE)  # never written
    _drive([mem, ssd], steps=12, num_keys=3000, seed=4)
    lost.requeue()
    assert ssd.stats()["cold_rows"] > 2000
    save(tmp_path / "ssd" / "delta", [ssd], mode="delta")
    into = make_table(_config())
    load(tmp_path / "ssd" / "base", [into])
    load(tmp_path / "ssd" / "delta", [into])
    _assert_same_rows(mem, into)
    ssd.close()


@pytest.mark.timeout(120)
def test_full_save_streams_cold_rows_shard_by_shard_as_of_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mem, ssd = _pair(_mkdir(tmp_path / "tier"), show_decay_rate=0.8)
    _drive([mem, ssd], steps=40, num_keys=5000)
    for t in (mem, ssd):
        t.end_day()  # cold rows are aged when the save reads them
    read: list[int] = []
    real = ssd.cold.read_shard

    def spy(view: object, shard: int) -> object:
        read.append(shard)
        return real(view, shard)

    monkeypatch.setattr(ssd.cold, "read_shard", spy)
    real_scan, saving = ssd.cold.scan, [True]

    def scan() -> object:
        assert not saving[0], "a full save must not scan the tier"
        return real_scan()

    monkeypatch.setattr(ssd.cold, "scan", scan)
    # a full serving export's snapshot streams the cold rows (a checkpoint's takes the tier as
    # a RocksDB checkpoint instead: tests/test_ps_ssd_native_checkpoint.py)
    snaps = {
        d: take_snapshot([t], "all", ChangeLog.EXPORT) for t, d in ((mem, "mem"), (ssd, "ssd"))
    }
    assert snaps["ssd"].nbytes < snaps["mem"].nbytes / 4  # the memory rows only
    assert read == []  # nothing read yet: the cold rows are read while writing
    saving[0] = False
    _drive([mem, ssd], steps=12, num_keys=5000, seed=9)  # training goes on meanwhile
    for t in (mem, ssd):  # rows deleted from the disk during the save, and created again
        t.end_day()
    assert mem.shrink(0) == ssd.shrink(0) > 100
    _drive([mem, ssd], steps=12, num_keys=5000, seed=10)
    saving[0] = True
    for d, snap in snaps.items():
        write_snapshot(tmp_path / d, snap)
    assert read == list(range(8))
    loaded = []
    for d in ("mem", "ssd"):
        into = make_table(_config())
        load(tmp_path / d, [into])
        loaded.append(into)
    _assert_same_rows(loaded[0], loaded[1])
    assert loaded[1].num_rows > 4000

    lost = take_snapshot([ssd], "all", ChangeLog.EXPORT)
    ssd.clear()  # a full load into the table while its save is pending
    with pytest.raises(SsdTierError, match="cleared or closed while its checkpoint"):
        write_snapshot(tmp_path / "void", lost)
    ssd.close()


@pytest.mark.timeout(60)
def test_a_load_larger_than_the_cache_puts_the_overflow_on_disk_and_keeps_every_row(
    tmp_path: Path,
) -> None:
    mem = make_table(_config())
    _drive([mem], steps=30, num_keys=5000)
    save(tmp_path / "ckpt", [mem])
    into = _ssd(tmp_path / "into", "ssd", cache_rows=300)
    into.background = False
    assert load(tmp_path / "ckpt", [into]) == {"emb": mem.num_rows}
    stats = into.stats()
    assert stats["hot_rows"] <= 300 and stats["cold_rows"] == mem.num_rows - stats["hot_rows"]
    assert stats["ssd_writes"] == 0  # ingested as sorted files, not through the write queue
    _assert_same_rows(mem, into)
    _drive([mem, into], steps=5, num_keys=6000, seed=3)  # the loaded table trains on
    _assert_same_rows(mem, into)
    into.close()
