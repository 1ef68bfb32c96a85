"""The key filter of an SSD table's cold tier: no false negatives, few false positives, and a
table with it still ends with the memory table's rows while skipping RocksDB for new keys; the
RocksDB key order the tier sorts its batches into."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rocksdict")

from ps_server.core import ssd_filter
from ps_server.core.factory import make_table
from ps_server.core.ssd_filter import KeyFilter
from ps_server.core.ssd_table import SsdSparseTable

sys.path.insert(0, str(Path(__file__).parent))
from test_ps_ssd_table import _assert_same_rows, _config, _drive, _pair


def _keysets(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    seq = np.arange(n, dtype=np.int64)
    return {
        "random": rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, n, dtype=np.int64),
        "sequential": seq - n // 2,
        "slot_and_id": ((seq % 97) << 40) | (seq // 97),  # CTR-style feature keys
        "strided": seq << 20,
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filter_never_answers_no_for_an_added_key(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ssd_filter, "MIN_CAPACITY", 256)  # many growths and rebuilds
    rng = np.random.default_rng(seed)
    for name, pool in _keysets(rng, 120_000).items():
        pool = np.unique(pool)
        rng.shuffle(pool)
        added, others = pool[:60_000], pool[60_000:]
        f = KeyFilter(int(rng.integers(1, 5000)))
        lo = 0
        while lo < added.shape[0]:
            n = int(rng.integers(1, 4000))
            batch = added[lo : lo + n]
            again = added[: int(rng.integers(0, lo + 1))][:500]  # keys added before, again
            f.add(np.unique(np.concatenate([batch, again])))
            lo += n
            if f.needs_rebuild:
                f = KeyFilter.rebuilt(iter([added[:lo]]), lo)
            assert f.may_contain(added[:lo]).all(), (name, lo)
        fp = float(f.may_contain(others).mean())
        assert fp < ssd_filter.MAX_CHAIN * 2 * ssd_filter.FALSE_POSITIVE_RATE, (name, fp)
        rebuilt = KeyFilter.rebuilt(iter([added[:30_000], added[30_000:]]), added.shape[0])
        assert rebuilt.may_contain(added).all() and rebuilt.chain_length == 1
        assert float(rebuilt.may_contain(others).mean()) < ssd_filter.FALSE_POSITIVE_RATE, name
        assert rebuilt.num_keys == added.shape[0]


@pytest.mark.timeout(30)
def test_empty_batches_and_an_empty_filter() -> None:
    f = KeyFilter(10)
    assert f.may_contain(np.zeros(0, np.int64)).shape == (0,)
    f.add(np.zeros(0, np.int64))
    assert not f.may_contain(np.arange(1000, dtype=np.int64)).any()
    assert f.num_keys == 0 and f.nbytes > 0 and f.capacity >= ssd_filter.MIN_CAPACITY


def _cold_keys(table: SsdSparseTable) -> np.ndarray:
    with table.lock:
        table.flush()
        chunks = list(table.cold.scan_keys())
    return np.concatenate(chunks) if chunks else np.zeros(0, np.int64)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("background", [True, False], ids=["background", "in-call"])
def test_table_with_growing_filter_matches_memory_table(
    tmp_path: Path, background: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ssd_filter, "MIN_CAPACITY", 128)
    mem = make_table(_config(show_decay_rate=0.8))
    ssd = make_table(_config("ssd", show_decay_rate=0.8), ssd_root=str(tmp_path))
    ssd.background = background
    _drive([mem, ssd], steps=120, num_keys=6000)
    s = ssd.stats()
    assert s["filter_rebuilds"] > 0 and s["filter_skips"] > 0, s
    cold = _cold_keys(ssd)
    assert cold.shape[0] > 3000 and ssd.keyfilter.may_contain(cold).all()
    for t in (mem, ssd):
        t.shrink(1)
    cold = _cold_keys(ssd)
    assert ssd.keyfilter.may_contain(cold).all()
    _drive([mem, ssd], steps=40, num_keys=9000, seed=5)
    _assert_same_rows(mem, ssd)
    assert ssd.keyfilter.may_contain(_cold_keys(ssd)).all()
    ssd.close()


@pytest.mark.timeout(30)
def test_new_keys_skip_rocksdb_and_stats_count_it(tmp_path: Path) -> None:
    mem, ssd = _pair(tmp_path)
    old = np.arange(3000, dtype=np.int64)
    for t in (mem, ssd):
        t.pull(old)
    ssd.flush()
    before = ssd.stats()
    assert before["cold_rows"] > 2500 and before["filter_keys"] >= before["cold_rows"] - 50
    new = np.arange(10_000, 12_000, dtype=np.int64)
    reads = ssd.cold.reads
    for t in (mem, ssd):
        t.pull(new)
    s = ssd.stats()
    skipped = s["filter_skips"] - before["filter_skips"]
    assert skipped >= 2000 * (1 - 2 * ssd_filter.FALSE_POSITIVE_RATE)
    assert s["cold_misses"] - before["cold_misses"] == 2000 - skipped
    assert ssd.cold.reads - reads <= 1  # the few false positives in one multi_get, or none
    assert s["filter_bytes"] > 0 and s["filter_chain"] == 1
    back = old[:500]  # cold rows still come back
    for t in (mem, ssd):
        t.pull(back)
    assert ssd.stats()["cold_hits"] - s["cold_hits"] > 400
    _assert_same_rows(mem, ssd)
    ssd.clear()
    assert ssd.stats()["filter_keys"] == 0
    ssd.close()


@pytest.mark.timeout(30)
def test_rocksdb_order_of_sorted_and_unsorted_batches() -> None:
    """A batch's RocksDB order (shard, then the key as unsigned) is the two-key sort's, whether
    the batch comes sorted as int64 (the radix path: negative keys last) or not."""
    from ps_server.core.routing import shard_of
    from ps_server.core.ssd_tier import rocksdb_order

    rng = np.random.default_rng(5)
    for name, keys in _keysets(rng, 5000).items():
        for batch in (np.unique(keys), rng.permutation(np.unique(keys)), keys[:1], keys[:0]):
            shards = shard_of(batch, 64)
            want = np.lexsort((batch.view(np.uint64), shards))
            assert np.array_equal(rocksdb_order(batch, shards), want), name


@pytest.mark.timeout(60)
def test_a_write_batch_applies_only_each_keys_last_op(tmp_path: Path) -> None:
    """Ops written in one batch keep only each key's last op (the batch is atomic): RocksDB
    ends as if every op had been applied in order."""
    from ps_server.core.ssd_evict import Op
    from ps_server.core.ssd_tier import ColdTier, last_ops, record_dtype

    dt = record_dtype(2, 1)

    def records(keys: np.ndarray, value: float) -> np.ndarray:
        rec = np.zeros(keys.shape[0], dtype=dt)
        rec["values"] = value
        rec["seq"] = keys.astype(np.uint64)
        return rec

    a, b, c = np.arange(0, 6), np.arange(3, 9), np.arange(7, 12)
    ops = [Op(a, records(a, 1.0)), Op(b, None), Op(c, records(c, 2.0)), Op(a[:1], None)]
    parts = last_ops(ops)
    assert [p[0].tolist() for p in parts] == [[1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11], [0]]
    assert parts[0][1] is not None and parts[0][1]["seq"].tolist() == [1, 2]
    assert last_ops(ops[:1])[0][0] is ops[0].keys
    tier = ColdTier("emb", str(tmp_path), (0,), dt, num_shards=8)
    try:
        tier.write(ops)
        found, rec = tier.get(np.arange(0, 13))
        assert found.tolist() == [False, True, True] + [False] * 4 + [True] * 5 + [False]
        assert rec["values"][:, 0].tolist() == [1.0, 1.0] + [2.0] * 5
    finally:
        tier.close()


@pytest.mark.timeout(60)
def test_a_large_read_split_over_threads_finds_what_one_read_finds(tmp_path: Path) -> None:
    """A read of more than two parts of keys, split over the call's threads, returns the same
    found mask and records, in order, as one ``multi_get``; absent keys stay absent."""
    from ps_server.core import kernels
    from ps_server.core.ssd_evict import Op
    from ps_server.core.ssd_tier import READ_PART, ColdTier, record_dtype

    dt = record_dtype(2, 0)
    rng = np.random.default_rng(6)
    keys = np.unique(rng.integers(-(2**62), 2**62, 3 * READ_PART))
    rec = np.zeros(keys.shape[0], dtype=dt)
    rec["values"] = rng.standard_normal((keys.shape[0], 2)).astype(np.float32)
    rec["seq"] = np.arange(keys.shape[0], dtype=np.uint64)
    tier = ColdTier("emb", str(tmp_path), (0,), dt, num_shards=8)
    try:
        tier.write([Op(keys[::2], rec[::2])])
        query = rng.permutation(keys)
        one = tier.get(query)
        with kernels.threads_for_call(3):
            split = tier.get(query)
        assert np.array_equal(one[0], split[0]) and one[1].tobytes() == split[1].tobytes()
        assert int(split[0].sum()) == keys[::2].shape[0]
        at = np.searchsorted(keys, query[split[0]])
        assert np.array_equal(split[1]["seq"], rec["seq"][at])
    finally:
        tier.close()
