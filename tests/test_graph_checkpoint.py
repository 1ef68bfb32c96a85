"""Graph tables saved by N servers and loaded by M (2 -> 3, 3 -> 1): every edge, edge id, weight
and feature comes back; paths outside the checkpoint roots and incomplete saves are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_graph_table import graph_cluster

from ps_server.config import GraphTableConfig
from ps_server.rpc.status import PSFailedPreconditionError, PSPermissionDeniedError

CFG = GraphTableConfig(
    "ck",
    node_types=["a", "b"],
    edge_types=[("ab", "a", "b"), ("ba", "b", "a")],
    features={"a": {"v": ("float32", 3), "k": ("int64", 1)}},
    num_shards=12,
)


def _everything(client, src_all):
    v, o, w, e = client.sample_neighbors(
        "ck", src_all, 10_000, "ab", return_weights=True, return_eids=True
    )
    edges = sorted(zip(np.repeat(src_all, np.diff(o)).tolist(), v.tolist(), w.tolist(), e.tolist()))
    feats = client.node_features("ck", src_all, node_type="a")
    return edges, feats


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 3), (3, 1)])
def test_save_and_reshard(saved_by: int, loaded_by: int, tmp_path: Path) -> None:
    rng = np.random.default_rng(saved_by)
    src = rng.integers(-(2**40), 2**40, 300)
    dst = rng.integers(0, 100, 300)
    w = rng.random(300).astype(np.float32)
    nodes = np.unique(src)
    v = rng.standard_normal((nodes.shape[0], 3)).astype(np.float32)
    k = rng.integers(-(2**63), 2**63 - 1, (nodes.shape[0], 1))
    with graph_cluster(saved_by, checkpoint_root=str(tmp_path)) as (_, client):
        client.create_graph_table(CFG)
        client.add_edges("ck", src, dst, "ab", weight=w)
        client.add_nodes("ck", nodes, "a", {"v": v, "k": k})
        before = _everything(client, nodes)
        stats = client.save_graph("ck", "snap")
        assert stats == {"nodes": nodes.shape[0], "edges": 300}
        with pytest.raises(PSPermissionDeniedError, match="outside this server's checkpoint"):
            client.save_graph("ck", "/etc")
    with graph_cluster(loaded_by, checkpoint_root=str(tmp_path)) as (_, client):
        assert client.load_graph("ck", "snap") == {"nodes": nodes.shape[0], "edges": 300}
        after = _everything(client, nodes)
        assert after[0] == before[0]  # edges with their weights and ids
        for name in ("v", "k"):
            np.testing.assert_array_equal(after[1][name], before[1][name])
        # the edge id counter goes on after the loaded ids
        client.add_edges("ck", [1], [2], "ab")
        _, _, eid = client.sample_neighbors("ck", [1], 5, "ab", return_eids=True)
        assert eid.tolist() == [300]
        # an incomplete save is refused, the table stays
        (tmp_path / "snap" / "ck" / f"part-00000-of-{saved_by:05d}.npz").unlink()
        with pytest.raises(PSFailedPreconditionError, match="missing"):
            client.load_graph("ck", "snap")
        assert client.degree("ck", [1], "ab").tolist() == [1]
