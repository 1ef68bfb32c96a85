"""Vectorised helpers over a batch of rows: summing duplicated rows, saturating counters."""

from __future__ import annotations

import numpy as np


def saturating_add(a: np.ndarray, b: np.ndarray | int, limit: int, dtype: type) -> np.ndarray:
    """``min(a + b, limit)`` as ``dtype`` (counters that stick at their maximum, never wrap)."""
    return np.minimum(a.astype(np.int64) + b, limit).astype(dtype)


def sum_duplicates(
    rows: np.ndarray, grads: np.ndarray, num_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct rows, summed grads, occurrences per row) of ``rows`` < ``num_rows``.

    Duplicates are detected without sorting (write each position at its row in a scratch array,
    read back: a duplicate reads another position); only a batch with duplicates is sorted and
    summed (in occurrence order, float32).
    """
    n = rows.shape[0]
    if n <= 1:
        return rows, grads, np.ones(n, dtype=np.int64)
    scratch = np.empty(num_rows, dtype=np.int32)
    positions = np.arange(n, dtype=np.int32)
    scratch[rows] = positions
    if np.array_equal(scratch[rows], positions):
        return rows, grads, np.ones(n, dtype=np.int64)
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    first = np.empty(n, dtype=bool)
    first[0] = True
    np.not_equal(sorted_rows[1:], sorted_rows[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    occ = np.diff(np.append(starts, n))
    summed = np.empty((starts.shape[0], grads.shape[1]), dtype=np.float32)
    # rows pushed once are copied; only the duplicated ones are summed, column by column with
    # bincount (float64 accumulation). Measured at 64k keys: 2-3x faster than one
    # np.add.reduceat over every segment, ~10x faster than np.add.at.
    single = occ == 1
    summed[single] = grads[order[starts[single]]]
    if not single.all():
        seg = np.cumsum(first) - 1
        in_multi = ~single[seg]
        multi_segs = np.flatnonzero(~single)
        local = np.searchsorted(multi_segs, seg[in_multi])
        cols = np.ascontiguousarray(grads[order[in_multi]].T)
        acc = np.empty((cols.shape[0], multi_segs.shape[0]), dtype=np.float64)
        for j in range(cols.shape[0]):
            acc[j] = np.bincount(local, weights=cols[j], minlength=multi_segs.shape[0])
        summed[multi_segs] = acc.T
    return sorted_rows[starts], summed, occ


__all__ = ["saturating_add", "sum_duplicates"]
