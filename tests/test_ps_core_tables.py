"""ps_server sparse and dense tables: duplicates, admission, aging, eviction, non-finite
gradients, input errors, storage (index vs a dict oracle, memory per row), thread safety."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ps_server import (
    SGD,
    Adagrad,
    Adam,
    Constant,
    CountFilterEntry,
    DenseTable,
    DenseTableConfig,
    Normal,
    ProbabilityEntry,
    SparseTable,
    SparseTableConfig,
    Uniform,
)
from ps_server.core.hash_index import DictIndex, HashIndex
from ps_server.errors import (
    NonFiniteGradientError,
    TableCapacityError,
    TableInputError,
    TableNotFoundError,
    WrongShardError,
)

I64 = np.iinfo(np.int64)


def table(dim: int = 4, lr: float = 1.0, init=None, **kw) -> SparseTable:
    return SparseTable(SparseTableConfig("emb", dim, SGD(lr), init or Constant(0.5), **kw))


def k(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def g(rows: list[list[float]]) -> np.ndarray:
    return np.array(rows, dtype=np.float32)


def meta(t: SparseTable, key: int) -> tuple[int, int]:
    """(count, unseen_days) of one key's row."""
    row = int(t.store.lookup(k(key))[0])
    assert row >= 0, f"key {key} has no row"
    return int(t.store.cols["count"][row]), int(t.store.cols["unseen_days"][row])


@pytest.mark.timeout(30)
def test_full_int64_range_keys_and_duplicates_summed() -> None:
    t = table(dim=2)
    keys = k(I64.min, -1, 0, 1, I64.max)
    assert t.pull(keys).shape == (5, 2) and t.num_rows == 5
    stats = t.push(
        k(I64.min, I64.max, I64.min, 0, I64.min), g([[1, 2], [3, 4], [10, 20], [5, 5], [100, 200]])
    )
    assert (stats.num_keys, stats.applied, stats.created) == (5, 3, 0)
    np.testing.assert_allclose(
        t.pull(keys), [[-110.5, -221.5], [0.5, 0.5], [-4.5, -4.5], [0.5, 0.5], [-2.5, -3.5]]
    )
    assert meta(t, I64.min) == (3, 0) and meta(t, I64.max) == (1, 0) and meta(t, -1) == (0, 0)
    # a push creates missing rows from the initializer and then updates them
    t.push(k(42, 42), g([[1, 1], [1, 1]]))
    np.testing.assert_allclose(t.pull(k(42)), [[-1.5, -1.5]])
    assert (
        t.pull(np.zeros(0, np.int64)).shape == (0, 2)
        and t.push(np.zeros(0, np.int64), np.zeros((0, 2), np.float32)).applied == 0
    )


@pytest.mark.timeout(30)
def test_count_filter_entry() -> None:
    t = table(dim=2, init=Normal(0, 1), entry=CountFilterEntry(3))
    init = t.initial_values(k(7, 8))
    # pulls serve the deterministic initial value and store nothing
    np.testing.assert_array_equal(t.pull(k(7, 8, 7)), init[[0, 1, 0]])
    assert (t.num_rows, t.num_pending) == (0, 0)
    s1 = t.push(k(7), g([[1, 1]]))
    s2 = t.push(k(7, 8), g([[1, 1], [1, 1]]))
    assert (s1.filtered, s2.filtered, s2.created, t.num_rows, t.num_pending) == (1, 2, 0, 0, 2)
    np.testing.assert_array_equal(t.pull(k(7)), init[:1])
    s3 = t.push(k(7), g([[2, 3]]))  # third push of 7: admitted, and this push is applied
    assert (s3.created, s3.applied, s3.filtered, t.num_rows, t.num_pending) == (1, 1, 0, 1, 1)
    np.testing.assert_allclose(t.pull(k(7)), init[:1] - [[2, 3]], rtol=1e-6)
    assert meta(t, 7) == (3, 0)
    # occurrences in one push count: 8 has 1, +2 = 3 -> admitted with both summed
    s4 = t.push(k(8, 8), g([[1, 0], [1, 0]]))
    assert (s4.created, t.num_rows, t.num_pending) == (1, 2, 0)
    np.testing.assert_allclose(t.pull(k(8)), init[1:] - [[2, 0]], rtol=1e-6)
    st = t.stats()
    assert (st["rows_created"], st["pushes_filtered"], st["pulls_unadmitted"]) == (2, 3, 4)
    # pending keys age and shrink like rows
    t.push(k(99), g([[1, 1]]))
    t.end_day()
    t.end_day()
    assert t.shrink(1) == 0 and t.num_pending == 1
    t.end_day()
    assert t.shrink(1) == 2 and t.num_pending == 0 and t.stats()["pending_shrunk"] == 1


@pytest.mark.timeout(30)
def test_probability_entry_is_deterministic_per_key_and_seed() -> None:
    keys = np.arange(-10_000, 10_000, dtype=np.int64)

    def admitted(seed: int, p: float, name: str = "emb") -> np.ndarray:
        t = SparseTable(
            SparseTableConfig(
                name, 2, SGD(1.0), Constant(0.0), entry=ProbabilityEntry(p), seed=seed
            )
        )
        t.pull(keys)
        return t.store.lookup(keys) >= 0

    a = admitted(1, 0.3)
    assert abs(a.mean() - 0.3) < 0.02
    np.testing.assert_array_equal(a, admitted(1, 0.3))
    assert (a != admitted(2, 0.3)).mean() > 0.3
    assert not admitted(1, 0.0).any() and admitted(1, 1.0).all()
    # refused keys: pulls give the initial value, pushes are dropped and counted
    t = SparseTable(
        SparseTableConfig("emb", 2, SGD(1.0), Constant(0.5), entry=ProbabilityEntry(0.3), seed=1)
    )
    refused = keys[~a][:5]
    stats = t.push(np.concatenate([refused, keys[a][:2]]), np.ones((7, 2), np.float32))
    assert (stats.filtered, stats.created, stats.applied) == (5, 2, 2)
    np.testing.assert_array_equal(t.pull(refused), np.full((5, 2), 0.5, np.float32))


@pytest.mark.timeout(30)
def test_end_day_and_shrink() -> None:
    t = table()
    t.push(k(1), g([[1, 1, 1, 1]]))
    t.pull(k(2))  # pulls create but do not count as seen
    t.end_day()
    assert meta(t, 1) == (1, 0) and meta(t, 2) == (0, 1)
    t.end_day()
    assert meta(t, 1) == (1, 1) and meta(t, 2) == (0, 2)
    t.pull(k(1, 2))
    assert meta(t, 1)[1] == 1  # still unseen: a pull is a read
    t.push(k(1), g([[1, 1, 1, 1]]))
    assert meta(t, 1) == (2, 0)
    assert t.shrink(1) == 1 and t.num_rows == 1 and t.store.lookup(k(2))[0] == -1
    t.end_day()
    assert meta(t, 1) == (2, 0)  # pushed since the previous end_day
    assert t.shrink(0) == 0
    t.end_day()
    assert t.shrink(0) == 1 and t.num_rows == 0
    # a shrink that empties most of the table compacts it and the table keeps working
    t.pull(np.arange(5000, dtype=np.int64))
    cap = t.store.capacity
    t.end_day()
    t.push(np.arange(100, dtype=np.int64), np.zeros((100, 4), np.float32))
    assert t.shrink(0) == 4900 and t.store.capacity < cap
    np.testing.assert_array_equal(t.pull(np.arange(100, dtype=np.int64)), np.full((100, 4), 0.5))
    with pytest.raises(TableInputError, match="max_unseen_days"):
        t.shrink(-1)


@pytest.mark.timeout(30)
def test_max_capacity_evicts_longest_unseen() -> None:
    t = table(max_capacity=100)
    old, mid, new = np.arange(0, 30), np.arange(30, 60), np.arange(60, 100)
    t.pull(old.astype(np.int64))
    t.end_day()
    t.pull(mid.astype(np.int64))
    t.end_day()
    t.push(new.astype(np.int64), np.zeros((40, 4), np.float32))
    t.push(k(0), np.zeros((1, 4), np.float32))  # key 0 is fresh again
    cap = t.store.capacity
    # 20 new keys (+ key 1, which is old but touched by this batch: it must survive)
    stats_before = t.stats()["rows_evicted"]
    t.pull(np.concatenate([np.arange(1000, 1020), [1]]).astype(np.int64))
    assert t.num_rows == 100 and t.stats()["rows_evicted"] - stats_before == 20
    present = t.store.lookup(np.arange(100, dtype=np.int64)) >= 0
    assert present[0] and present[1] and present[30:].all() and present[2:30].sum() == 8
    s = t.push(np.arange(2000, 2035, dtype=np.int64), np.zeros((35, 4), np.float32))
    assert s.evicted == 35 and t.num_rows == 100 and t.store.capacity == cap  # rows reused
    with pytest.raises(TableCapacityError, match="max_capacity"):
        t.pull(np.arange(5000, 5101, dtype=np.int64))


@pytest.mark.timeout(30)
def test_nonfinite_reject_and_skip() -> None:
    t = table(dim=2)
    t.pull(k(1, 2))
    before = t.pull(k(1, 2))
    grads = g([[1, np.nan], [1, 1], [np.inf, -np.inf]])
    with pytest.raises(NonFiniteGradientError) as info:
        t.push(k(1, 2, 3), grads)
    assert "'emb'" in str(info.value) and "3 non-finite value(s)" in str(info.value)
    assert "2 row(s)" in str(info.value) and info.value.field == "grads"
    np.testing.assert_array_equal(t.pull(k(1, 2)), before)
    assert t.num_rows == 2 and meta(t, 1) == (0, 0)  # nothing applied, key 3 not created
    s = table(dim=2, nonfinite="skip")
    stats = s.push(k(1, 2, 3), grads)
    assert (stats.skipped_nonfinite, stats.applied, s.num_rows) == (2, 1, 1)
    np.testing.assert_array_equal(s.pull(k(2)), [[-0.5, -0.5]])
    assert s.stats()["nonfinite_skipped"] == 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("keys", "grads", "field", "text"),
    [
        (np.array([1, 2], np.int32), None, "keys", "int64"),
        ([1, 2], None, "keys", "numpy"),
        (np.zeros((2, 1), np.int64), None, "keys", "1-D"),
        (k(1, 2), np.zeros((2, 4), np.float64), "grads", "float32"),
        (k(1, 2), np.zeros((2, 3), np.float32), "grads", "(2, 4)"),
        (k(1, 2), np.zeros((3, 4), np.float32), "grads", "(2, 4)"),
    ],
)
def test_bad_inputs_name_table_and_field(keys, grads, field: str, text: str) -> None:
    t = table()
    with pytest.raises(TableInputError) as info:
        if grads is None:
            t.pull(keys)
        else:
            t.push(keys, grads)
    assert info.value.table == "emb" and info.value.field == field
    assert "'emb'" in str(info.value) and text in str(info.value)


@pytest.mark.timeout(30)
def test_wrong_server_keys_are_rejected() -> None:
    cfg = SparseTableConfig("emb", 2, SGD(0.1), Constant(0.0), num_shards=8)
    server0 = SparseTable.for_server(cfg, 0, 2)
    keys = np.arange(100, dtype=np.int64)
    with pytest.raises(WrongShardError, match="group_by_server"):
        server0.pull(keys)
    assert server0.num_rows == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1])
def test_hash_index_matches_dict_oracle(seed: int) -> None:
    """Random pulls/pushes/evictions/shrinks on a HashIndex table and a DictIndex table agree."""
    rng = np.random.default_rng(seed)
    cfg = SparseTableConfig("emb", 3, Adagrad(0.1), Normal(0, 0.1), max_capacity=3000)
    a, b = SparseTable(cfg, index_factory=HashIndex), SparseTable(cfg, index_factory=DictIndex)
    pool = rng.integers(I64.min, I64.max, 6000, dtype=np.int64)
    for step in range(40):
        keys = pool[rng.integers(0, pool.size if step > 5 else 500, 700)]
        if step % 3 == 0:
            np.testing.assert_array_equal(a.pull(keys), b.pull(keys))
        else:
            grads = rng.standard_normal((keys.size, 3)).astype(np.float32)
            assert a.push(keys, grads) == b.push(keys, grads)
        if step % 7 == 6:
            a.end_day(), b.end_day()
        if step % 13 == 12:
            assert a.shrink(1) == b.shrink(1)
        assert a.num_rows == b.num_rows
    for part in np.array_split(pool, 6):
        np.testing.assert_array_equal(a.pull(part), b.pull(part))


@pytest.mark.timeout(60)
def test_memory_per_row_within_1_5x_payload() -> None:
    t = SparseTable(SparseTableConfig("emb", 8, Adagrad(0.05), Uniform()))
    keys = np.arange(200_000, dtype=np.int64) * 7919 - 10**15
    for i in range(0, keys.size, 65536):
        t.pull(keys[i : i + 65536])
    payload = 8 + 4 * 8 + 4 * 8 + 4 + 2
    assert t.payload_bytes_per_row() == payload and t.num_rows == 200_000
    per_row = t.memory_bytes / t.num_rows
    assert per_row <= 1.5 * payload, f"{per_row:.1f} B/row > 1.5 x {payload}"


@pytest.mark.timeout(30)
def test_concurrent_pushes_are_serialised() -> None:
    t = table(dim=2, init=Constant(0.0))
    keys = np.arange(50, dtype=np.int64)

    def worker() -> None:
        for _ in range(20):
            t.push(keys, np.ones((50, 2), np.float32))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    np.testing.assert_array_equal(t.pull(keys), np.full((50, 2), -80.0, np.float32))
    assert meta(t, 3) == (80, 0)


@pytest.mark.timeout(30)
def test_dense_table_init_pull_push_and_errors() -> None:
    t = DenseTable(DenseTableConfig("dense", SGD(0.5), num_shards=4))
    w = np.arange(6, dtype=np.float32)
    assert t.init("w", w) is True and t.init("w", w.copy()) is False
    with pytest.raises(TableInputError, match="already exists with other values"):
        t.init("w", w + 1)
    t.push("w", np.ones(6, np.float32))
    np.testing.assert_array_equal(t.pull("w"), w - 0.5)
    with pytest.raises(TableNotFoundError, match="no dense block 'b'"):
        t.pull("b")
    with pytest.raises(TableInputError, match="has 5 elements"):
        t.push("w", np.ones(5, np.float32))
    with pytest.raises(TableInputError, match="float32"):
        t.push("w", np.ones(6, np.float64))
    with pytest.raises(NonFiniteGradientError, match="'dense'"):
        t.push("w", np.full(6, np.nan, np.float32))
    skip = DenseTable(DenseTableConfig("dense", SGD(0.5), nonfinite="skip"))
    skip.init("w", w)
    assert skip.push("w", np.full(6, np.inf, np.float32)) is False
    np.testing.assert_array_equal(skip.pull("w"), w)
    part = DenseTable.for_server(DenseTableConfig("dense", SGD(0.5), num_shards=4), 0, 4)
    names = [f"layer{i}.weight" for i in range(20)]
    mine = [n for n in names if _owns(part, n)]
    assert 0 < len(mine) < 20
    with pytest.raises(WrongShardError, match="block_shard"):
        part.init(next(n for n in names if n not in mine), w)


def _owns(t: DenseTable, name: str) -> bool:
    from ps_server import block_shard

    return block_shard(name, t.config.num_shards) in t.shards


@pytest.mark.timeout(30)
def test_add_delta_adds_without_the_rule_and_counts_as_a_push() -> None:
    """GEO deltas (``SparseTable.add_delta``): duplicates summed, no optimizer rule, rows made
    as a pull makes them (keys the entry policy has not admitted are filtered), and the rows
    count as pushed (count += occurrences, unseen_days = 0); NaN/inf follow ``nonfinite``."""
    t = table(dim=2, entry=CountFilterEntry(2))
    t.push(k(7, 7), g([[0, 0], [0, 0]]))  # admitted by its second occurrence
    t.end_day()
    t.end_day()
    assert meta(t, 7) == (2, 1)
    stats = t.add_delta(k(7, 8, 7), g([[1, 2], [5, 5], [10, 20]]))
    assert stats.to_dict() == {
        "num_keys": 3,
        "applied": 1,
        "created": 0,
        "filtered": 1,
        "skipped_nonfinite": 0,
        "evicted": 0,
    }
    np.testing.assert_allclose(t.pull(k(7)), [[11.5, 22.5]])
    assert meta(t, 7) == (4, 0) and t.num_rows == 1 and t.num_pending == 0
    bad = g([[1, np.nan], [1, 1]])
    s = table(dim=2, nonfinite="skip")
    stats = s.add_delta(k(1, 2), bad)
    assert (stats.skipped_nonfinite, stats.created, stats.applied, s.num_rows) == (1, 1, 1, 1)
    np.testing.assert_allclose(s.pull(k(2)), [[1.5, 1.5]])
    r = table(dim=2)
    with pytest.raises(NonFiniteGradientError) as info:
        r.add_delta(k(1, 2), bad)
    assert info.value.field == "deltas" and r.num_rows == 0
    with pytest.raises(TableInputError, match=r"\(2, 2\)"):
        r.add_delta(k(1, 2), np.zeros((2, 3), np.float32))


@pytest.mark.timeout(30)
def test_add_delta_with_shows_counts_them() -> None:
    """``add_delta(keys, deltas, shows)``: each row's count grows by the shows of its keys (a
    pass cache's occurrences) instead of one per key; rows dropped as non-finite or filtered take
    their shows with them; bad shows are a TableInputError naming ``shows``."""
    t = table(dim=2, nonfinite="skip")
    t.add_delta(k(1, 2, 1, 3), g([[1, 1], [1, 1], [1, 1], [np.nan, 1]]), np.array([5, 2, 4, 9]))
    assert meta(t, 1) == (9, 0) and meta(t, 2) == (2, 0)
    assert t.store.lookup(k(3))[0] < 0  # its row carried NaN: neither created nor counted
    t.add_delta(k(2), g([[0, 0]]), np.array([0], np.uint32))
    assert meta(t, 2) == (2, 0)
    # a count filter counts the shows toward admission, as a push counts occurrences
    f = table(dim=2, entry=CountFilterEntry(3))
    stats = f.add_delta(k(4, 5), g([[1, 1], [2, 2]]), np.array([1, 7]))
    assert (stats.created, stats.filtered, f.num_rows, f.num_pending) == (1, 1, 1, 1)
    np.testing.assert_allclose(f.pull(k(5)), f.initial_values(k(5)) + 2)
    assert meta(f, 5) == (7, 0)
    f.add_delta(k(4), g([[1, 1]]), np.array([2]))  # 1 + 2 shows: admitted now, with this delta
    np.testing.assert_allclose(f.pull(k(4)), f.initial_values(k(4)) + 1)
    assert meta(f, 4) == (3, 0) and f.num_pending == 0
    for bad, why in (
        (np.array([1, 2]), r"1 integer show counts.*shape \(2,\)"),
        (np.array([1.5]), "integer show counts"),
        (np.array([-1]), ">= 0"),
    ):
        with pytest.raises(TableInputError, match=why) as info:
            t.add_delta(k(7), g([[1, 1]]), bad)
        assert info.value.field == "shows"
    assert t.store.lookup(k(7))[0] < 0  # nothing of a refused delta was applied


@pytest.mark.timeout(30)
def test_state_deltas_and_pull_with_state() -> None:
    """``pull_with_state``: rows and their optimizer state (the rule's initial state for keys
    the entry policy has not admitted). ``add_delta(..., state_deltas=)``: summed over
    duplicates and added to the state (Adam keeps ``v`` and its step >= 0); rows dropped as
    non-finite take their state deltas along; a bad shape is a TableInputError naming them."""
    conf = SparseTableConfig(
        "emb", 2, Adagrad(1.0, initial_accumulator_value=0.5), Constant(0.5), nonfinite="skip"
    )
    t = SparseTable(conf)
    t.push(k(1), g([[1, 2]]))
    values, state = t.pull_with_state(k(1, 2, 1))
    np.testing.assert_allclose(state, [[1.5, 4.5], [0.5, 0.5], [1.5, 4.5]])
    np.testing.assert_array_equal(values, t.pull(k(1, 2, 1)))
    stats = t.add_delta(
        k(1, 1, 2, 3),
        g([[0, 0], [0, 0], [1, 1], [0, 0]]),
        state_deltas=g([[1, 1], [2, 0], [0, 1], [np.nan, 0]]),
    )
    assert (stats.applied, stats.skipped_nonfinite) == (2, 1)
    assert t.store.lookup(k(3))[0] < 0  # its state delta was NaN: no row
    _, state = t.pull_with_state(k(1, 2, 3))
    np.testing.assert_allclose(state, [[4.5, 5.5], [0.5, 1.5], [0.5, 0.5]])
    with pytest.raises(TableInputError, match=r"\(1, 2\).*shape \(1, 3\)") as info:
        t.add_delta(k(4), g([[1, 1]]), state_deltas=g([[1, 1, 1]]))
    assert info.value.field == "state_deltas" and t.store.lookup(k(4))[0] < 0
    filtered = SparseTable(
        SparseTableConfig("f", 2, Adagrad(1.0, 0.25), Constant(0.5), entry=CountFilterEntry(3))
    )
    values, state = filtered.pull_with_state(k(9))
    assert filtered.num_rows == 0 and np.array_equal(state, [[0.25, 0.25]])
    adam = SparseTable(SparseTableConfig("a", 1, Adam(0.1), Constant(0.0)))
    adam.push(k(1), g([[1.0]]))
    _, before = adam.pull_with_state(k(1))
    adam.add_delta(k(1), g([[0]]), state_deltas=g([[0.5, -1.0, 2.0]]))
    _, after = adam.pull_with_state(k(1))
    np.testing.assert_allclose(after, [[before[0, 0] + 0.5, 0.0, 3.0]])
