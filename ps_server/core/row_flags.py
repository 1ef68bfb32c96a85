"""The flags byte of a row (:class:`~ps_server.core.row_store.RowStore`), shared with the
compiled kernels (``_kernels_common.h`` defines the same values; :mod:`ps_server.core.kernels`
refuses a build whose push sets other ones).

Two independent change logs: :data:`DIRTY` for delta saves (``save(mode="delta")``,
``save_persistables(dirname, 1)``) and :data:`EXPORT_DIRTY` for delta serving exports. A change
sets both (:data:`CHANGED`); each consumer resets only its own, so neither breaks the other's
delta chain (and recovery checkpoints reset none).
"""

from __future__ import annotations

import numpy as np

LIVE = np.uint8(1)
"""Flag: the row holds a key."""
DIRTY = np.uint8(2)
"""Flag: the row changed since the last save/load (delta checkpoints write these)."""
SEEN = np.uint8(4)
"""Flag: the row was pushed since the last end_day."""
EXPORT_DIRTY = np.uint8(8)
"""Flag: the row changed since the last serving export (delta exports write these)."""
CHANGED = np.uint8(DIRTY | EXPORT_DIRTY)
"""What a change sets: dirty for the next delta save and for the next delta export (the two
change logs are independent, so recovery checkpoints and exports never break a delta chain)."""
CHANGE_FLAGS = (DIRTY, EXPORT_DIRTY)
"""The change-log flags, each with its own deletion log (:meth:`RowStore.reset_changes`)."""


__all__ = ["CHANGED", "CHANGE_FLAGS", "DIRTY", "EXPORT_DIRTY", "LIVE", "SEEN"]
