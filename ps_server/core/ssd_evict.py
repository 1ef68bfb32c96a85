"""Write-behind for an SSD table's cold tier: evicted rows reach RocksDB on a background thread.

An :class:`~ps_server.core.ssd_table.SsdSparseTable` hands every change of its cold tier to one
:class:`WriteBehind`: :meth:`~WriteBehind.put` (rows evicted from memory, with their records)
and :meth:`~WriteBehind.delete` (keys promoted back to memory or removed by ``shrink``). An op
is visible to :meth:`~WriteBehind.lookup` from the moment it is queued until RocksDB holds it, so
a key is always in exactly one place: the memory tier, an op not yet written (the newest op on
the key wins), or RocksDB. Ops are written in the order they were queued, all queued ops in one
write batch, by the background thread (or by the caller of :meth:`~WriteBehind.write_queued`);
the write lock keeps two writers from reordering them.

No lost update: a push to a row being written lands on the memory copy (the row was promoted
from the op, and a delete op queued behind the put), never on the record being written; when
that row is evicted again its new record is queued behind both, so the last write wins.

The thread holds only a weak reference to the table (a table dropped without ``close`` stops
its thread within :data:`IDLE_WAKE_S`); :meth:`~WriteBehind.close` stops it and waits for it.
A failed write leaves its ops visible (reads still find the rows) and is raised by the table's
next call as :class:`~ps_server.errors.SsdTierError`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ps_server.core.ssd_tier import as_void

logger = logging.getLogger(__name__)

IDLE_WAKE_S = 1.0
"""The background thread checks this often whether its table still exists."""
JOIN_TIMEOUT_S = 30.0
"""``close`` waits at most this long for a write in progress."""

ABSENT, PUT, DELETED = 0, 1, 2
"""What :meth:`WriteBehind.lookup` knows of a key: no op queued, a record, deleted."""


class Op:
    """One queued change: sorted distinct ``keys`` and their ``records`` (``None``: deletes).
    The op takes ``records`` (its caller's own array, not changed afterwards) where they are in
    key order already, and copies ``keys``."""

    __slots__ = ("keys", "records")

    def __init__(self, keys: np.ndarray, records: np.ndarray | None) -> None:
        if keys.shape[0] < 2 or bool((keys[1:] > keys[:-1]).all()):  # sorted already
            self.keys = np.array(keys, order="C")  # a copy, as the sorting below makes
            self.records = None if records is None else np.ascontiguousarray(records)
            return
        order = np.argsort(keys)  # distinct keys: no stability needed
        self.keys = np.ascontiguousarray(keys[order])
        if records is None:
            self.records = None
        else:
            self.records = as_void(np.ascontiguousarray(records))[order].view(records.dtype)


class WriteBehind:
    """Queued cold-tier ops of one table and the thread that writes them (module docstring)."""

    def __init__(self, write: Callable[[list[Op]], int], step: Callable[[], None]) -> None:
        """``write(ops)`` writes ops to RocksDB in order (one batch) and returns the keys it put
        or deleted; ``step`` (a bound method of the table, held weakly) runs before each
        background write: it picks rows to evict and queues them."""
        self._write = write
        self._step = weakref.WeakMethod(step)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._write_lock = threading.Lock()
        self._queued: list[Op] = []
        self._inflight: list[Op] = []
        """Every op not yet in RocksDB, oldest first (the queued ones are its tail)."""
        self._thread: threading.Thread | None = None
        self._kicked = False
        self._closed = False
        self.error: BaseException | None = None
        self.queued_rows = 0
        """Keys in ops not yet taken by a writer."""
        self.writes = 0
        self.written_keys = 0
        self.write_seconds = 0.0

    # -- queueing (the table's lock is held) --------------------------------------------------
    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Queue records of distinct keys (rows leaving memory; the queue takes ``records``:
        the caller does not change them afterwards)."""
        self._queue(Op(keys, records))

    def delete(self, keys: np.ndarray) -> None:
        """Queue the deletion of distinct keys (rows back in memory, or removed)."""
        self._queue(Op(keys, None))

    def _queue(self, op: Op) -> None:
        if op.keys.shape[0] == 0:
            return
        with self._lock:
            self._queued.append(op)
            self._inflight.append(op)
            self.queued_rows += int(op.keys.shape[0])

    @property
    def inflight_keys(self) -> int:
        """Keys in ops not yet in RocksDB (queued or being written)."""
        with self._lock:
            return sum(int(op.keys.shape[0]) for op in self._inflight)

    def put_keys(self) -> list[np.ndarray]:
        """The keys of every put op not yet in RocksDB (queued or being written)."""
        with self._lock:
            return [op.keys for op in self._inflight if op.records is not None]

    def lookup(self, keys: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """(state int8[n]: :data:`ABSENT`, :data:`PUT` or :data:`DELETED`; the records of the
        PUT keys, in key order) of distinct ``keys`` in the ops not yet written, the newest op
        on a key winning."""
        with self._lock:
            ops = list(self._inflight)
        n = keys.shape[0]
        state = np.zeros(n, dtype=np.int8)
        if not ops or n == 0:
            return state, np.zeros(0, dtype=dtype)
        which = np.full(n, -1, dtype=np.int64)
        pos = np.zeros(n, dtype=np.int64)
        todo = np.arange(n)
        for i in range(len(ops) - 1, -1, -1):
            op = ops[i]
            k = keys[todo]
            p = np.searchsorted(op.keys, k)
            p[p == op.keys.shape[0]] = 0
            hit = op.keys[p] == k
            if hit.any():
                at = todo[hit]
                state[at] = DELETED if op.records is None else PUT
                which[at] = i
                pos[at] = p[hit]
                todo = todo[~hit]
                if todo.shape[0] == 0:
                    break
        put = state == PUT
        out = np.empty(int(put.sum()), dtype=dtype)
        which, pos = which[put], pos[put]
        slots = as_void(out)
        for i in np.unique(which):
            sel = which == i
            records = ops[int(i)].records
            assert records is not None
            slots[sel] = as_void(records)[pos[sel]]
        return state, out

    # -- writing ------------------------------------------------------------------------------
    def write_queued(self) -> None:
        """Write every queued op now, in order, in one batch (waits for a write in progress;
        afterwards RocksDB holds every op queued before the call)."""
        with self._write_lock:
            with self._lock:
                ops, self._queued = self._queued, []
                self.queued_rows = 0
            if not ops:
                return
            t0 = time.perf_counter()
            try:
                written = self._write(ops)
            except BaseException as err:  # kept visible; the table raises it on its next call
                with self._lock:
                    self._queued[:0] = ops
                    self.queued_rows += sum(int(op.keys.shape[0]) for op in ops)
                self.error = err
                raise
            with self._lock:
                assert self._inflight[: len(ops)] == ops
                del self._inflight[: len(ops)]
                self.writes += 1
                self.written_keys += written
                self.write_seconds += time.perf_counter() - t0

    def discard(self, then: Callable[[], None]) -> None:
        """Drop every op not yet written and run ``then()`` with no write in progress."""
        with self._write_lock:
            with self._lock:
                self._queued, self._inflight = [], []
                self.queued_rows = 0
            self.error = None
            then()

    # -- the thread ---------------------------------------------------------------------------
    def kick(self) -> None:
        """Wake the background thread (started on the first kick)."""
        with self._lock:
            if self._closed:
                return
            self._kicked = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ssd-table-evict", daemon=True
                )
                self._thread.start()
            else:
                self._wake.notify()

    @property
    def thread(self) -> threading.Thread | None:
        """The background thread, once started."""
        return self._thread

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._kicked and not self._closed:
                    self._wake.wait(IDLE_WAKE_S)
                    if self._step() is None:
                        return  # the table is gone
                if self._closed:
                    return
                self._kicked = False
            step = self._step()
            if step is None:
                return
            try:
                step()
                del step
                self.write_queued()
            except BaseException as err:  # noqa: BLE001 - reported by the table's next call
                self.error = err
                logger.exception("ssd table: background eviction failed")
                return

    def close(self) -> None:
        """Stop the thread (a write in progress finishes first); queued ops are dropped."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                logger.warning(
                    "ssd table: eviction thread still writing after %.0f s", JOIN_TIMEOUT_S
                )

    def stats(self) -> dict[str, Any]:
        """Writes so far, keys written, seconds spent writing, keys not yet written."""
        return {
            "ssd_writes": self.writes,
            "ssd_written_keys": self.written_keys,
            "ssd_write_seconds": self.write_seconds,
            "ssd_unwritten_keys": self.inflight_keys,
        }


__all__ = ["ABSENT", "DELETED", "IDLE_WAKE_S", "PUT", "Op", "WriteBehind"]
