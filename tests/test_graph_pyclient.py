"""fleet.graph.GraphPyClient: Paddle's method names over real servers and real files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_graph_table import graph_cluster

from fleet.graph import GraphPyClient
from ps_server.config import GraphTableConfig

CFG = GraphTableConfig(
    "pgl",
    node_types=["user", "item"],
    edge_types=[("u2i", "user", "item"), ("i2u", "item", "user")],
    features={"user": {"a": ("int64", 1), "b": ("float32", 2)}},
    num_shards=8,
)


@pytest.mark.timeout(60)
def test_paddle_names(tmp_path: Path) -> None:
    (tmp_path / "u2i.txt").write_text("1\t10\t0.5\n1\t11\t2\n2\t10\t1\n")
    (tmp_path / "nodes.txt").write_text("user\t1\ta 7\tb 0.25 -1.5\nuser\t2\ta 8\tb 1 2\n")
    with graph_cluster(2) as (servers, _):
        endpoints = [f"127.0.0.1:{s.port}" for s in servers]
        g = GraphPyClient(endpoints, CFG, timeout_s=20)
        try:
            assert g.load_edge_file("u2i", str(tmp_path / "u2i.txt"), reverse=False)["edges"] == 3
            g.load_node_file("user", str(tmp_path / "nodes.txt"))
            nb = g.random_sample_neighbors("u2i", [1, 2, 3], 5)
            assert [sorted(a.tolist()) for a in nb] == [[10, 11], [10], []]
            (ids, w), *_ = g.random_sample_neighbors("u2i", [1], 5, need_weight=True)
            assert dict(zip(ids.tolist(), w.tolist())) == {10: 0.5, 11: 2.0}
            assert sorted(g.random_sample_nodes("user", 10).tolist()) == [1, 2]
            assert sorted(g.pull_graph_list("user", 0, 10).tolist()) == [1, 2]
            a, b = g.get_node_feat("user", [2, 1, 5], ["a", "b"])
            np.testing.assert_array_equal(a, [[8], [7], [0]])
            np.testing.assert_array_equal(b, np.array([[1, 2], [0.25, -1.5], [0, 0]], np.float32))
            # a second client by table name
            h = GraphPyClient(endpoints, "pgl", timeout_s=20)
            assert sorted(h.random_sample_neighbors("i2u", [10], 5)[0].tolist()) == []
            h.close()
        finally:
            g.close()
