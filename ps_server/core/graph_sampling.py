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

The cost is one sort of the edges of the nodes with ``degree > fanout``.
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
    if si.shape[0]:
        deg = degrees[si]
        pos = ranges(starts[si], deg)
        seg = np.repeat(np.arange(si.shape[0], dtype=np.int64), deg)
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
        chosen = pos[order[rank < fanout]]
        out[ranges(out_starts[si], counts[si])] = chosen
    return out, counts


__all__ = ["ranges", "sample_segments"]
