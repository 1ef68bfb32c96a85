"""``max_capacity`` for SSD tables: the rows of both tiers count, and the rows deleted to make
room are picked over both tiers.

A memory table over ``max_capacity`` deletes exactly the overflow before it creates rows: the
rows unseen for the most days first, then the least counted (``SparseTable._evict_for``). An
:class:`~ps_server.core.ssd_table.SsdSparseTable` uses the same order over its memory rows and
its cold rows (aged to today), but finding the cold ones costs a scan of RocksDB, so it deletes
:data:`CAPACITY_SLACK` of ``max_capacity`` more than the overflow each time: the following calls
create rows without a scan until that room is used. The scan keeps only the best candidates so
far (:func:`pick_victims`), never every cold row's score at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from ps_server.core.row_flags import LIVE
from ps_server.errors import TableCapacityError

if TYPE_CHECKING:
    from ps_server.core.ssd_table import SsdSparseTable

CAPACITY_SLACK = 0.05
"""Share of ``max_capacity`` deleted beyond the overflow (fewer scans of the cold tier)."""
_U32_MAX = np.int64(np.iinfo(np.uint32).max)


def scores(unseen_days: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Deletion priority (higher first): most unseen days, then least counted (as a memory
    table's ``max_capacity``)."""
    return (unseen_days.astype(np.int64) << 32) | (_U32_MAX - count.astype(np.int64))


def pick_victims(
    hot_rows: np.ndarray,
    hot_scores: np.ndarray,
    cold: Iterable[tuple[np.ndarray, np.ndarray]],
    n: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The ``n`` highest-scored of the memory rows ``hot_rows`` and the cold ``(keys, scores)``
    chunks: (memory rows, cold keys, candidates seen). Holds at most ``n`` + one chunk of cold
    candidates at a time."""
    best_keys = np.zeros(0, dtype=np.int64)
    best_scores = np.zeros(0, dtype=np.int64)
    seen = int(hot_rows.shape[0])
    for keys, sc in cold:
        seen += int(keys.shape[0])
        best_keys = np.concatenate([best_keys, keys])
        best_scores = np.concatenate([best_scores, sc])
        if best_keys.shape[0] > n:
            top = np.argpartition(-best_scores, n - 1)[:n]
            best_keys, best_scores = best_keys[top], best_scores[top]
    # hot rows as negative ids (-1 - row) beside the cold keys' positions
    ids = np.concatenate([-1 - hot_rows.astype(np.int64), np.arange(best_keys.shape[0])])
    all_scores = np.concatenate([hot_scores, best_scores])
    if ids.shape[0] > n:
        ids = ids[np.argpartition(-all_scores, n - 1)[:n]]
    return -1 - ids[ids < 0], best_keys[ids[ids >= 0]], seen


def make_room(table: SsdSparseTable, num_new: int, protect: np.ndarray) -> int:
    """Make room for ``num_new`` rows of ``table`` (an SSD table, its lock held) under
    ``max_capacity`` over both tiers: delete the overflow and :data:`CAPACITY_SLACK` of the
    capacity more, most unseen then least counted first, from memory and from disk (not the
    memory rows ``protect``: the batch's own); returns the rows deleted."""
    cap = table.config.max_capacity
    if cap is None or table.num_rows + num_new <= cap:
        return 0
    if num_new > cap:
        raise TableCapacityError(
            f"table {table.name!r}: one batch creates {num_new} rows but max_capacity is {cap}; "
            "send smaller batches or raise max_capacity"
        )
    overflow = table.num_rows + num_new - cap
    n = min(overflow + int(cap * CAPACITY_SLACK), table.num_rows)
    st = table.store
    candidate = (st.flags[: st.high_water] & LIVE).astype(bool)
    candidate[protect[protect >= 0]] = False
    rows = np.flatnonzero(candidate)
    table._write_queued()  # RocksDB holds every cold row
    cold = (
        (keys, scores(r["unseen_days"], r["count"]))
        for keys, r in ((k, table._aged(r)) for k, r in table.cold.scan())
    )
    hot_rows, cold_keys, seen = pick_victims(
        rows, scores(st.cols["unseen_days"][rows], st.cols["count"][rows]), cold, n
    )
    if seen < overflow:
        raise TableCapacityError(
            f"table {table.name!r}: needs {overflow} free rows under max_capacity={cap} "
            f"but only {seen} rows are not in use by this batch; send smaller batches or "
            "raise max_capacity"
        )
    st.remove_rows(hot_rows)
    if cold_keys.shape[0]:
        if table._savers:  # pending full saves keep the rows leaving the disk
            found, rec = table.cold.get(cold_keys)
            for saver in list(table._savers):
                saver.keep(cold_keys[found], rec)
        table.cold.delete(cold_keys)
        table.changes.deleted(cold_keys)
        table._cold_rows -= int(cold_keys.shape[0])
    gone = int(hot_rows.shape[0] + cold_keys.shape[0])
    table._counters["rows_evicted"] += gone
    return gone


__all__ = ["CAPACITY_SLACK", "make_room", "pick_victims", "scores"]
