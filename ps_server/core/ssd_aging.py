"""Lazy aging of an SSD table's cold rows: the ``end_day`` steps a record missed on disk.

A cold record carries the table's day number of its eviction
(:func:`~ps_server.core.ssd_tier.record_dtype`); when it is read back (promotion, saves,
``shrink``) :func:`aged` applies the days it missed with the same float arithmetic as
``end_day`` on a memory row: unseen days and ``show_decay_rate``.
"""

from __future__ import annotations

import numpy as np

from ps_server.core.row_flags import SEEN
from ps_server.core.ssd_tier import as_void

_U16_MAX = np.iinfo(np.uint16).max


def aged(rec: np.ndarray, day: int, show_decay_rate: float, copy: bool = True) -> np.ndarray:
    """Records with the ``end_day`` steps since they were written applied, up to day ``day``;
    ``copy=False`` ages ``rec`` (contiguous, writable) in place."""
    rec = np.array(rec) if copy else rec
    missed = day - rec["day"].astype(np.int64)
    old = missed > 0
    if not old.any():
        return rec
    r = as_void(rec)[old].view(rec.dtype)  # a gather of opaque items: fast
    k = missed[old]
    seen = (r["flags"] & SEEN).astype(bool)
    first = np.where(seen, 0, r["unseen_days"].astype(np.int64) + 1)
    r["unseen_days"] = np.minimum(first + (k - 1), _U16_MAX).astype(np.uint16)
    r["flags"] &= ~SEEN
    rate = float(show_decay_rate)
    if rate != 1.0:
        count = r["count"].copy()
        for step in range(1, int(k.max()) + 1):
            due = k >= step
            if not count[due].any():
                break
            count[due] = np.floor(count[due] * rate).astype(np.uint32)
        r["count"] = count
    r["day"] = day
    as_void(rec)[old] = as_void(r)
    return rec


__all__ = ["aged"]
