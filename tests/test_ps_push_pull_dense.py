"""``PSClient.push_pull_dense``: a dense push whose reply carries the block's values after it
(one PushDense call instead of PushDense + PullDense), and its fallback to a separate pull when
the block is sent in parts."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ps_server import SGD, DenseTable, DenseTableConfig

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster


def _requests(servers: list, op: str) -> int:
    return sum(s.state.requests[op] for s in servers)


@pytest.mark.timeout(60)
def test_push_pull_dense_one_call_and_split_fallback() -> None:
    cfg = DenseTableConfig("d", SGD(0.5), num_shards=4)
    ref = DenseTable(cfg)
    small = np.linspace(-1, 1, 10, dtype=np.float32)
    big = np.linspace(-1, 1, 300_000, dtype=np.float32)  # 1.2 MB: parts under max_message_mb=1
    with cluster(2, client_kw={"timeout_s": 20, "max_message_mb": 1.0}) as (servers, client):
        client.create_table_from_config(cfg)
        for name, w in (("a", small), ("b", small), ("big", big)):
            client.init_dense("d", name, w)
            ref.init(name, w)
        g = np.ones(10, np.float32)
        pulls = _requests(servers, "PullDense")
        got = client.push_pull_dense("d", "a", g)
        ref.push("a", g)
        np.testing.assert_allclose(got, ref.pull("a"), rtol=1e-6)
        np.testing.assert_array_equal(got, client.pull_dense("d", "a"))
        got = client.push_pull_dense("d", "b", 2 * g, mode="delta")  # GEO: added, no rule
        np.testing.assert_allclose(got, small + 2, rtol=1e-6)
        assert _requests(servers, "PullDense") == pulls + 1  # only the explicit pull above
        # a block sent in parts: the values come from a pull after the last part
        gb = np.full(big.shape[0], 0.25, np.float32)
        got = client.push_pull_dense("d", "big", gb)
        ref.push("big", gb)
        np.testing.assert_allclose(got, ref.pull("big"), rtol=1e-6)
        assert _requests(servers, "PullDense") > pulls + 1
        with pytest.raises(Exception, match="apply' or 'delta"):
            client.push_pull_dense("d", "a", g, mode="sync")
