"""A sparse table's row stores ↔ per-shard payloads: the storage half of
:meth:`SparseTable.export_shards <ps_server.core.sparse_table.SparseTable.export_shards>` and
``import_shard``, split by shard with :func:`~ps_server.core.routing.shard_of`.

Functions of the stores they are given (the table's rows and, with a count-filter entry policy,
its pending keys) or of their snapshots (:class:`SparseSnapshot`); the table validates a payload
and holds its lock before calling them on its live stores.
"""

from __future__ import annotations

import numpy as np

from ps_server.core.batch_ops import sorted_distinct
from ps_server.core.routing import shard_of
from ps_server.core.row_flags import DIRTY, EXPORT_DIRTY, LIVE, SEEN
from ps_server.core.row_store import RowSnapshot, RowStore
from ps_server.core.shard_data import SparseShardData
from ps_server.core.table import ChangeLog, SnapshotMeta, TableSnapshot

_NO_KEYS = np.zeros(0, dtype=np.int64)


def positions_by_shard(
    keys: np.ndarray, num_shards: int, shards: tuple[int, ...]
) -> dict[int, np.ndarray]:
    """Per shard of ``shards``: the positions in ``keys`` (int64[n]) of its keys, in order."""
    of = shard_of(keys, num_shards)
    order = np.argsort(of, kind="stable")
    bounds = np.searchsorted(of[order], np.arange(num_shards + 1))
    return {s: order[bounds[s] : bounds[s + 1]] for s in shards}


def export_shards(
    store: RowStore | RowSnapshot,
    pending: RowStore | RowSnapshot | None,
    num_shards: int,
    shards: tuple[int, ...],
    changed: np.uint8 | None,
) -> dict[int, SparseShardData]:
    """Per shard of ``shards``: all live rows (``changed`` None), or the rows carrying change
    flag ``changed`` and the keys deleted since that change log was reset. Reads only: works
    on a store (under the table's lock) or on its snapshot (without)."""
    rows = store.rows_with(changed) if changed is not None else store.live_rows()
    keys = store.keys[rows]
    deleted = _deleted(store, changed)
    if pending is not None:
        prows = pending.rows_with(changed) if changed is not None else pending.live_rows()
        pkeys = pending.keys[prows]
        pdeleted = _deleted(pending, changed)
    else:
        prows, pkeys, pdeleted = _NO_KEYS, _NO_KEYS, _NO_KEYS
    by, del_by = (positions_by_shard(k, num_shards, shards) for k in (keys, deleted))
    pby, pdel_by = (positions_by_shard(k, num_shards, shards) for k in (pkeys, pdeleted))
    out = {}
    for s in shards:
        r = rows[by[s]]
        pr = prows[pby[s]]
        out[s] = SparseShardData(
            shard=s,
            keys=keys[by[s]],
            values=store.cols["values"][r],
            state=store.cols["state"][r],
            count=store.cols["count"][r],
            unseen_days=store.cols["unseen_days"][r],
            flags=store.flags[r] & SEEN,
            pending_keys=pkeys[pby[s]],
            pending_count=pending.cols["count"][pr] if pending else np.zeros(0, np.uint32),
            pending_unseen_days=(
                pending.cols["unseen_days"][pr] if pending else np.zeros(0, np.uint16)
            ),
            pending_flags=(pending.flags[pr] & SEEN) if pending else np.zeros(0, np.uint8),
            deleted_keys=sorted_distinct(deleted[del_by[s]]),
            deleted_pending_keys=sorted_distinct(pdeleted[pdel_by[s]]),
        )
    return out


def _deleted(store: RowStore | RowSnapshot, changed: np.uint8 | None) -> np.ndarray:
    if changed is None:
        return _NO_KEYS
    deleted = store.take_deleted(changed)
    if deleted is None:  # the table checks this before it snapshots
        raise ValueError("the change log of this delta is not kept (no base export yet)")
    return deleted


CHANGE_FLAG = {ChangeLog.SAVE: DIRTY, ChangeLog.EXPORT: EXPORT_DIRTY}
"""The row flag of each change log."""


def requeue_changes(
    store: RowStore, pending: RowStore | None, snapshot: TableSnapshot, log: ChangeLog
) -> None:
    """``snapshot`` (a :class:`SparseSnapshot` that reset ``log``) was never written: every
    live row counts as changed again and its deleted keys go back on the log
    (:meth:`RowStore.requeue_changes`). Call with the table's lock held."""
    assert isinstance(snapshot, SparseSnapshot)
    flag = CHANGE_FLAG[log]
    for st, snap in ((store, snapshot.store), (pending, snapshot.pending)):
        if st is not None and snap is not None:
            st.requeue_changes(flag, snap.take_deleted(flag))


class SparseSnapshot(TableSnapshot):
    """A sparse table's rows (and count-filter keys) at one instant: copies of its stores, split
    into per-shard payloads by :meth:`export_shards` later, without the table's lock."""

    def __init__(
        self,
        meta: SnapshotMeta,
        store: RowSnapshot,
        pending: RowSnapshot | None,
        num_shards: int,
        changed: np.uint8 | None,
    ) -> None:
        super().__init__(meta)
        self.store, self.pending = store, pending
        self.num_shards, self.changed = num_shards, changed

    def export_shards(self) -> dict[int, SparseShardData]:
        """Per owned shard: the snapshot's rows (or its changed rows and deleted keys)."""
        return export_shards(
            self.store, self.pending, self.num_shards, self.meta.shards, self.changed
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the copied stores."""
        return self.store.nbytes + (self.pending.nbytes if self.pending is not None else 0)


def import_shard(
    store: RowStore, pending: RowStore | None, payload: SparseShardData, delta: bool
) -> None:
    """Upsert one shard's rows and pending keys (a delta first deletes its deleted keys).
    ``pending`` may be None only when the payload has no pending keys."""
    d = payload
    if delta:
        for st, gone in ((store, d.deleted_keys), (pending, d.deleted_pending_keys)):
            if st is not None and gone.shape[0]:
                rows = st.lookup(gone)
                st.remove_rows(rows[rows >= 0], log=False)
    columns = {"values": d.values, "state": d.state, "count": d.count, "unseen_days": d.unseen_days}
    _upsert(store, d.keys, d.flags, columns)
    if d.pending_keys.shape[0]:
        assert pending is not None
        pending_columns = {"count": d.pending_count, "unseen_days": d.pending_unseen_days}
        _upsert(pending, d.pending_keys, d.pending_flags, pending_columns)


def _upsert(
    store: RowStore, keys: np.ndarray, flags: np.ndarray, cols: dict[str, np.ndarray]
) -> None:
    if keys.shape[0] == 0:
        return
    rows = store.lookup(keys)
    new = rows < 0
    rows[new] = store.allocate(keys[new])
    for name, values in cols.items():
        store.scatter(name, rows, values)
    store.flags[rows] = LIVE | (flags & SEEN)


__all__ = [
    "CHANGE_FLAG",
    "SparseSnapshot",
    "export_shards",
    "import_shard",
    "positions_by_shard",
    "requeue_changes",
]
