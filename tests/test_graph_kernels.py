"""The graph tables' compiled loops against their numpy twins: the edge-file parser, the CSR's
radix sort, the ownership mask and the uniform sampler (exact where the result is a function of
the input, distribution checks for the sampler)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ps_server.config import GraphTableConfig
from ps_server.core import graph_files, graph_kernels, kernels
from ps_server.core.graph_csr import CSR, stable_order
from ps_server.core.graph_sampling import sample_segments
from ps_server.core.graph_table import GraphTable
from ps_server.core.routing import ROUTE_SALT, shard_of

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not graph_kernels.ENABLED,
        reason="the graph kernels are not built or FLEET_PS_KERNELS=numpy",
    ),
]


def _numpy_parse(data: bytes) -> graph_files.ParsedEdges:
    """The numpy path of graph_files (the compiled parser switched off)."""
    old = graph_kernels.ENABLED
    graph_kernels.ENABLED = False
    try:
        return graph_files.parse_edges("t", data, "f")
    finally:
        graph_kernels.ENABLED = old


@pytest.mark.parametrize(
    "data",
    [
        b"1\t2\n3\t4\n5\t6\n",
        b"1\t2\n3\t4",  # no final newline
        b"1\t2\t0.5\n3\t4\n\n  \n5\t6\t2e-1\r\n",  # weights on some lines, blank lines, CRLF
        b"-9223372036854775807\t9223372036854775806\n +7\t 8 \n",
        b"",
    ],
)
def test_parser_matches_numpy(data: bytes) -> None:
    got = graph_files.parse_edges("t", data, "f")
    ref = _numpy_parse(data)
    assert got.src.tolist() == ref.src.tolist() and got.dst.tolist() == ref.dst.tolist()
    assert (got.weight is None) == (ref.weight is None)
    if ref.weight is not None:
        assert got.weight.tolist() == ref.weight.tolist()


def test_parser_leaves_bad_lines_to_the_named_error() -> None:
    for bad in (b"1\t2\t\n", b"1\n", b"1\t2\t3\t4\n", b"x\t2\n", b"9223372036854775808\t1\n"):
        assert graph_kernels.parse_edges(bad) is None, bad
    with pytest.raises(graph_files.GraphInputError, match="line 2"):
        graph_files.parse_edges("t", b"1\t2\n3\tfour\n", "f")
    skipped = graph_files.parse_edges("t", b"1\t2\n3\tfour\n5\t6\n", "f", on_error="skip")
    assert skipped.src.tolist() == [1, 5] and skipped.skipped == 1
    # nan / inf weights: the Python path parses them (and add_edges refuses them)
    assert graph_files.parse_edges("t", b"1\t2\tinf\n", "f").weight.tolist() == [np.inf]


def test_radix_sort_and_csr_match_numpy() -> None:
    rng = np.random.default_rng(0)
    for keys in (
        rng.integers(0, 1000, 10_000),
        rng.integers(-(2**40), 2**40, 50_000),
        np.full(5, 7),
        np.array([3, 1, 2, 1, 3]),
    ):
        order, ordered = graph_kernels.sort_order(keys)
        ref_order, ref_sorted = stable_order(keys)
        assert np.array_equal(order, ref_order) and np.array_equal(ordered, ref_sorted)
    assert graph_kernels.sort_order(np.array([-(2**62), 2**62])) is None  # too wide: numpy
    src = rng.integers(0, 300, 5000)
    dst = rng.integers(0, 300, 5000)
    w = rng.random(5000).astype(np.float32)
    eid = rng.permutation(5000)
    csr = CSR.build(src, dst, w, eid)
    order = np.argsort(src, kind="stable")
    assert np.array_equal(csr.edge_src(), src[order]) and np.array_equal(csr.dst, dst[order])
    assert np.array_equal(csr.weight, w[order]) and np.array_equal(csr.eid, eid[order])


def test_owned_mask_matches_routing() -> None:
    keys = np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 20_000)
    for servers, shards in ((2, 16), (3, 64), (5, 7)):
        for index in range(servers):
            got = graph_kernels.owned_mask(keys, ROUTE_SALT, shards, servers, index)
            assert np.array_equal(got, shard_of(keys, shards) % servers == index)


def test_uniform_sampler() -> None:
    """Low degrees: every edge in CSR order; higher: distinct and uniform (chi-square), like
    the numpy sampler; the same seed gives the same sample."""
    src = np.array([10, 20, 30], np.int64)
    degs = np.array([3, 25, 200])
    indptr = np.concatenate([[0], np.cumsum(degs)]).astype(np.int64)
    nodes = np.array([30, 10, 99, 20] * 2000, np.int64)
    pos, counts = graph_kernels.sample_uniform(src, indptr, nodes, 10, np.random.default_rng(3))
    assert counts.tolist()[:4] == [10, 3, 0, 10]
    rows = np.split(pos, np.cumsum(counts)[:-1])
    assert rows[1].tolist() == [0, 1, 2]
    for node_rows, lo, deg in ((rows[0::4], 28, 200), (rows[3::4], 3, 25)):
        assert all(len(set(r.tolist())) == 10 for r in node_rows)
        flat = np.concatenate(node_rows) - lo
        assert flat.min() >= 0 and flat.max() < deg
        got = np.bincount(flat, minlength=deg)
        expected = flat.shape[0] / deg
        chi2 = float(((got - expected) ** 2 / expected).sum())
        assert chi2 < deg + 4 * np.sqrt(2 * deg)  # about p = 1e-4
    again = graph_kernels.sample_uniform(src, indptr, nodes, 10, np.random.default_rng(3))
    assert np.array_equal(again[0], pos)
    _, ref_counts = sample_segments(indptr[[2, 0]], degs[[2, 0]], 10, np.random.default_rng(0))
    assert ref_counts.tolist() == counts.tolist()[:2]


def test_parallel_file_load_matches_one_file(tmp_path: Path) -> None:
    """Edge files parsed on several threads give the table one file gives (ids in file order)."""
    rng = np.random.default_rng(2)
    src, dst = rng.integers(0, 500, 4000), rng.integers(0, 500, 4000)
    lines = [f"{a}\t{b}\n" for a, b in zip(src.tolist(), dst.tolist())]
    paths = []
    for k in range(4):
        p = tmp_path / f"part-{k}.txt"
        p.write_text("".join(lines[k * 1000 : (k + 1) * 1000]))
        paths.append(str(p))
    (tmp_path / "all.txt").write_text("".join(lines))
    cfg = GraphTableConfig("g", edge_types=["e"], num_shards=8)
    old = kernels.get_threads()
    kernels.set_threads(3)
    try:
        for servers in (1, 2):
            for index in range(servers):
                many, one = GraphTable(cfg, index, servers), GraphTable(cfg, index, servers)
                many.load_edges(None, paths, reverse=True)
                one.load_edges(None, str(tmp_path / "all.txt"), reverse=True)
                a, b = many._csr("e"), one._csr("e")
                for field in ("src", "indptr", "dst", "weight", "eid"):
                    assert np.array_equal(getattr(a, field), getattr(b, field)), field
    finally:
        kernels.set_threads(old)


def test_reply_merge_matches_numpy() -> None:
    """The client's merge of per-server jagged replies: one memcpy per node = the numpy path."""
    from ps_server.graph_client import _regroup

    rng = np.random.default_rng(4)
    n = 3000
    order = rng.permutation(n)
    positions = [np.sort(order[:1200]), np.sort(order[1200:2900]), order[2900:]]
    counts = [rng.integers(0, 12, p.shape[0]) for p in positions]
    items = [
        [rng.integers(0, 10**6, int(c.sum())), rng.random(int(c.sum())).astype(np.float32)]
        for c in counts
    ]
    got = _regroup(positions, counts, items, n)
    graph_kernels.ENABLED = False
    try:
        ref = _regroup(positions, counts, items, n)
    finally:
        graph_kernels.ENABLED = True
    assert np.array_equal(got[0], ref[0])
    for a, b in zip(got[1], ref[1]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
