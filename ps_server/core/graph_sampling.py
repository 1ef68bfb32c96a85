"""Vectorised neighbour sampling over a CSR: no Python loop per node or per edge.

:func:`sample_segments` picks, for each query node, up to ``fanout`` of its edges without
replacement:

* a node whose degree is at most ``fanout`` gets every edge (in CSR order);
* otherwise every edge of the node gets a random key and the ``fanout`` smallest keys of each
  node win. Uniform: the key is ``segment + u`` with ``u ~ U[0, 1)`` (one float argsort keeps
  the segments apart and orders each by ``u``). Weighted (Efraimidis & Spirakis, "Weighted random
  sampling with a reservoir", 2006): the key is ``-log(u) / w``, an exponential variable of rate
  ``w``; the ``k`` smallest are a weighted sample without replacement. An edge of weight 0 has
  an infinite key: it is drawn only when its node has fewer than ``fanout`` edges of positive
  weight.

The cost is one sort of the edges of the nodes with ``degree > fanout``, except for uniform
sampling from hubs (``degree >= 4 * fanout``): there ``fanout + fanout // 4 + 4`` offsets are
drawn with replacement and the first ``fanout`` distinct ones in draw order kept (sequential
draws without replacement give a uniform subset), so a hub costs O(fanout), not O(degree); the
rare hub whose draws hold fewer than ``fanout`` distinct offsets takes the sorting path.
"""

from __future__ import annotations

import numpy as np


def ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), int64, without a Python loop."""
    lens = lens.astype(np.int64, copy=False)
    total = int(lens.sum())
    if total == 0:
        return np.empty(0, np.int64)
    ends = np.cumsum(lens)
    base = np.repeat(starts.astype(np.int64, copy=False) - (ends - lens), lens)
    return np.arange(total, dtype=np.int64) + base


HUB_FACTOR = 4
"""Uniform sampling draws offsets instead of sorting every edge of a node whose degree is at
least this many times the fanout."""


def _sort_sample(
    starts: np.ndarray,
    deg: np.ndarray,
    fanout: int,
    rng: np.random.Generator,
    weights: np.ndarray | None,
) -> np.ndarray:
    """``fanout`` distinct positions per segment (every ``deg > fanout``) by random keys over
    all of the segment's edges, grouped by segment."""
    pos = ranges(starts, deg)
    seg = np.repeat(np.arange(deg.shape[0], dtype=np.int64), deg)
    u = rng.random(pos.shape[0])
    if weights is None:
        order = np.argsort(seg + u, kind="stable")
    else:
        w = weights[pos].astype(np.float64)
        with np.errstate(divide="ignore"):
            key = -np.log1p(-u) / w  # u in [0, 1): log1p(-u) is finite; w = 0 -> inf
        order = np.lexsort((key, seg))
    seg_start = np.cumsum(deg) - deg
    rank = np.arange(pos.shape[0], dtype=np.int64) - np.repeat(seg_start, deg)
    return pos[order[rank < fanout]]


def _draw_sample(
    deg: np.ndarray, fanout: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Uniform ``fanout`` distinct offsets per segment of a hub (``deg >= HUB_FACTOR *
    fanout``): offsets drawn with replacement, the first ``fanout`` distinct ones in draw order
    kept (sequential draws without replacement: a uniform subset). Returns (offsets grouped by
    segment, mask of the segments that got ``fanout``; the others need the sorting path)."""
    n = deg.shape[0]
    draws = fanout + fanout // 4 + 4
    offsets = (rng.random((n, draws)) * deg[:, None]).astype(np.int64)
    offsets = np.minimum(offsets, deg[:, None] - 1).reshape(-1)
    seg = np.repeat(np.arange(n, dtype=np.int64), draws)
    # first occurrence of each (segment, offset), in draw order
    _, first = np.unique(seg * (int(deg.max()) + 1) + offsets, return_index=True)
    first.sort()
    fseg = seg[first]
    bounds = np.searchsorted(fseg, np.arange(n + 1))
    distinct = np.diff(bounds)
    rank = np.arange(first.shape[0]) - np.repeat(bounds[:-1], distinct)
    keep = rank < fanout
    ok = distinct >= fanout
    keep &= ok[fseg]
    return offsets[first[keep]], ok


def sample_segments(
    starts: np.ndarray,
    degrees: np.ndarray,
    fanout: int,
    rng: np.random.Generator,
    weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(edge positions, counts): for query ``i``, ``counts[i] = min(degrees[i], fanout)`` CSR
    positions in ``[starts[i], starts[i] + degrees[i])``, distinct, grouped in query order.
    ``weights`` (float32 per CSR edge): sample by weight instead of uniformly."""
    degrees = degrees.astype(np.int64, copy=False)
    counts = np.minimum(degrees, fanout)
    out_ends = np.cumsum(counts)
    out = np.empty(int(out_ends[-1]) if out_ends.shape[0] else 0, np.int64)
    out_starts = out_ends - counts
    full = degrees <= fanout
    fi = np.flatnonzero(full)
    if fi.shape[0]:
        out[ranges(out_starts[fi], counts[fi])] = ranges(starts[fi], degrees[fi])
    si = np.flatnonzero(~full)
    if weights is None and si.shape[0]:
        hubs = si[degrees[si] >= HUB_FACTOR * fanout]
        if hubs.shape[0]:
            picked, ok = _draw_sample(degrees[hubs], fanout, rng)
            done = hubs[ok]
            out[ranges(out_starts[done], counts[done])] = np.repeat(starts[done], fanout) + picked
            si = np.setdiff1d(si, done, assume_unique=True)
    if si.shape[0]:
        chosen = _sort_sample(starts[si], degrees[si], fanout, rng, weights)
        out[ranges(out_starts[si], counts[si])] = chosen
    return out, counts


__all__ = ["ranges", "sample_segments"]
