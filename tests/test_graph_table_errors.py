"""Bad input to graph tables: each a clear error naming the value, nothing half-loaded, and the
servers keep serving. Real servers over gRPC, real files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_graph_table import graph_cluster

from collective.errors import ConfigError
from ps_server.config import GraphTableConfig
from ps_server.core.graph_files import GraphInputError
from ps_server.rpc.status import PSInvalidArgumentError, PSNotFoundError

CFG = GraphTableConfig(
    "g",
    node_types=["user", "item"],
    edge_types=[("u2i", "user", "item"), ("i2u", "item", "user"), ("u2u", "user", "user")],
    features={"user": {"emb": ("float32", 2)}},
    num_shards=8,
)


@pytest.mark.timeout(60)
def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="edge_types"):
        GraphTableConfig("g", node_types=["a"], edge_types=[])
    with pytest.raises(ConfigError, match="'b' of edge type 'e'"):
        GraphTableConfig("g", node_types=["a"], edge_types=[("e", "a", "b")])
    with pytest.raises(ConfigError, match="dtype must be one of"):
        GraphTableConfig("g", edge_types=["e"], features={"node": {"x": ("float16", 2)}})
    with pytest.raises(ConfigError, match="width must be"):
        GraphTableConfig("g", edge_types=["e"], features={"node": {"x": ("float32", 0)}})
    with pytest.raises(ConfigError, match="node_types"):
        GraphTableConfig("g", node_types=["a", "a"], edge_types=["e"])
    again = GraphTableConfig.from_dict(CFG.to_dict())
    assert again == CFG


@pytest.mark.timeout(90)
def test_bad_inputs_are_refused_and_the_servers_keep_serving(tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_text("1\t2\n1\t3\n2\t3\n")
    bad = tmp_path / "bad.txt"
    bad.write_text("4\t5\n4\tfive\n6\t7\n8\n")
    with graph_cluster(2) as (_, client):
        client.create_graph_table(CFG)
        client.load_edges("g", str(good), "u2u")
        before = client.graph_stats("g")
        # a malformed line: the file and the line named; nothing of either file loaded
        with pytest.raises(PSInvalidArgumentError, match=r"bad\.txt, line 2: dst 'five'"):
            client.load_edges("g", [str(good), str(bad)], "u2u")
        assert client.graph_stats("g") == before
        # on_error="skip": the bad lines dropped and counted
        got = client.load_edges("g", str(bad), "u2u", on_error="skip")
        assert got["skipped"] == 2 and got["edges"] == 2 and got["kept"] == 2
        assert client.degree("g", [4, 6], "u2u").tolist() == [1, 1]
        with pytest.raises(PSInvalidArgumentError, match="on_error"):
            client.load_edges("g", str(bad), "u2u", on_error="ignore")
        with pytest.raises(PSInvalidArgumentError, match="matches no file"):
            client.load_edges("g", str(tmp_path / "none-*.txt"), "u2u")
        # unknown edge and node types
        with pytest.raises(PSInvalidArgumentError, match="unknown edge type 'follows'"):
            client.sample_neighbors("g", [1], 3, "follows")
        with pytest.raises(PSInvalidArgumentError, match="unknown edge type 'follows'"):
            client.load_edges("g", str(good), "follows")
        with pytest.raises(GraphInputError, match="unknown node type 'shop'"):
            client.node_features("g", [1], node_type="shop")
        with pytest.raises(PSInvalidArgumentError, match="unknown node type 'shop'"):
            client.random_nodes("g", 3, "shop")
        nodes = tmp_path / "nodes.txt"
        nodes.write_text("user\t1\temb 1 2\nshop\t2\n")
        with pytest.raises(
            PSInvalidArgumentError, match=r"nodes\.txt, line 2: unknown node type 'shop'"
        ):
            client.load_nodes("g", str(nodes))
        # fanout <= 0
        for fanout in (0, -3):
            with pytest.raises(
                GraphInputError, match=f"fanout: must be an integer >= 1, got {fanout}"
            ):
                client.sample_neighbors("g", [1], fanout, "u2u")
        # ids that are not int64
        with pytest.raises(GraphInputError, match="must be int64 node ids, got dtype float64"):
            client.sample_neighbors("g", [1.5, 2.0], 3, "u2u")
        with pytest.raises(GraphInputError, match="ids above the int64 range"):
            client.degree("g", np.array([2**64 - 1], np.uint64), "u2u")
        big = tmp_path / "big.txt"
        big.write_text("1\t2\n1\t99999999999999999999\n")
        with pytest.raises(PSInvalidArgumentError, match="'99999999999999999999' is not an int64"):
            client.load_edges("g", str(big), "u2u")
        # features of the wrong width, in a call and in a file
        with pytest.raises(GraphInputError, match=r"has width 2: expected shape \(2, 2\)"):
            client.add_nodes("g", [1, 2], "user", {"emb": np.zeros((2, 3), np.float32)})
        wide = tmp_path / "wide.txt"
        wide.write_text("user\t1\temb 1 2 3\n")
        with pytest.raises(PSInvalidArgumentError, match="'emb' has 3 value.s., its width is 2"):
            client.load_nodes("g", str(wide))
        # a metapath whose types do not chain
        with pytest.raises(PSInvalidArgumentError, match="does not chain"):
            client.random_walk("g", [1], 4, metapath=["u2i", "u2u"])
        with pytest.raises(PSInvalidArgumentError, match="does not chain"):
            client.random_walk("g", [1], 3, metapath=["u2i"])  # item -> user cycle breaks
        # an unknown table
        with pytest.raises(PSNotFoundError, match="graph table 'nope' does not exist"):
            client.sample_neighbors("nope", [1], 3)
        # still serving, nothing half-loaded
        v, o = client.sample_neighbors("g", [1], 10, "u2u")
        assert sorted(v.tolist()) == [2, 3]
        stats = client.graph_stats("g")
        assert sum(s["edges"]["u2u"] for s in stats) == 5
        assert sum(s["nodes"]["user"] for s in stats) == 4  # sources 1, 2, 4, 6


@pytest.mark.timeout(60)
def test_job_token_guards_graph_calls_and_walks_carry_it() -> None:
    """With a job token every graph call needs it; the servers' WalkStep calls to each other
    carry it, so walks cross servers."""
    from ps_server.graph_client import GraphClient
    from ps_server.rpc.status import PSUnauthenticatedError

    token = "graph-test-token-0123456789abcdef"
    cfg = GraphTableConfig("t", edge_types=["e"], num_shards=8)
    with graph_cluster(3, client_kw={"token": token}, token=token) as (servers, client):
        client.create_graph_table(cfg)
        ring = np.arange(60)
        client.add_edges("t", ring, (ring + 1) % 60)
        values, offsets = client.random_walk("t", [0, 30], 20, seed=1)
        assert values.tolist() == [*range(21), *[(30 + i) % 60 for i in range(21)]]
        stranger = GraphClient([f"127.0.0.1:{s.port}" for s in servers], timeout_s=10, token=None)
        try:
            with pytest.raises(PSUnauthenticatedError):
                stranger.sample_neighbors("t", [1], 3)
        finally:
            stranger.close()


@pytest.mark.timeout(60)
def test_malformed_frames_are_invalid_argument() -> None:
    """A body that is not a frame, or lacks a field, is INVALID_ARGUMENT; the server goes on."""
    from ps_server.rpc.graph_service import encode

    with graph_cluster(1) as (_, client):
        client.create_graph_table(CFG)
        for body in (b"\x01", b"\xff\xff\x00\x00{", encode({"table": "g"})):
            with pytest.raises(PSInvalidArgumentError):
                client._send("SampleNeighbors", [(0, body)])
        assert client.degree("g", [1], "u2u").tolist() == [0]
