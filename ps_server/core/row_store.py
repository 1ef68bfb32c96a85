"""Columnar row storage keyed by int64: growable numpy arrays plus a vectorised hash index.

A :class:`RowStore` keeps, per row, a key (``int64``), a flags byte (live / changed since the
last save / pushed since the last end_day) and any named columns (a sparse table uses
``values f32[dim]``, ``state f32[state_dim]``, ``count u32``, ``unseen_days u16``). No Python
object per row: a row is an index into the arrays, found through
:class:`~ps_server.core.hash_index.HashIndex`.

Growth is geometric by 1.25x rather than 2x: doubling leaves up to 50 % of the arrays unused right
after a growth, which alone would break the memory goal of <= 1.5x the payload. Copying every
array at each 1.25x growth would copy every row about 4 times over the life of the store (as much
work as creating the row); a large array instead lives in an anonymous mapping reserved for twice
its rows and extended in place (:mod:`ps_server.core.reserved`), so growing copies nothing. Removed rows go on a free
list and are reused by the next inserts; :meth:`compact` moves the live rows to the front and
releases the rest (a sparse table compacts after a shrink that leaves it less than half full).

Why this index — ``bench/bench_ps_memory.py``, 2026-11-22, 2-core CPU, numpy 2.4: SparseTable
of 1 M rows, dim 8, Adagrad (payload 78 B/row), 64k-key batches, median of 7 [min .. max]::

    index          B/row  x payload  pull M rows/s     push M rows/s     create M rows/s
    hash (chosen)   87.4  1.12x      7.84 [6.30-8.27]  2.75 [2.43-2.81]  1.34 [0.55-1.69]
    dict           188.9  2.42x      1.33 [0.92-1.38]  1.02 [0.79-1.08]  0.75 [0.41-1.04]
    sorted          91.0  1.17x      2.29 [2.05-2.63]  1.45 [1.35-1.57]  1.15 [0.65-1.22]

(hash: numpy open addressing, this module's choice; dict: a Python ``dict`` key -> row; sorted:
sorted keys + ``searchsorted``, new keys merged in.)

The hash index costs 4 B per slot (row ids only; keys are compared through the store's key
column) at 25-70 % load, i.e. 6-16 B per row, probes a whole batch in a few dozen numpy calls,
inserts in O(batch) and deletes with tombstones. The dict costs ~110 B per entry and a Python
step per key (6x slower pulls, 2.7x slower pushes). The sorted index is as compact, but a lookup
is a binary search per key (3.4x slower pulls) and every batch that creates rows rewrites the
whole 12 B/row index (O(table) per batch; an LSM-style insert buffer would add a second lookup
per key). Worst case of
the chosen layout by construction: row arrays <= 1.25 x 79 B (rows + a flags byte) plus <= 16 B
of index per row = 115 B = 1.47x the payload (more only while freed rows wait for reuse).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np

from ps_server.core import kernels, reserved
from ps_server.core.batch_ops import row_view
from ps_server.core.hash_index import HashIndex, KeyIndex
from ps_server.core.row_flags import CHANGE_FLAGS, CHANGED, DIRTY, EXPORT_DIRTY, LIVE, SEEN
from ps_server.errors import TableCapacityError

logger = logging.getLogger(__name__)

GROWTH = 1.25
"""Capacity growth factor of the row arrays."""
MIN_CAPACITY = 1024
MAX_ROWS = 2**31 - 1
"""Most rows one store holds (the hash index keeps int32 row ids)."""
LOOKUP_CACHE_MIN_KEYS = 4096
"""Lookups of at least this many keys are remembered for the next one (see RowStore.lookup)."""

ColumnSpec = Mapping[str, tuple[tuple[int, ...], np.dtype]]


class _Rows:
    """Reads shared by a store and its snapshot: which rows are live / changed."""

    flags: np.ndarray
    high_water: int

    def live_rows(self) -> np.ndarray:
        """Ascending int64 rows that hold a key."""
        return np.flatnonzero(self.flags[: self.high_water] & LIVE)

    def rows_with(self, flag: np.uint8) -> np.ndarray:
        """Ascending live rows whose flags include ``flag``."""
        f = self.flags[: self.high_water]
        return np.flatnonzero((f & LIVE).astype(bool) & (f & flag).astype(bool))


class RowSnapshot(_Rows):
    """A copy of a store's rows (up to its high-water mark) and deletion logs at one instant:
    taken under the table's lock with a few memcpy's (:meth:`RowStore.snapshot`), read later
    without it (a checkpoint splits and writes it on a background thread)."""

    def __init__(
        self,
        keys: np.ndarray,
        flags: np.ndarray,
        cols: dict[str, np.ndarray],
        deleted: dict[int, np.ndarray | None],
    ) -> None:
        self.keys, self.flags, self.cols = keys, flags, cols
        self.high_water = int(keys.shape[0])
        self._deleted = deleted

    @property
    def nbytes(self) -> int:
        """Bytes this snapshot holds."""
        arrays = [self.keys, self.flags, *self.cols.values()]
        arrays += [d for d in self._deleted.values() if d is not None]
        return sum(int(a.nbytes) for a in arrays)

    def take_deleted(self, flag: np.uint8 = DIRTY) -> np.ndarray | None:
        """Keys deleted since the change log ``flag`` was last reset (None: not tracked)."""
        return self._deleted[int(flag)]


class RowStore(_Rows):
    """Rows keyed by distinct int64 keys, stored column-wise in growable numpy arrays.

    ``columns`` maps a column name to ``(row shape, dtype)``; ``keys``, ``flags`` and the columns
    are arrays of ``capacity`` rows of which rows ``< high_water`` are in use or free.
    """

    def __init__(
        self,
        columns: ColumnSpec,
        index_factory: Callable[[], KeyIndex] = HashIndex,
        initial_capacity: int = MIN_CAPACITY,
    ) -> None:
        self._spec = {name: (tuple(shape), np.dtype(dt)) for name, (shape, dt) in columns.items()}
        self._index_factory = index_factory
        self._initial = max(1, int(initial_capacity))
        self.clear()

    def clear(self) -> None:
        """Drop every row and the deletion log; shrink back to the initial capacity."""
        cap = self._initial
        self.keys = np.zeros(cap, dtype=np.int64)
        self.flags = np.zeros(cap, dtype=np.uint8)
        self.cols = {n: np.zeros((cap, *s), dtype=d) for n, (s, d) in self._spec.items()}
        self._reserved: dict[str, reserved.Reservation | None] = {}
        """Per array, the address space it grows into without copying (see _resize)."""
        self.index = self._index_factory()
        self.high_water = 0
        self.num_rows = 0
        self._free = np.zeros(0, dtype=np.int64)
        self._deleted: dict[int, list[np.ndarray] | None] = {
            int(DIRTY): [],
            int(EXPORT_DIRTY): None,
        }
        """Keys deleted since each change log was reset; the export log is None (not kept)
        until the first serving export starts it, so a job that never exports keeps none."""
        self._changed()

    def _changed(self) -> None:
        """The key -> row mapping changed: forget the last lookup."""
        self._last: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def capacity(self) -> int:
        """Rows the arrays can hold without growing."""
        return int(self.keys.shape[0])

    @property
    def row_bytes(self) -> int:
        """Bytes per allocated row across keys, flags and columns."""
        return (
            self.keys.itemsize
            + self.flags.itemsize
            + sum(
                c.itemsize * int(np.prod(c.shape[1:], dtype=np.int64)) for c in self.cols.values()
            )
        )

    @property
    def memory_bytes(self) -> int:
        """Bytes of the row arrays (full capacity), the free list and the index."""
        return self.capacity * self.row_bytes + int(self._free.nbytes) + self.index.memory_bytes

    # -- lookups and row allocation ------------------------------------------------------------
    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """int64 row of each key, ``-1`` where absent (duplicates allowed).

        The last large lookup is remembered until the mapping changes: a trainer pushes exactly
        the keys it pulled (``DistributedEmbedding``), and comparing the keys (one memcmp) costs
        ~1/40 of probing them again."""
        rows = self._remembered(keys)
        if rows is None:
            rows = self.index.lookup(keys, self.keys)
            self._remember(keys, rows)
        return rows

    def _remembered(self, keys: np.ndarray) -> np.ndarray | None:
        last = self._last
        if last is not None and last[0].shape == keys.shape and np.array_equal(last[0], keys):
            return last[1].copy()
        return None

    def _remember(self, keys: np.ndarray, rows: np.ndarray) -> None:
        if keys.shape[0] >= LOOKUP_CACHE_MIN_KEYS:
            self._last = (keys.copy(), rows.copy())

    def _grow(self, needed: int) -> None:
        cap = self.capacity
        if needed <= cap:
            return
        if needed > MAX_ROWS:
            raise TableCapacityError(
                f"one server's table cannot hold more than {MAX_ROWS} rows (the index stores int32 "
                "row ids); spread the table over more servers"
            )
        new_cap = max(needed, int(cap * GROWTH) + 1)
        self._resize(new_cap, grow=True)

    def _resize(self, new_cap: int, grow: bool = False) -> None:
        """Arrays of ``new_cap`` rows holding the rows below the high-water mark. Growing
        (``grow``) re-views or extends the array's reservation in place when it can (no copy,
        :mod:`ps_server.core.reserved`), else copies into a new one; shrinking copies into
        ordinary arrays (releasing the memory). On an error the store keeps its old arrays."""
        hw, old_cap = self.high_water, self.capacity
        arrays: dict[str, np.ndarray | None] = {"keys": self.keys, "flags": self.flags, **self.cols}
        del self.keys, self.flags, self.cols  # no view of a reservation may stay alive here
        out: dict[str, np.ndarray] = {}
        try:
            for name in list(arrays):
                a = arrays[name]
                res = self._reserved.get(name) if grow else None
                if res is not None:
                    arrays[name] = a = None  # the last reference: the mapping can now move
                    if res.rows < new_cap:
                        res.extend(reserved.RESERVE * new_cap)
                    if res.rows >= new_cap:
                        out[name] = res.view(new_cap)
                        continue
                    a = res.view(hw)
                assert a is not None
                b, new_res = reserved.allocate(new_cap, a.shape[1:], a.dtype, grow)
                b[:hw] = a[:hw]
                out[name], self._reserved[name] = b, new_res
        except BaseException:
            out = {}
            for name, a in arrays.items():
                res = self._reserved.get(name)
                out[name] = a if a is not None or res is None else res.view(old_cap)
            raise
        finally:
            self.keys, self.flags = out.pop("keys"), out.pop("flags")
            self.cols = out

    def allocate(self, keys: np.ndarray) -> np.ndarray:
        """Rows for distinct keys not yet stored (reusing freed rows first), flagged live + dirty.

        The columns of the returned rows hold stale data: the caller fills them.
        """
        n = int(keys.shape[0])
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        reuse = min(n, int(self._free.shape[0]))
        rows = np.empty(n, dtype=np.int64)
        if reuse:
            rows[:reuse] = self._free[self._free.shape[0] - reuse :]
            self._free = self._free[: self._free.shape[0] - reuse]
        fresh = n - reuse
        at: slice | np.ndarray = rows
        if fresh:
            self._grow(self.high_water + fresh)
            rows[reuse:] = np.arange(self.high_water, self.high_water + fresh)
            if not reuse:  # rows past the high-water mark: slices, not scattered writes
                at = slice(self.high_water, self.high_water + fresh)
            self.high_water += fresh
        self.keys[at] = keys
        self.flags[at] = LIVE | CHANGED
        self.index.insert(keys, rows, self.keys)
        self.num_rows += n
        self._changed()
        return rows

    def remove_rows(self, rows: np.ndarray, log: bool = True) -> None:
        """Delete live rows (their keys go to the deletion log unless ``log`` is False)."""
        if rows.shape[0] == 0:
            return
        keys = self.keys[rows]
        self._changed()
        self.index.remove(keys, self.keys)
        self.flags[rows] = 0
        self._free = np.concatenate([self._free, rows.astype(np.int64)])
        self.num_rows -= int(rows.shape[0])
        if log:
            copy = keys.copy()
            for deleted in self._deleted.values():
                if deleted is not None:
                    deleted.append(copy)

    # -- column access -------------------------------------------------------------------------
    def gather(self, name: str, rows: np.ndarray) -> np.ndarray:
        """A copy of column ``name`` at ``rows``."""
        return np.take(self.cols[name], rows, axis=0)

    def gather_into(self, name: str, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = column[rows[i]]`` where ``rows[i] >= 0``; the other rows of ``out`` keep
        what they held."""
        col = self.cols[name]
        if kernels.ENABLED and out.flags.c_contiguous and out.dtype == col.dtype:
            kernels.gather(col, rows, out)  # prefetching, split over the table threads
            return
        hit = rows >= 0
        if hit.all():  # mode="clip": numpy buffers ``out`` under mode="raise" (2x slower)
            np.take(col, rows, axis=0, out=out, mode="clip")
        else:
            out[hit] = np.take(col, rows[hit], axis=0)

    def scatter(self, name: str, rows: np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` into column ``name`` at distinct ``rows``."""
        col = self.cols[name]
        if col.ndim == 1:
            col[rows] = values
        elif col.shape[1] > 0:
            src = np.ascontiguousarray(values, dtype=col.dtype).reshape(
                rows.shape[0], *col.shape[1:]
            )
            row_view(col)[rows] = row_view(src)

    # -- change tracking -----------------------------------------------------------------------
    def take_deleted(self, flag: np.uint8 = DIRTY) -> np.ndarray | None:
        """Keys deleted since the change log ``flag`` was last reset (int64, possibly repeated;
        None: that log is not kept yet)."""
        log = self._deleted[int(flag)]
        if log is None:
            return None
        return np.concatenate(log) if log else np.zeros(0, dtype=np.int64)

    def keeps_log(self, flag: np.uint8) -> bool:
        """Whether the deletion log of change log ``flag`` is kept (see :meth:`reset_changes`)."""
        return self._deleted[int(flag)] is not None

    def reset_changes(self, flag: np.uint8 = DIRTY) -> None:
        """Start change log ``flag`` afresh: clear that flag on every row and its deletion log
        (starting the log if it was not kept)."""
        hw = self.high_water
        self.flags[:hw] &= ~flag
        self._deleted[int(flag)] = []

    def requeue_changes(self, flag: np.uint8, deleted: np.ndarray | None) -> None:
        """Undo a reset of change log ``flag`` whose snapshot was never written: every live
        row counts as changed again (a superset of what the lost snapshot held) and its
        ``deleted`` keys go back on the log (None: the log was not kept before; stop it)."""
        f = self.flags[: self.high_water]
        f[(f & LIVE).astype(bool)] |= flag
        log = self._deleted[int(flag)]
        if deleted is None:
            self._deleted[int(flag)] = None
        elif log is not None:
            log.insert(0, deleted)

    def mark_saved(self) -> None:
        """Clear the dirty flags and the deletion log of saves (:data:`DIRTY`)."""
        self.reset_changes(DIRTY)

    def snapshot(self) -> RowSnapshot:
        """A copy of the rows and deletion logs (memcpy of the arrays up to the high-water
        mark: about 30 ms per million rows of dim 8 with Adagrad state)."""
        hw = self.high_water
        deleted = {flag: self.take_deleted(np.uint8(flag)) for flag in self._deleted}
        return RowSnapshot(
            self.keys[:hw].copy(),
            self.flags[:hw].copy(),
            {n: c[:hw].copy() for n, c in self.cols.items()},
            deleted,
        )

    def compact(self) -> None:
        """Move live rows to the front, release unused capacity, rebuild the index."""
        live = self.live_rows()
        k = int(live.shape[0])
        self.keys[:k] = self.keys[live]
        self.flags[:k] = self.flags[live]
        for c in self.cols.values():
            c[:k] = c[live]
        self.high_water = k
        self._free = np.zeros(0, dtype=np.int64)
        new_cap = max(self._initial, int(k * GROWTH) + 1)
        if new_cap < self.capacity:
            self._resize(new_cap)
        self.index.rebuild(np.arange(k, dtype=np.int64), self.keys)
        self._changed()
        logger.debug("compacted to %d rows (capacity %d)", k, self.capacity)


__all__ = [
    "CHANGED",
    "CHANGE_FLAGS",
    "DIRTY",
    "EXPORT_DIRTY",
    "LIVE",
    "SEEN",
    "RowSnapshot",
    "RowStore",
]
