"""Graph tables end to end: real servers on 127.0.0.1 (port 0) in this process, the real
GraphClient, real edge and node files; every query checked exactly against a reference built
in the test from the same edge list."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ps_server import PSServer
from ps_server.config import GraphTableConfig
from ps_server.core.routing import shard_of
from ps_server.graph_client import GraphClient

CFG = GraphTableConfig(
    "g",
    node_types=["user", "item"],
    edge_types=[("u2i", "user", "item"), ("i2u", "item", "user"), ("u2u", "user", "user")],
    features={
        "user": {"emb": ("float32", 4), "tags": ("int64", 2)},
        "item": {"price": ("float32", 1)},
    },
    num_shards=16,
)


@contextlib.contextmanager
def graph_cluster(
    num_servers: int, client_kw: dict | None = None, **server_kw
) -> Iterator[tuple[list[PSServer], GraphClient]]:
    """``num_servers`` servers in this process (``server_kw`` to each) and a GraphClient to
    them; all stopped after."""
    servers = [
        PSServer(server_index=i, num_servers=num_servers, grace_s=1.0, **server_kw)
        for i in range(num_servers)
    ]
    try:
        ports = [s.start() for s in servers]
        client = GraphClient([f"127.0.0.1:{p}" for p in ports], timeout_s=20, **(client_kw or {}))
        try:
            yield servers, client
        finally:
            client.close()
    finally:
        for s in servers:
            s.stop(grace_s=0.5)


def _edges(rng: np.random.Generator, n: int, lo: int, hi: int, lo2: int, hi2: int):
    src = rng.integers(lo, hi, n).astype(np.int64)
    dst = rng.integers(lo2, hi2, n).astype(np.int64)
    w = rng.integers(1, 9, n).astype(np.float32) / 4
    return src, dst, w


def _write_edges(path: Path, src, dst, w=None) -> None:
    with open(path, "w") as f:
        for i in range(src.shape[0]):
            f.write(f"{src[i]}\t{dst[i]}" + (f"\t{w[i]}" if w is not None else "") + "\n")


def _adjacency(src, dst, eids) -> dict[int, list[tuple[int, int]]]:
    adj: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for s, d, e in zip(src.tolist(), dst.tolist(), eids.tolist()):
        adj[s].append((d, e))
    return adj


@pytest.fixture
def graph_files(tmp_path: Path):
    rng = np.random.default_rng(7)
    # users are negative ids (any int64 works), items large positive ones
    u2i = _edges(rng, 3000, -300, 0, 10**15, 10**15 + 200)
    i2u = _edges(rng, 1500, 10**15, 10**15 + 200, -300, 0)
    u2u = _edges(rng, 800, -300, 0, -300, 0)
    _write_edges(tmp_path / "u2i-0.txt", u2i[0][:1700], u2i[1][:1700], u2i[2][:1700])
    _write_edges(tmp_path / "u2i-1.txt", u2i[0][1700:], u2i[1][1700:], u2i[2][1700:])
    _write_edges(tmp_path / "i2u.txt", *i2u)
    _write_edges(tmp_path / "u2u.txt", u2u[0], u2u[1])
    users = np.unique(np.concatenate([u2i[0], i2u[1], u2u[0], u2u[1]]))
    emb = rng.standard_normal((users.shape[0], 4)).astype(np.float32)
    tags = rng.integers(-(2**62), 2**62, (users.shape[0], 2))
    with open(tmp_path / "nodes.txt", "w") as f:
        for i, u in enumerate(users.tolist()):
            e = " ".join(repr(float(x)) for x in emb[i])
            f.write(f"user\t{u}\temb {e}\ttags {tags[i, 0]} {tags[i, 1]}\n")
        f.write("item\t1000000000000005\tprice 2.5\n")
    return tmp_path, {"u2i": u2i, "i2u": i2u, "u2u": u2u, "users": users, "emb": emb, "tags": tags}


def _load(client: GraphClient, root: Path) -> None:
    assert client.create_graph_table(CFG) is True
    assert client.create_graph_table(CFG) is False  # idempotent
    got = client.load_edges("g", str(root / "u2i-*.txt"), "u2i")
    assert got == {"files": 2, "edges": 3000, "kept": 3000, "skipped": 0}
    client.load_edges("g", [str(root / "i2u.txt")], "i2u")
    client.load_edges("g", str(root / "u2u.txt"), "u2u", reverse=True)
    client.load_nodes("g", str(root / "nodes.txt"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_queries_match_reference(num_servers: int, graph_files) -> None:
    root, ref = graph_files
    src, dst, _ = ref["u2i"]
    eids = np.arange(3000)  # edge ids: consecutive in file order from the first load
    adj = _adjacency(src, dst, eids)
    us, ud, _ = ref["u2u"]
    uadj = _adjacency(np.concatenate([us, ud]), np.concatenate([ud, us]), np.arange(1600) + 4500)
    with graph_cluster(num_servers) as (servers, client):
        _load(client, root)
        # each server holds only the sources it owns
        for index, server in enumerate(servers):
            held = server.graph.tables["g"]._csr("u2i").src
            assert (shard_of(held, 16) % num_servers == index).all()
        nodes = np.concatenate([np.arange(-300, 0), [5, 10**15]]).astype(np.int64)
        np.testing.assert_array_equal(
            client.degree("g", nodes, "u2i"), [len(adj.get(int(n), [])) for n in nodes]
        )
        for fanout in (3, 10_000):
            values, offsets, eid = client.sample_neighbors(
                "g", nodes, fanout, "u2i", return_eids=True, seed=fanout
            )
            assert offsets.shape[0] == nodes.shape[0] + 1
            for i, n in enumerate(nodes.tolist()):
                got = list(
                    zip(
                        values[offsets[i] : offsets[i + 1]].tolist(),
                        eid[offsets[i] : offsets[i + 1]].tolist(),
                    )
                )
                true = adj.get(n, [])
                assert len(set(e for _, e in got)) == len(got)  # no edge twice
                assert set(got) <= set(true)  # true neighbours, with their edge ids
                assert len(got) == min(fanout, len(true))
                if fanout >= len(true):
                    assert sorted(got) == sorted(true)  # the exact neighbour set
        # reverse=True: the u2u edges both ways
        for n in (-1, -50, -299):
            v, o = client.sample_neighbors("g", [n], 10_000, "u2u")
            assert sorted(v.tolist()) == sorted(d for d, _ in uadj.get(n, []))
        # features bit-exact (written with repr, read back as float32)
        users = ref["users"]
        feats = client.node_features("g", users[::-1], node_type="user")
        np.testing.assert_array_equal(feats["emb"].view(np.int32), ref["emb"][::-1].view(np.int32))
        np.testing.assert_array_equal(feats["tags"], ref["tags"][::-1])
        price = client.node_features("g", [10**15 + 5, 77], ["price"], node_type="item")["price"]
        np.testing.assert_array_equal(price, [[2.5], [0.0]])
        # paging over every user: each exactly once
        counts = client.node_counts("g", "user")
        total = sum(counts)
        pages = [client.pull_graph_list("g", s, 37, "user") for s in range(0, total + 37, 37)]
        paged = np.concatenate(pages)
        assert paged.shape[0] == total == np.unique(paged).shape[0]
        assert set(paged.tolist()) == set(users.tolist())
        # random nodes: distinct users, all of them when n >= total
        r = client.random_nodes("g", 50, "user", seed=1)
        assert r.shape[0] == 50 == np.unique(r).shape[0] and set(r.tolist()) <= set(users.tolist())
        assert set(client.random_nodes("g", total + 5, "user").tolist()) == set(users.tolist())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_servers", [1, 3])
def test_walks_follow_edges_and_metapaths(num_servers: int, graph_files) -> None:
    root, ref = graph_files
    u2i = set(zip(ref["u2i"][0].tolist(), ref["u2i"][1].tolist()))
    i2u = set(zip(ref["i2u"][0].tolist(), ref["i2u"][1].tolist()))
    us, ud, _ = ref["u2u"]
    u2u = set(zip(us.tolist(), ud.tolist())) | set(zip(ud.tolist(), us.tolist()))
    with graph_cluster(num_servers) as (_, client):
        _load(client, root)
        starts = np.arange(-300, 0, dtype=np.int64)
        values, offsets = client.random_walk("g", starts, 8, edge_type="u2u", seed=3)
        assert offsets.shape[0] == starts.shape[0] + 1
        deg = dict(zip(starts.tolist(), client.degree("g", starts, "u2u").tolist()))
        for i, s in enumerate(starts.tolist()):
            walk = values[offsets[i] : offsets[i + 1]].tolist()
            assert walk[0] == s and 1 <= len(walk) <= 9
            assert all(pair in u2u for pair in zip(walk, walk[1:]))
            if len(walk) < 9:
                assert client.degree("g", [walk[-1]], "u2u")[0] == 0
            elif deg[s] == 0:
                raise AssertionError("a walk left a node without out-edges")
        values, offsets = client.random_walk("g", starts, 6, metapath=["u2i", "i2u"], seed=4)
        steps = 0
        for i in range(starts.shape[0]):
            walk = values[offsets[i] : offsets[i + 1]].tolist()
            for k, pair in enumerate(zip(walk, walk[1:])):
                assert pair in (u2i if k % 2 == 0 else i2u)
                steps += 1
        assert steps > 300  # walks did cross servers and went on


@pytest.mark.timeout(60)
def test_weighted_sampling_chi_square() -> None:
    cfg = GraphTableConfig("w", edge_types=["e"], num_shards=4)
    weights = np.array([1.0, 2.0, 3.0, 4.0, 10.0], np.float32)
    with graph_cluster(2) as (_, client):
        client.create_graph_table(cfg)
        client.add_edges("w", np.full(5, 42), np.arange(5) + 100, weight=weights)
        draws = 8000
        values, offsets = client.sample_neighbors(
            "w", np.full(draws, 42), 1, weighted=True, seed=11
        )
        assert np.all(np.diff(offsets) == 1)
        observed = np.bincount(values - 100, minlength=5)
        expected = draws * weights / weights.sum()
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < 18.47, (observed, expected)  # df = 4, p = 0.001
        # without replacement, fanout 2: the first pick by weight, never the same edge twice
        values, offsets, w = client.sample_neighbors(
            "w", np.full(2000, 42), 2, weighted=True, return_weights=True, seed=5
        )
        pairs = values.reshape(-1, 2)
        assert np.all(pairs[:, 0] != pairs[:, 1])
        np.testing.assert_array_equal(w, weights[values - 100])
        # uniform: each neighbour about equally often
        values, _ = client.sample_neighbors("w", np.full(draws, 42), 1, seed=6)
        observed = np.bincount(values - 100, minlength=5)
        chi2 = float(((observed - draws / 5) ** 2 / (draws / 5)).sum())
        assert chi2 < 18.47


@pytest.mark.timeout(60)
def test_edits_add_remove() -> None:
    cfg = GraphTableConfig(
        "e", edge_types=["e"], features={"node": {"x": ("float32", 2)}}, num_shards=8
    )
    with graph_cluster(2) as (_, client):
        client.create_graph_table(cfg)
        assert client.add_edges("e", [1, 1, 2, 3], [2, 3, 3, 1], reverse=True) == 8
        v, o = client.sample_neighbors("e", [1, 2, 3], 10)
        assert [sorted(v[o[i] : o[i + 1]].tolist()) for i in range(3)] == [
            [2, 3, 3],
            [1, 3],
            [1, 1, 2],
        ]
        assert client.remove_edges("e", [1, 3], [3, 1]) == 4  # 1->3 and 3->1, twice each
        v, o = client.sample_neighbors("e", [1, 3], 10)
        assert sorted(v[o[0] : o[1]].tolist()) == [2] and sorted(v[o[1] : o[2]].tolist()) == [2]
        x = np.array([[1.5, -2.0], [3.25, 4.0]], np.float32)
        assert client.add_nodes("e", [7, 8], features={"x": x}) == 2
        np.testing.assert_array_equal(client.node_features("e", [8, 7])["x"], x[::-1])
        assert client.remove_nodes("e", [1, 7]) == 2
        assert client.degree("e", [1]).tolist() == [0]
        np.testing.assert_array_equal(client.node_features("e", [7])["x"], [[0, 0]])


@pytest.mark.timeout(60)
def test_large_calls_split_into_messages() -> None:
    """A client with 1 MiB messages: adds, samples and features of 10^5 rows go in parts."""
    cfg = GraphTableConfig("big", edge_types=["e"], features={"node": {"f": ("float32", 8)}})
    rng = np.random.default_rng(3)
    src = rng.integers(0, 50_000, 200_000)
    dst = rng.integers(0, 50_000, 200_000)
    with graph_cluster(2, client_kw={"max_message_mb": 1}) as (_, client):
        client.create_graph_table(cfg)
        assert client.add_edges("big", src, dst) == 200_000
        nodes = np.arange(50_000)
        np.testing.assert_array_equal(
            client.degree("big", nodes), np.bincount(src, minlength=50_000)
        )
        values, offsets, eids = client.sample_neighbors("big", nodes, 100, return_eids=True)
        assert np.array_equal(np.sort(eids), np.arange(200_000))  # every edge once, ids unique
        f = rng.standard_normal((50_000, 8)).astype(np.float32)
        client.add_nodes("big", nodes, features={"f": f})
        np.testing.assert_array_equal(client.node_features("big", nodes[::-1])["f"], f[::-1])


@pytest.mark.timeout(60)
def test_fsspec_urls_globs_and_gzip(tmp_path: Path) -> None:
    """Edge files by fsspec URL (a glob over memory://) and gzip-compressed local files."""
    import gzip

    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/graph-edges/a.txt", b"1\t2\n1\t3\n")
    fs.pipe("/graph-edges/b.txt", b"2\t3\t0.5\n")
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(b"3\t1\n"))
    cfg = GraphTableConfig("fs", edge_types=["e"], num_shards=4)
    with graph_cluster(2) as (_, client):
        client.create_graph_table(cfg)
        got = client.load_edges("fs", ["memory:///graph-edges/*.txt", str(tmp_path / "c.txt.gz")])
        assert got["files"] == 3 and got["edges"] == 4
        v, o, w = client.sample_neighbors("fs", [1, 2, 3], 5, return_weights=True)
        assert [sorted(v[o[i] : o[i + 1]].tolist()) for i in range(3)] == [[2, 3], [3], [1]]
        assert w[o[1]] == 0.5


@pytest.mark.timeout(60)
def test_graph_calls_in_stats_and_metrics() -> None:
    """Graph calls are counted in the server's Stats and Prometheus request metrics."""
    import urllib.request

    from ps_server import telemetry

    port = telemetry.start(0)
    try:
        cfg = GraphTableConfig("m", edge_types=["e"], num_shards=4)
        with graph_cluster(1) as (servers, client):
            client.create_graph_table(cfg)
            client.add_edges("m", [1], [2])
            client.sample_neighbors("m", [1], 3)
            with pytest.raises(Exception, match="fanout"):
                client.sample_neighbors("m", [1], 0.5)
            state = servers[0].state
            assert state.requests["Graph.SampleNeighbors"] >= 1
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
        assert 'op="Graph.SampleNeighbors",table="m"' in text
    finally:
        telemetry.stop()


@pytest.mark.timeout(60)
def test_hub_sampling_is_uniform_without_duplicates() -> None:
    """A hub (degree >= 4x the fanout) is sampled by drawing offsets: still distinct and
    uniform over its neighbours."""
    cfg = GraphTableConfig("hub", edge_types=["e"], num_shards=4)
    with graph_cluster(2) as (_, client):
        client.create_graph_table(cfg)
        client.add_edges("hub", np.full(200, 9), np.arange(200) + 1000)
        draws = 4000
        values, offsets = client.sample_neighbors("hub", np.full(draws, 9), 10, seed=2)
        rows = values.reshape(draws, 10)
        assert all(len(set(r)) == 10 for r in rows.tolist())
        assert rows.min() >= 1000 and rows.max() < 1200
        counts = np.bincount(values - 1000, minlength=200)
        expected = draws * 10 / 200
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 267.5  # df = 199, p = 0.001
