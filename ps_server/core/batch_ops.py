"""Vectorised helpers over a batch of rows: row gather / scatter, summing duplicated rows,
saturating counters."""

from __future__ import annotations

from typing import Any

import numpy as np

from ps_server.core import kernels
from ps_server.errors import TableInputError


def row_view(a: np.ndarray) -> np.ndarray:
    """1-D view of a C-contiguous array with one opaque element per row (first axis).

    numpy moves such elements with one copy each; fancy indexing of a 2-D float array walks
    every element instead (measured, 64k x dim-8 float32 rows: ``a[pos]`` 0.94 ms vs
    ``np.take(a, pos, axis=0)`` 0.15 ms; ``out[pos] = v`` 1.06 ms vs 0.37 ms on row views)."""
    per_row = int(np.prod(a.shape[1:], dtype=np.int64))
    row_bytes = a.dtype.itemsize * per_row
    return a.reshape(a.shape[0], per_row).view(np.dtype((np.void, row_bytes))).reshape(a.shape[0])


def take_rows(a: np.ndarray, pos: Any) -> np.ndarray:
    """A new contiguous array of the rows ``pos`` (an index array, or a slice) of ``a``."""
    if isinstance(pos, slice):
        return np.ascontiguousarray(a[pos])
    return np.take(a, pos, axis=0)


def put_rows(out: np.ndarray, pos: Any, values: np.ndarray) -> None:
    """``out[pos] = values`` for an index array (distinct positions) or a slice ``pos``."""
    if isinstance(pos, slice) or out.size == 0:
        out[pos] = values
        return
    src = np.ascontiguousarray(values, dtype=out.dtype).reshape(-1, *out.shape[1:])
    if kernels.ENABLED and out.flags.c_contiguous:
        kernels.scatter(src, pos, out)
    elif out.ndim == 1:
        out[pos] = src
    else:
        row_view(out)[pos] = row_view(src)


def all_finite(a: np.ndarray) -> bool:
    """Whether every element of the float array ``a`` is finite.

    One sum first (a NaN or an inf anywhere makes it non-finite; 30 us for 32k x 8 floats);
    the exact elementwise test only when the sum is not finite, which also covers finite
    values whose sum overflows."""
    if a.size == 0:
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.add.reduce(a, axis=None)
    return bool(np.isfinite(total)) or bool(np.isfinite(a).all())


def saturating_add(a: np.ndarray, b: np.ndarray | int, limit: int, dtype: type) -> np.ndarray:
    """``min(a + b, limit)`` as ``dtype`` (counters that stick at their maximum, never wrap)."""
    return np.minimum(a.astype(np.int64) + b, limit).astype(dtype)


def shows_per_row(rows: np.ndarray, urows: np.ndarray, shows: np.ndarray) -> np.ndarray:
    """int64 sum of ``shows`` per distinct row, in the order :func:`sum_duplicates` gave
    ``urows`` of ``rows`` (as given when no row repeats; ascending otherwise)."""
    if urows.shape[0] == rows.shape[0]:
        return shows.astype(np.int64, copy=False)
    _, inverse = np.unique(rows, return_inverse=True)
    return np.bincount(inverse, weights=shows, minlength=urows.shape[0]).astype(np.int64)


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


def sorted_distinct(keys: np.ndarray) -> np.ndarray:
    """The distinct keys, ascending: ``np.unique(keys)`` by one sort. numpy 2.3+ answers a bare
    ``np.unique`` of int64 by hashing, which is 10-30x slower than a sort when most keys are
    distinct (2 M random keys: 1.9 s against 0.06 s here)."""
    keys = np.sort(keys, axis=None)
    if keys.shape[0] < 2:
        return keys
    first = np.empty(keys.shape[0], dtype=bool)
    first[0] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    return keys[first]


def distinct(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct keys in order of first occurrence, index of each key in them, occurrences of
    each distinct key): ``keys == uniq[inverse]``. New rows are allocated in this order (the
    compiled path's hash pass and the numpy path's sort give the same result)."""
    n = keys.shape[0]
    if kernels.ENABLED:
        uniq = np.empty(n, dtype=np.int64)
        inverse = np.empty(n, dtype=np.int64)
        counts = np.empty(n, dtype=np.int64)
        nu = kernels.distinct(keys, uniq, inverse, counts)
        return uniq[:nu], inverse, counts[:nu]
    uniq, first, inverse, counts = np.unique(
        keys, return_index=True, return_inverse=True, return_counts=True
    )
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.shape[0])
    return uniq[order], rank[inverse.reshape(-1)], counts[order]


def pull_buffer(table: str, n: int, dim: int, out: np.ndarray | None) -> np.ndarray:
    """``out`` checked to be a C-contiguous float32[n, dim] (a pull's reply written in place),
    or a new one."""
    shape = (n, dim)
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise TableInputError(
            table, "out", f"must be a C-contiguous float32 array of shape {shape}"
        )
    return out


__all__ = [
    "all_finite",
    "distinct",
    "pull_buffer",
    "sorted_distinct",
    "put_rows",
    "row_view",
    "saturating_add",
    "shows_per_row",
    "sum_duplicates",
    "take_rows",
]
