"""The compiled sparse-table kernels (ps_server/core/_kernels.c) against the numpy path they replace.

Two tables see the same pulls and pushes — one with the kernels, one with ``kernels.ENABLED``
switched off — and must hold the same rows, optimizer state, counts and flags afterwards.
(tests/test_ps_core.py checks the default path, i.e. the kernels when built, against
torch.optim.)
"""

from __future__ import annotations

import numpy as np
import pytest

from ps_server import (
    SGD,
    Adagrad,
    Adam,
    CountFilterEntry,
    Normal,
    SparseTable,
    SparseTableConfig,
    Uniform,
)
from ps_server.config import NonFinitePolicy
from ps_server.core import kernels
from ps_server.core.batch_ops import distinct
from ps_server.core.hash_index import DictIndex, HashIndex
from ps_server.core.hashing import KeyRNG
from ps_server.core.row_store import RowStore

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(kernels._c is None, reason="C kernels not built (no compiler at install)"),
]

RULES = {
    "sgd": SGD(0.1),
    "sgd_bounded": SGD(0.5, weight_bounds=(-0.02, 0.02)),
    "adagrad": Adagrad(0.05, initial_accumulator_value=0.1),
    "adam": Adam(0.01, betas=(0.8, 0.99), eps=1e-6),
}


def _pair(monkeypatch: pytest.MonkeyPatch, rule, dim: int, **kw) -> tuple[SparseTable, SparseTable]:
    config = SparseTableConfig("k", dim, rule, Uniform(-0.1, 0.1), seed=3, **kw)
    monkeypatch.setattr(kernels, "ENABLED", True)
    fast = SparseTable(config)
    monkeypatch.setattr(kernels, "ENABLED", False)
    slow = SparseTable(config)
    assert fast._fused is not None and slow._fused is None
    return fast, slow


def _same(fast: SparseTable, slow: SparseTable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "ENABLED", False)
    a, b = fast.store, slow.store
    ka, kb = a.keys[a.live_rows()], b.keys[b.live_rows()]
    assert sorted(ka.tolist()) == sorted(kb.tolist())
    ra, rb = a.lookup(ka), b.lookup(ka)
    np.testing.assert_allclose(a.cols["values"][ra], b.cols["values"][rb], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(a.cols["state"][ra], b.cols["state"][rb], rtol=1e-6, atol=1e-7)
    for col in ("count", "unseen_days"):
        np.testing.assert_array_equal(a.cols[col][ra], b.cols[col][rb])
    np.testing.assert_array_equal(a.flags[ra], b.flags[rb])


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("dim", [1, 8, 13])
def test_push_matches_numpy(monkeypatch: pytest.MonkeyPatch, name: str, dim: int) -> None:
    fast, slow = _pair(monkeypatch, RULES[name], dim)
    rng = np.random.default_rng(dim)
    universe = rng.integers(-(2**63), 2**63 - 1, size=3000, dtype=np.int64)
    for step in range(12):
        keys = rng.choice(universe, size=2000)  # with duplicates
        if step % 3 == 0:
            keys = np.unique(keys)  # and batches without
        grads = rng.standard_normal((keys.shape[0], dim)).astype(np.float32)
        pulled, stats = [], []
        for t in (fast, slow):
            monkeypatch.setattr(kernels, "ENABLED", t is fast)
            pulled.append(t.pull(keys))
            stats.append(t.push(keys, grads))
            if step % 5 == 4:
                t.end_day()
        np.testing.assert_allclose(pulled[0], pulled[1], rtol=1e-6, atol=1e-7)
        assert stats[0] == stats[1]
        assert stats[0].applied == np.unique(keys).shape[0]
        assert not (fast.store.flags & 0x80).any(), "the kernel's transient row mark leaked"
    _same(fast, slow, monkeypatch)


def test_entry_and_nonfinite_skip_match(monkeypatch: pytest.MonkeyPatch) -> None:
    fast, slow = _pair(
        monkeypatch, Adagrad(0.1), 4, entry=CountFilterEntry(3), nonfinite=NonFinitePolicy.SKIP
    )
    rng = np.random.default_rng(7)
    for _ in range(8):
        keys = rng.integers(0, 500, size=700).astype(np.int64)
        grads = rng.standard_normal((700, 4)).astype(np.float32)
        grads[rng.integers(0, 700, size=5)] = np.nan
        out = []
        for t in (fast, slow):
            monkeypatch.setattr(kernels, "ENABLED", t is fast)
            out.append(t.push(keys, grads))
        assert out[0] == out[1]
    _same(fast, slow, monkeypatch)


def test_kernel_rejects_bad_arguments() -> None:
    c = kernels._c
    cap, dim = 4, 2
    cols = {
        "values": np.zeros((cap, dim), np.float32),
        "state": np.zeros((cap, dim), np.float32),
        "count": np.zeros(cap, np.uint32),
        "unseen_days": np.zeros(cap, np.uint16),
    }
    flags = np.zeros(cap, np.uint8)
    hyper = np.zeros(8)
    g = np.zeros((1, dim), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        kernels.push(1, hyper, cols, flags, np.array([cap]), g)
    with pytest.raises(ValueError, match="unknown rule"):
        kernels.push(7, hyper, cols, flags, np.array([0]), g)
    with pytest.raises(ValueError, match="wrong width"):
        kernels.push(2, hyper, cols, flags, np.array([0]), g)  # adam needs 2*dim+1 state
    with pytest.raises(TypeError, match="stored_keys"):
        c.probe(
            np.full(8, -1, np.int32),
            np.zeros(4, np.int32),
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
        )


@pytest.mark.parametrize(
    ("num_servers", "num_shards"), [(1, 64), (2, 64), (3, 64), (7, 100), (16, 16)]
)
def test_group_by_server_matches_numpy(
    monkeypatch: pytest.MonkeyPatch, num_servers: int, num_shards: int
) -> None:
    """The client's routing: the compiled counting sort gives the numpy path's groups (the
    positions, and the keys at them)."""
    from ps_server.core.routing import group_by_server, split_by_server

    keys = np.random.default_rng(num_servers).integers(-(2**63), 2**63 - 1, 50_000, dtype=np.int64)
    keys[:100] = keys[100:200]  # duplicates keep their positions
    monkeypatch.setattr(kernels, "ENABLED", True)
    fast = group_by_server(keys, num_servers, num_shards)
    monkeypatch.setattr(kernels, "ENABLED", False)
    ref = group_by_server(keys, num_servers, num_shards)
    assert len(fast) == len(ref) == num_servers
    for a, b in zip(fast, ref):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(kernels, "ENABLED", True)
    pos, grouped = split_by_server(keys, num_servers, num_shards)
    monkeypatch.setattr(kernels, "ENABLED", False)
    ref_pos, ref_keys = split_by_server(keys, num_servers, num_shards)
    for p, k, rp, rk in zip(pos, grouped, ref_pos, ref_keys, strict=True):
        np.testing.assert_array_equal(p, rp)
        np.testing.assert_array_equal(k, rk)
        np.testing.assert_array_equal(k, keys[p])
    with pytest.raises(ValueError, match="num_servers <= num_shards"):
        kernels._c.group(keys, 1, 4, 5, np.empty_like(keys))


def test_scatter_matches_numpy() -> None:
    """``scatter`` puts rows back at their positions (the client's replies), any dtype."""
    rng = np.random.default_rng(8)
    pos = rng.permutation(4000)[:2500]
    for src in (rng.standard_normal((2500, 8)).astype(np.float32), rng.integers(0, 99, 2500)):
        dst = np.zeros((4000, *src.shape[1:]), src.dtype)
        ref = dst.copy()
        kernels.scatter(src, pos, dst)
        ref[pos] = src
        np.testing.assert_array_equal(dst, ref)
    with pytest.raises(ValueError, match="out of range"):
        kernels.scatter(np.zeros((1, 2), np.float32), np.array([-1]), np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="like dst"):
        kernels.scatter(np.zeros((1, 2), np.float32), np.array([0]), np.zeros((3, 2), np.float64))


@pytest.mark.parametrize("state_dim", [0, 1, 16])
def test_pack_matches_numpy_records(state_dim: int) -> None:
    """``pack`` fills an SSD table's cold records (template + gathered columns) as numpy's field
    assignments do, byte for byte, split over threads too; bad rows or fields are refused."""
    from ps_server.core.ssd_tier import record_dtype

    rng = np.random.default_rng(9)
    dt = record_dtype(8, state_dim)
    cols = {
        "values": rng.standard_normal((30_000, 8)).astype(np.float32),
        "state": rng.standard_normal((30_000, state_dim)).astype(np.float32),
        "count": rng.integers(0, 1 << 31, 30_000).astype(np.uint32),
        "unseen_days": rng.integers(0, 999, 30_000).astype(np.uint16),
        "flags": rng.integers(0, 255, 30_000).astype(np.uint8),
    }
    tail = np.zeros(1, dt)
    tail["day"], tail["seq"], tail["export_epoch"] = 4, 1 << 40, 7
    rows = rng.permutation(30_000)[:20_000]
    ref = np.empty(20_000, dt)
    ref[...] = tail[0]
    for name, col in cols.items():
        ref[name] = col[rows]
    for threads in (1, 3):
        kernels.set_threads(threads)
        try:
            got = np.empty(20_000, dt)
            kernels.pack(got, tail, rows, cols)
        finally:
            kernels.set_threads(1)
        assert got.tobytes() == ref.tobytes()
    with pytest.raises(ValueError, match="out of range"):
        kernels.pack(np.empty(1, dt), tail, np.array([30_000]), cols)
    with pytest.raises(ValueError, match="field 'count' takes uint32"):
        kernels.pack(np.empty(1, dt), tail, np.array([0]), {"count": cols["flags"]})


def test_pull_into_out_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SparseTable.pull(keys, out)`` fills ``out`` (hits, new rows and unadmitted keys) with
    what ``pull(keys)`` returns, compiled or not; a wrong ``out`` is refused."""
    from ps_server.errors import TableInputError

    keys = np.random.default_rng(6).integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64)
    for enabled in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", enabled)
        config = SparseTableConfig("o", 4, SGD(0.1), Uniform(-1, 1), entry=CountFilterEntry(2))
        table = SparseTable(config)
        table.pull(keys[:1000])  # seen once: admitted on the second pull below
        out = np.full((3000, 4), np.nan, np.float32)
        got = table.pull(keys, out)
        assert got is out
        np.testing.assert_array_equal(out, table.pull(keys))
        with pytest.raises(TableInputError, match="out"):
            table.pull(keys, np.zeros((3000, 5), np.float32))


@pytest.mark.parametrize("num_shards", [64, 100])
def test_first_unowned_matches_shard_of(num_shards: int) -> None:
    """The servers' routing check: the compiled pass finds the first key of a shard the
    server does not own, as ``shard_of`` does."""
    from ps_server.core.routing import ROUTE_SALT, shard_of

    rng = np.random.default_rng(num_shards)
    keys = rng.integers(-(2**63), 2**63 - 1, 20_000, dtype=np.int64)
    shards = shard_of(keys, num_shards)
    owned = np.zeros(num_shards, np.uint8)
    owned[np.unique(shards[:15_000])] = 1
    expect = np.flatnonzero(owned[shards] == 0)
    got = kernels.first_unowned(keys, ROUTE_SALT, owned)
    assert got == (int(expect[0]) if expect.size else -1)
    owned[:] = 1
    assert kernels.first_unowned(keys, ROUTE_SALT, owned) == -1
    with pytest.raises(ValueError, match="empty"):
        kernels.first_unowned(keys, ROUTE_SALT, np.zeros(0, np.uint8))


@pytest.mark.parametrize("name", ["sgd_bounded", "adagrad", "adam"])
def test_kernels_split_over_threads_give_the_single_thread_result(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Batches large enough to be split (parts of >= 8192 keys) over 3 table threads: pulls,
    pushes with and without duplicates, and the resulting rows, state, counts and flags equal
    one thread's bit for bit."""
    config = SparseTableConfig("th", 5, RULES[name], Uniform(-0.1, 0.1), seed=4)
    rng = np.random.default_rng(11)
    universe = rng.integers(-(2**63), 2**63 - 1, size=60_000, dtype=np.int64)
    batches = [np.unique(rng.choice(universe, 40_000)), rng.choice(universe, 40_000)]
    grads = [rng.standard_normal((b.shape[0], 5)).astype(np.float32) for b in batches]
    tables = []
    try:
        for threads in (1, 3):
            kernels.set_threads(threads)
            table = SparseTable(config)
            pulled = [table.pull(b) for b in batches for _ in range(2)]
            stats = [table.push(b, g) for b, g in zip(batches, grads, strict=True)]
            tables.append((table, pulled, stats, table.pull(universe)))
    finally:
        kernels.set_threads(1)
    (a, pa, sa, ua), (b, pb, sb, ub) = tables
    for x, y in zip(pa, pb, strict=True):
        np.testing.assert_array_equal(x, y)
    assert sa == sb
    np.testing.assert_array_equal(ua, ub)
    ra, rb = a.store.lookup(universe), b.store.lookup(universe)
    for col in ("values", "state", "count", "unseen_days"):
        np.testing.assert_array_equal(a.store.cols[col][ra], b.store.cols[col][rb])
    np.testing.assert_array_equal(a.store.flags[ra], b.store.flags[rb])
    assert not (b.store.flags & 0x80).any()
    with pytest.raises(ValueError, match=">= 1"):
        kernels.set_threads(0)


# -- row creation -------------------------------------------------------------------------------
INITIALIZERS = {
    "uniform": Uniform(-0.01, 0.01),
    "uniform_wide": Uniform(-3, 5),
    "normal": Normal(0.0, 0.5),  # compiled where libm's log / cos give numpy's values
}


@pytest.mark.parametrize("init", sorted(INITIALIZERS))
@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_creation_matches_numpy_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, init: str, rule: str
) -> None:
    """Rows created by pulls and pushes of new keys (duplicates included, through the row
    arrays' growth and the index's rebuilds): the compiled path allocates the same rows in the
    same order with the same values, state, counts and flags as the numpy path, and the values
    are the initializer's numpy ``generate`` bit for bit."""
    config = SparseTableConfig("cr", 5, RULES[rule], INITIALIZERS[init], seed=9)
    tables = []
    for enabled in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", enabled)
        rng = np.random.default_rng(5)
        table = SparseTable(config)
        pulled = []
        for step in range(6):
            keys = rng.integers(-(2**63), 2**63 - 1, size=9000, dtype=np.int64)
            keys[:500] = keys[500:1000]  # duplicates within the batch
            pulled.append(table.pull(keys))
            grads = rng.standard_normal((keys.shape[0], 5)).astype(np.float32)
            table.push(rng.integers(0, 2**40, size=3000, dtype=np.int64), grads[:3000])
            if step == 3:
                table.store.remove_rows(table.store.live_rows()[::7])  # freed rows get reused
        tables.append((table, pulled))
    (a, pa), (b, pb) = tables
    for x, y in zip(pa, pb, strict=True):
        np.testing.assert_array_equal(x, y)
    hw = a.store.high_water
    assert hw == b.store.high_water
    np.testing.assert_array_equal(a.store.keys[:hw], b.store.keys[:hw])
    np.testing.assert_array_equal(a.store.flags[:hw], b.store.flags[:hw])
    for col in ("values", "state", "count", "unseen_days"):
        np.testing.assert_array_equal(a.store.cols[col][:hw], b.store.cols[col][:hw])
    fresh = np.array([0, -1, 2**63 - 1, -(2**63), 12345], dtype=np.int64)
    monkeypatch.setattr(kernels, "ENABLED", True)
    got = a.pull(fresh)
    ref = INITIALIZERS[init].generate(KeyRNG("cr", 9, fresh, "init"), 5).astype(np.float32)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("dim", [1, 8, 13])
def test_uniform_kernel_equals_generate(monkeypatch: pytest.MonkeyPatch, dim: int) -> None:
    """The compiled Uniform rows (a new array, or written into rows of a column) equal the
    numpy ``generate`` bit for bit, for any table, seed and bounds."""
    keys = np.random.default_rng(dim).integers(-(2**63), 2**63 - 1, size=5000, dtype=np.int64)
    keys[:4] = [0, -1, 2**63 - 1, -(2**63)]
    for init, table, seed in [
        (Uniform(), "t", 0),
        (Uniform(-1e-3, 2.5), "emb_user", 2**40 + 7),
        (Uniform(1, 1), "x", -3),
    ]:
        ref = init.generate(KeyRNG(table, seed, keys, "init"), dim).astype(np.float32)
        monkeypatch.setattr(kernels, "ENABLED", True)
        np.testing.assert_array_equal(init.rows(table, seed, keys, dim), ref)
        column = np.zeros((7000, dim), np.float32)
        rows = np.random.default_rng(0).permutation(7000)[:5000]
        init.write_rows(table, seed, keys, column, rows)
        np.testing.assert_array_equal(column[rows], ref)
        init.write_rows(table, seed, keys, column, slice(1000, 6000))
        np.testing.assert_array_equal(column[1000:6000], ref)
        monkeypatch.setattr(kernels, "ENABLED", False)
        np.testing.assert_array_equal(init.rows(table, seed, keys, dim), ref)


def test_distinct_matches_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Distinct keys in order of first occurrence, with the inverse and the counts, the same
    on both paths."""
    rng = np.random.default_rng(3)
    for n, high in [(0, 1), (1, 5), (50_000, 20_000), (50_000, 2**62)]:
        keys = rng.integers(-high, high, size=n, dtype=np.int64)
        out = []
        for enabled in (True, False):
            monkeypatch.setattr(kernels, "ENABLED", enabled)
            out.append(distinct(keys))
        for x, y in zip(*out, strict=True):
            np.testing.assert_array_equal(x, y)
        uniq, inverse, counts = out[0]
        np.testing.assert_array_equal(uniq[inverse], keys)
        assert counts.sum() == n and len(set(uniq.tolist())) == uniq.shape[0]


def test_index_inserts_and_rebuilds_find_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled index insert and rebuild (growth, tombstones) against a dict index."""
    monkeypatch.setattr(kernels, "ENABLED", True)
    rng = np.random.default_rng(4)
    stores = [RowStore({"v": ((2,), np.float32)}, index_factory=f) for f in (HashIndex, DictIndex)]
    universe = rng.integers(-(2**63), 2**63 - 1, size=120_000, dtype=np.int64)
    for lo in range(0, universe.shape[0], 20_000):
        for st in stores:
            st.allocate(universe[lo : lo + 20_000])
            st.remove_rows(st.lookup(universe[lo : lo + 3000]))
    probe = np.concatenate([universe, rng.integers(0, 99, size=1000, dtype=np.int64)])
    np.testing.assert_array_equal(stores[0].lookup(probe), stores[1].lookup(probe))
    with pytest.raises(ValueError, match="outside the key column"):
        kernels.insert(np.full(16, -1, np.int32), np.zeros(4, np.int64), probe[:1], np.array([4]))


def test_row_arrays_grow_in_place_and_keep_their_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large row arrays grow by extending their reservation (no copy); a view held elsewhere
    makes the growth copy instead; rows, zeros past the high-water mark, compaction and the
    memory tracemalloc sees are as with ordinary arrays."""
    import tracemalloc

    monkeypatch.setattr(kernels, "ENABLED", True)
    st = RowStore({"v": ((16,), np.float32), "c": ((), np.uint32)})
    keys = np.arange(1, 400_001, dtype=np.int64)
    held = None
    tracemalloc.start()
    try:
        for lo in range(0, keys.shape[0], 50_000):
            rows = st.allocate(keys[lo : lo + 50_000])
            st.cols["v"][rows] = keys[lo : lo + 50_000, None].astype(np.float32)
            st.cols["c"][rows] = 1
            if lo == 200_000:
                held = st.cols["v"]  # alive across the next growth: that one copies
        traced = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert st._reserved["v"] is not None and held is not None
    assert traced >= st.capacity * 64  # the values column is accounted at its length
    rows = st.lookup(keys)
    np.testing.assert_array_equal(st.cols["v"][rows, 3], keys.astype(np.float32))
    assert not st.cols["v"][st.high_water :].any() and not st.cols["c"][st.high_water :].any()
    st.remove_rows(rows[::2])
    st.compact()
    rows = st.lookup(keys[1::2])
    np.testing.assert_array_equal(st.cols["v"][rows, 0], keys[1::2].astype(np.float32))
    assert st._reserved["v"] is None and st.capacity < 300_000


def test_a_call_may_take_more_threads_for_itself() -> None:
    """``threads_for_call``: this thread's kernel calls split over more threads (a pass's
    pull), the same rows as one thread; another thread and the code after the block keep the
    table threads."""
    import threading

    config = SparseTableConfig("tfc", 8, RULES["adam"], Normal(0.0, 0.1), seed=2)
    keys = np.random.default_rng(3).integers(0, 2**40, 50_000, dtype=np.int64)
    one = SparseTable(config).pull_with_state(keys)
    seen = []
    with kernels.threads_for_call(4):
        seen.append(kernels._split())
        other = threading.Thread(target=lambda: seen.append(kernels._split()))
        other.start()
        other.join()
        many = SparseTable(config).pull_with_state(keys)
    seen.append(kernels._split())
    assert seen == [4, kernels.get_threads(), kernels.get_threads()]
    for x, y in zip(one, many, strict=True):
        np.testing.assert_array_equal(x, y)
