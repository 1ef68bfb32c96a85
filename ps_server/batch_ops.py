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
    # one segmented reduction over the sorted rows (np.add.at is ~10x slower)
    summed = np.add.reduceat(grads[order], starts, axis=0).astype(np.float32, copy=False)
    occ = np.diff(np.append(starts, n))
    return sorted_rows[starts], summed, occ


__all__ = ["saturating_add", "sum_duplicates"]
