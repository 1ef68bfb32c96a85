"""A sparse table's row stores ↔ per-shard payloads: the storage half of
:meth:`SparseTable.export_shards <ps_server.core.sparse_table.SparseTable.export_shards>` and
``import_shard``, split by shard with :func:`~ps_server.core.routing.shard_of`.

Functions of the stores they are given (the table's rows and, with a count-filter entry policy,
its pending keys); the table validates a payload and holds its lock before calling them.
"""

from __future__ import annotations

import numpy as np

from ps_server.core.routing import shard_of
from ps_server.core.row_store import DIRTY, LIVE, SEEN, RowStore
from ps_server.core.shard_data import SparseShardData

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
    store: RowStore,
    pending: RowStore | None,
    num_shards: int,
    shards: tuple[int, ...],
    delta: bool,
) -> dict[int, SparseShardData]:
    """Per shard of ``shards``: all live rows, or (``delta``) the changed rows and the keys
    deleted since the last save (taking the deletion logs)."""
    rows = store.rows_with(DIRTY) if delta else store.live_rows()
    keys = store.keys[rows]
    deleted = store.take_deleted() if delta else _NO_KEYS
    if pending is not None:
        prows = pending.rows_with(DIRTY) if delta else pending.live_rows()
        pkeys = pending.keys[prows]
        pdeleted = pending.take_deleted() if delta else _NO_KEYS
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
            deleted_keys=np.unique(deleted[del_by[s]]),
            deleted_pending_keys=np.unique(pdeleted[pdel_by[s]]),
        )
    return out


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


__all__ = ["export_shards", "import_shard", "positions_by_shard"]
