"""The change logs of an SSD table's cold tier: which cold rows changed since the last save (or
serving export), so delta checkpoints and delta exports cover both tiers.

A memory table marks a changed row with a flag per change log (``DIRTY`` for saves,
``EXPORT_DIRTY`` for serving exports, :mod:`ps_server.core.row_flags`) and keeps the keys it
deleted since each log was reset. An :class:`~ps_server.core.ssd_table.SsdSparseTable` keeps the
same flags on its rows in memory; a row evicted to the cold tier takes its flags along in its
record. :class:`ColdChanges` adds what the cold tier needs so that nothing has to be rewritten on
disk when a log is reset:

* **epochs**: every log has an epoch, bumped by each reset. An evicted record carries the epochs
  of its eviction (``save_epoch``, ``export_epoch``); its change flag counts only if that epoch is
  the log's current one, so a reset makes every cold change flag stale at once;
* **changed keys**: the keys of rows evicted with a log's flag set (appended at eviction,
  de-duplicated now and then, keys back in memory dropped then), so a delta reads only the cold
  rows that changed (one ``multi_get``), not the whole tier;
* **deleted keys**: keys ``shrink`` deleted from the cold tier (the memory rows' deletions stay in
  the row store's own log).

A lost snapshot (:meth:`ColdChanges.requeue`: its files were never written) makes every cold row
count as changed until the log's next reset, as the row store does with its rows (a superset of
what the snapshot held: its rows may have moved between the tiers since); the next delta of that
log then scans the cold tier. The logs of serving exports start with the first export, as the
row store's do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ps_server.core.batch_ops import sorted_distinct
from ps_server.core.row_flags import CHANGE_FLAGS, DIRTY, EXPORT_DIRTY, LIVE
from ps_server.core.row_store import RowSnapshot
from ps_server.core.sparse_shards import CHANGE_FLAG
from ps_server.core.ssd_evict import ABSENT, PUT

if TYPE_CHECKING:
    from ps_server.core.sparse_shards import SparseSnapshot
    from ps_server.core.ssd_table import SsdSparseTable

EPOCH_FIELDS = {int(DIRTY): "save_epoch", int(EXPORT_DIRTY): "export_epoch"}
"""The record field holding each change log's epoch at eviction."""
COMPACT_MIN_KEYS = 1 << 16
"""Changed keys appended before a log is first de-duplicated."""
_NO_KEYS = np.zeros(0, dtype=np.int64)
ROW_COLUMNS = ("values", "state", "count", "unseen_days")
"""The columns of a row, in memory and in a cold record."""


@dataclass(frozen=True)
class LogState:
    """One change log of the cold tier before a reset (what :meth:`ColdChanges.requeue` puts
    back when the snapshot that reset it is lost)."""

    deleted: np.ndarray | None
    """Keys deleted from the cold tier since the reset before (None: the log was not kept)."""


def _joined(parts: list[np.ndarray] | None) -> np.ndarray | None:
    if parts is None:
        return None
    return np.concatenate(parts) if parts else _NO_KEYS


class ColdChanges:
    """Epochs, changed keys and deleted keys of each change log of one cold tier."""

    def __init__(self) -> None:
        self.epoch = {int(f): 0 for f in CHANGE_FLAGS}
        self._changed: dict[int, list[np.ndarray] | None] = {
            int(DIRTY): [],
            int(EXPORT_DIRTY): None,
        }
        self._deleted: dict[int, list[np.ndarray] | None] = {
            int(DIRTY): [],
            int(EXPORT_DIRTY): None,
        }
        self._everything = dict.fromkeys(self._changed, False)
        self._appended = dict.fromkeys(self._changed, 0)
        self._compacted = dict.fromkeys(self._changed, 0)

    # -- eviction and promotion ---------------------------------------------------------------
    def stamp(self, records: np.ndarray) -> None:
        """Record each log's epoch in records being evicted."""
        for flag, field in EPOCH_FIELDS.items():
            records[field] = self.epoch[flag]

    def evicted(
        self, keys: np.ndarray, flags: np.ndarray, hot: Callable[[np.ndarray], np.ndarray]
    ) -> None:
        """Note the evicted rows that carry a change flag; ``hot(keys)`` says which keys are in
        memory (dropped when a log is de-duplicated: their flags are in memory)."""
        for flag, parts in self._changed.items():
            if parts is None:
                continue
            sel = keys[(flags & np.uint8(flag)).astype(bool)]
            if sel.shape[0]:
                parts.append(sel)
                self._appended[flag] += int(sel.shape[0])
            if self._appended[flag] > max(2 * self._compacted[flag], COMPACT_MIN_KEYS):
                self._compact(flag, hot)

    def _compact(self, flag: int, hot: Callable[[np.ndarray], np.ndarray]) -> None:
        parts = self._changed[flag]
        assert parts is not None
        keys = sorted_distinct(np.concatenate(parts)) if parts else _NO_KEYS
        keys = keys[~hot(keys)]
        self._changed[flag] = [keys]
        self._appended[flag] = self._compacted[flag] = int(keys.shape[0])

    def current_flags(self, records: np.ndarray) -> np.ndarray:
        """The records' flags with the change flags of past epochs cleared (set on all of them
        while a log counts every cold row as changed)."""
        flags = records["flags"].copy()
        for flag, field in EPOCH_FIELDS.items():
            if self._everything[flag]:
                flags |= np.uint8(flag)
                continue
            stale = records[field] != self.epoch[flag]
            flags[stale] &= np.uint8(~flag & 0xFF)
        return flags

    def all_changed(self, flag: np.uint8) -> bool:
        """Whether every cold row counts as changed for log ``flag`` (after a lost snapshot)."""
        return self._everything[int(flag)]

    def deleted(self, keys: np.ndarray) -> None:
        """Keys deleted from the cold tier (shrink)."""
        if keys.shape[0]:
            for parts in self._deleted.values():
                if parts is not None:
                    parts.append(keys.copy())

    # -- the logs -----------------------------------------------------------------------------
    def keeps_log(self, flag: np.uint8) -> bool:
        """Whether log ``flag`` is kept (the export log starts with the first export)."""
        return self._changed[int(flag)] is not None

    def changed_keys(self, flag: np.uint8, hot: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Distinct keys of cold rows evicted with ``flag`` since the log's reset (a superset:
        a row may have gone since), keys in memory left out."""
        f = int(flag)
        if self._changed[f] is None:
            return _NO_KEYS
        self._compact(f, hot)
        parts = self._changed[f]
        assert parts is not None
        return parts[0]

    def deleted_keys(self, flag: np.uint8) -> np.ndarray | None:
        """Keys deleted from the cold tier since the log's reset (None: the log is not kept)."""
        return _joined(self._deleted[int(flag)])

    def reset(self, flag: np.uint8) -> LogState:
        """Start log ``flag`` afresh (a new epoch); returns its state before, for
        :meth:`requeue`."""
        f = int(flag)
        before = LogState(_joined(self._deleted[f]))
        self.epoch[f] += 1
        self._changed[f], self._deleted[f] = [], []
        self._appended[f] = self._compacted[f] = 0
        self._everything[f] = False
        return before

    def requeue(self, flag: np.uint8, before: LogState) -> None:
        """The snapshot that reset log ``flag`` was never written: every cold row counts as
        changed until the next reset, and its deleted keys go back on the log."""
        f = int(flag)
        if before.deleted is None:  # the log was not kept before
            self._changed[f] = self._deleted[f] = None
            self._everything[f] = False
            return
        self._everything[f] = True
        parts = self._deleted[f]
        if parts is not None and before.deleted.shape[0]:
            parts.insert(0, before.deleted)


def changed_cold(table: SsdSparseTable, flag: np.uint8) -> tuple[np.ndarray, np.ndarray]:
    """(keys, records) of ``table``'s cold rows carrying change flag ``flag``: read from the
    write-behind queue and in one ``multi_get`` (a scan of the tier after a lost snapshot)."""
    changes, cold = table.changes, table.cold
    if changes.all_changed(flag):  # after a lost snapshot: every cold row
        table._write_queued()
        chunks = list(cold.scan())
        if not chunks:
            return np.zeros(0, np.int64), np.zeros(0, dtype=cold.dtype)
        return np.concatenate([k for k, _ in chunks]), np.concatenate([r for _, r in chunks])
    keys = changes.changed_keys(flag, table._is_hot)
    state, queued = table.queue.lookup(keys, cold.dtype)
    ask = keys[state == ABSENT]
    found, rec = cold.get(ask)
    keys = np.concatenate([keys[state == PUT], ask[found]])
    rec = np.concatenate([queued, rec])
    keep = (changes.current_flags(rec) & flag).astype(bool)
    return keys[keep], rec[keep]


def delta_snapshot(table: SsdSparseTable, snap: SparseSnapshot, flag: np.uint8) -> SparseSnapshot:
    """``snap`` (the changed memory rows of the log of change flag ``flag``) with the log's
    changed cold rows, aged to today's day, and both tiers' deleted keys. Hold the table's
    lock."""
    keys, rec = changed_cold(table, flag)
    hot = snap.store
    logs = {}
    for f in CHANGE_FLAG.values():
        mine, gone = hot.take_deleted(f), table.changes.deleted_keys(f)
        logs[int(f)] = None if mine is None or gone is None else np.concatenate([mine, gone])
    rec = table._aged(rec)
    flags = table.changes.current_flags(rec)
    snap.store = RowSnapshot(
        np.concatenate([hot.keys, keys]),
        np.concatenate([hot.flags, flags | LIVE]),
        {name: np.concatenate([hot.cols[name], rec[name]]) for name in ROW_COLUMNS},
        logs,
    )
    return snap


__all__ = [
    "EPOCH_FIELDS",
    "ROW_COLUMNS",
    "ColdChanges",
    "LogState",
    "changed_cold",
    "delta_snapshot",
]
