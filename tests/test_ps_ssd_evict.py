"""Background eviction of SSD tables (:mod:`ps_server.core.ssd_evict`).

Rows whose write to RocksDB is still queued or in progress are read back from the queue (no lost
update: the table ends identical to a memory table fed the same calls); calls keep being served
while a write is stuck; ``close`` during a write stops the thread; a dropped table's thread
exits; a failed write is reported by the next call."""

from __future__ import annotations

import gc
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("rocksdict")

from ps_server.core import ssd_evict
from ps_server.core.factory import make_table
from ps_server.core.initializers import Constant
from ps_server.core.optimizers import SGD
from ps_server.core.ssd_table import EVICT_LOW, SsdSparseTable
from ps_server.errors import SsdTierError

sys.path.insert(0, str(Path(__file__).parent))
from test_ps_ssd_table import _assert_same_rows, _config, _drive, _pair, _rows

ONES = np.ones((300, 8), dtype=np.float32)


class StuckWrites:
    """Makes the table's RocksDB writes wait until :meth:`release` (one write at a time)."""

    def __init__(self, table: SsdSparseTable) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.table = table
        self._write = table.cold.write
        table.queue._write = self._stuck_write

    def _stuck_write(self, ops: list[Any]) -> int:
        self.entered.set()
        assert self.gate.wait(30), "the test never released the write"
        return self._write(ops)

    def release(self) -> None:
        self.gate.set()


def _pair_cache(root: Path, cache_rows: int, **kw: Any) -> tuple[Any, SsdSparseTable]:
    """A memory table and an SSD table of ``cache_rows`` rows, same config otherwise."""
    mem = make_table(_config(**kw))
    ssd = SsdSparseTable(_config("ssd", cache_rows=cache_rows, **kw), ssd_root=str(root))
    return mem, ssd


def _evict_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ssd-table-evict"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("background", [True, False], ids=["background", "in-call"])
def test_same_rows_as_memory_table_with_either_eviction(tmp_path: Path, background: bool) -> None:
    mem, ssd = _pair(tmp_path, show_decay_rate=0.8)
    ssd.background = background
    _drive([mem, ssd], steps=120, num_keys=5000, seed=7)
    s = ssd.stats()
    assert s["hot_rows"] <= 200 and s["cold_rows"] > 3000
    assert s["hot_rows"] + s["cold_rows"] == s["num_rows"] == mem.num_rows
    _assert_same_rows(mem, ssd)  # a snapshot writes the queue first
    assert ssd.stats()["ssd_unwritten_keys"] == 0
    ssd.close()
    assert ssd.queue.thread is None or not ssd.queue.thread.is_alive()


@pytest.mark.timeout(60)
def test_pushes_to_rows_whose_write_is_queued_are_not_lost(tmp_path: Path) -> None:
    kw = {"optimizer": SGD(lr=1.0), "initializer": Constant(0.0)}
    mem, ssd = _pair_cache(tmp_path, 1000, **kw)
    stuck = StuckWrites(ssd)
    a = np.arange(0, 300, dtype=np.int64)
    c = np.arange(300, 1100, dtype=np.int64)
    for t in (mem, ssd):
        t.pull(a)  # show count 0: evicted first
        t.push(c, np.ones((800, 8), dtype=np.float32))  # 1100 rows: some of ``a`` queued
    assert stuck.entered.wait(10)  # the thread's write of them is stuck
    s = ssd.stats()
    queued = 1100 - int(1000 * EVICT_LOW)  # rows of ``a`` (count 0: evicted first)
    assert s["ssd_unwritten_keys"] == s["tier_evictions"] == queued
    for t in (mem, ssd):
        t.push(a, ONES * 2)  # ``a`` comes back from the queued put, not from RocksDB
        t.push(a, ONES)  # rows of ``c`` queued behind the put and the delete of ``a``
    assert ssd.stats()["cold_hits"] == queued
    assert np.array_equal(ssd.pull(a), mem.pull(a))
    stuck.release()
    ssd.flush()
    assert ssd.stats()["ssd_unwritten_keys"] == 0
    _assert_same_rows(mem, ssd)
    assert np.array_equal(ssd.pull(a), np.full((300, 8), -3.0, dtype=np.float32))
    for t in (mem, ssd):  # ``c`` back from RocksDB, ``a`` evicted and read back again
        t.push(c, np.ones((800, 8), dtype=np.float32))
        t.push(a, ONES)
    _assert_same_rows(mem, ssd)
    ssd.close()


@pytest.mark.timeout(60)
def test_concurrent_calls_during_background_eviction_match_memory_table(tmp_path: Path) -> None:
    kw = {"optimizer": SGD(lr=1.0), "initializer": Constant(0.0)}
    mem, ssd = _pair_cache(tmp_path, 300, **kw)
    rngs = [np.random.default_rng(s) for s in range(4)]
    batches = [[r.integers(0, 6000, 300).astype(np.int64) for _ in range(30)] for r in rngs]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for step, keys in enumerate(batches[i]):
                ssd.pull(keys)
                ssd.push(keys, ONES)
                if i == 0 and step % 10 == 9:
                    ssd.flush()
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not errors and not any(t.is_alive() for t in threads)
    for worker_batches in batches:  # integer sums: exact in any order
        for keys in worker_batches:
            mem.pull(keys)
            mem.push(keys, ONES)
    s = ssd.stats()
    assert s["tier_evictions"] > 1000 and s["cold_hits"] > 0 and s["ssd_writes"] > 0
    assert s["hot_rows"] + s["cold_rows"] == mem.num_rows
    ra, rb = _rows(mem), _rows(ssd)
    for f in ("keys", "values", "state", "count", "unseen_days"):
        assert np.array_equal(ra[f], rb[f]), f
    ssd.close()


@pytest.mark.timeout(60)
def test_calls_are_served_while_a_write_is_stuck_and_close_stops_the_thread(
    tmp_path: Path,
) -> None:
    _, ssd = _pair_cache(tmp_path, 1000)
    stuck = StuckWrites(ssd)
    ssd.pull(np.arange(1200, dtype=np.int64))  # evicts; the thread's write is stuck
    assert stuck.entered.wait(10)
    hot = np.arange(1000, 1200, dtype=np.int64)
    t0 = time.monotonic()
    for _ in range(20):  # keys in memory and in the stuck put: served without the write
        ssd.pull(hot)
        ssd.push(hot, np.ones((200, 8), dtype=np.float32))
    ssd.pull(np.arange(100, dtype=np.int64))
    assert time.monotonic() - t0 < 10
    assert ssd.stats()["ssd_unwritten_keys"] > 0
    thread = ssd.queue.thread
    assert thread is not None and thread.is_alive()
    closer = threading.Thread(target=ssd.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()  # close waits for the write in progress
    stuck.release()
    closer.join(10)
    assert not closer.is_alive() and not thread.is_alive()
    with pytest.raises(SsdTierError, match="closed"):
        ssd.pull(hot)


@pytest.mark.timeout(30)
def test_a_dropped_table_stops_its_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssd_evict, "IDLE_WAKE_S", 0.05)
    before = set(_evict_threads())
    _, ssd = _pair_cache(tmp_path, 100)
    ssd.pull(np.arange(120, dtype=np.int64))  # past cache_rows: the thread writes
    ssd.flush()
    thread = ssd.queue.thread
    assert thread is not None and thread.is_alive()
    del ssd
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
    assert set(_evict_threads()) <= before


@pytest.mark.timeout(30)
def test_a_failed_write_is_raised_by_the_next_call(tmp_path: Path) -> None:
    _, ssd = _pair_cache(tmp_path, 100)

    def broken(ops: list[Any]) -> None:
        raise OSError("No space left on device")

    ssd.queue._write = broken
    ssd.pull(np.arange(120, dtype=np.int64))  # the thread's write fails
    with pytest.raises(SsdTierError, match="No space left"):
        ssd.flush()
    with pytest.raises(SsdTierError, match="No space left"):
        ssd.pull(np.arange(10, dtype=np.int64))
    ssd.close()
    (tmp_path / "b").mkdir()
    in_call = SsdSparseTable(
        _config("ssd", cache_rows=100), ssd_root=str(tmp_path / "b"), background=False
    )
    in_call.queue._write = broken
    with pytest.raises(SsdTierError, match="No space left"):  # the call's own write
        in_call.pull(np.arange(120, dtype=np.int64))
    in_call.close()


@pytest.mark.timeout(30)
def test_rows_pulled_ahead_of_their_push_stay_in_memory(tmp_path: Path) -> None:
    """A trainer that prefetches pulls batch n + 1 before it pushes batch n: the rows of batch n
    (fresh, show count 0) must not be evicted by the later pull and read back by the push."""
    table = make_table(_config("ssd", cache_rows=400), ssd_root=str(tmp_path), background=False)
    assert isinstance(table, SsdSparseTable)
    try:
        rng = np.random.default_rng(0)
        batches = [rng.choice(1 << 40, 150, replace=False) for _ in range(40)]
        table.pull(batches[0])
        for n in range(len(batches) - 1):
            table.pull(batches[n + 1])  # evicts: the cache holds about 2.5 batches
            table.push(batches[n], ONES[:150])
        s = table.stats()
        assert s["tier_evictions"] > 0
        assert s["cold_hits"] == 0  # no push found its rows on their way to disk or on it
    finally:
        table.close()


def test_unknown_eviction_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SsdTierError, match="eviction must be one of"):
        SsdSparseTable(_config("ssd"), ssd_root=str(tmp_path), eviction="lfu")


@pytest.mark.timeout(60)
def test_server_serves_while_its_ssd_table_writes(tmp_path: Path) -> None:
    from ps_server import PSClient, PSServer
    from ps_server.core.initializers import Uniform
    from ps_server.core.optimizers import Adagrad

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
            cache_rows=1000,
        )
        table = server.state.tables["emb"]
        assert isinstance(table, SsdSparseTable)
        stuck = StuckWrites(table)
        ref = make_table(_config())
        keys = np.arange(1200, dtype=np.int64)
        assert np.array_equal(client.pull_sparse("emb", keys), ref.pull(keys))
        assert stuck.entered.wait(10)  # the eviction's write is stuck
        rng = np.random.default_rng(5)
        t0 = time.monotonic()
        for _ in range(5):  # rows in memory and in the stuck put: served meanwhile
            some = rng.choice(1200, 150, replace=False).astype(np.int64)
            grads = rng.standard_normal((150, 8)).astype(np.float32)
            client.push_sparse("emb", some, grads)
            ref.push(some, grads)
            assert np.array_equal(client.pull_sparse("emb", some), ref.pull(some))
        assert time.monotonic() - t0 < 15
        assert table.stats()["ssd_unwritten_keys"] > 0
        stuck.release()
        table.flush()
        assert np.array_equal(client.pull_sparse("emb", keys), ref.pull(keys))
    finally:
        client.close()
        server.stop()
    thread = table.queue.thread
    table.close()
    assert thread is not None and not thread.is_alive()
