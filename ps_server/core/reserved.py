"""Row arrays that grow without copying: numpy views of an anonymous memory mapping that holds
more rows than the array shows, and is itself extended in place (``mremap``).

A :class:`~ps_server.core.row_store.RowStore` grows its arrays by 1.25x (the memory goal rules out
doubling). Copying every array into a new one at each growth costs about 4 copies of every row
over the life of a table (and first touches of fresh pages): as much as the rest of creating the
row. Here an array is the first ``capacity`` rows of a :class:`Reservation` (pages are zero
until touched and take no memory before). Growing within it is a longer view of the same pages;
beyond it, the mapping is extended by ``mremap`` (page tables move, no byte is copied) when no
other view of it is alive, else copied into a new one. The store still accounts its arrays by
their length (``capacity``), and that length is registered with ``tracemalloc`` as numpy
registers its own allocations, so memory figures read as with ordinary arrays.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref

import numpy as np

RESERVE = 2
"""Rows a reservation is made (or extended) for, in multiples of the rows the array needs."""
MIN_BYTES = 1 << 20
"""Arrays smaller than this are ordinary numpy arrays (copying them is cheap)."""
_TRACE_DOMAIN = 0x50535256
"""tracemalloc domain of the reserved arrays (any domain counts in ``get_traced_memory``)."""


def _tracer() -> tuple[object, object] | None:
    try:
        track = ctypes.pythonapi.PyTraceMalloc_Track
        untrack = ctypes.pythonapi.PyTraceMalloc_Untrack
    except AttributeError:
        return None
    track.argtypes = (ctypes.c_uint, ctypes.c_size_t, ctypes.c_size_t)
    untrack.argtypes = (ctypes.c_uint, ctypes.c_size_t)
    return track, untrack


_TRACE = _tracer()


def _untrack(traced: list[int]) -> None:
    if _TRACE is not None and traced[0]:
        _TRACE[1](_TRACE_DOMAIN, traced[0])  # type: ignore[operator]
        traced[0] = 0


class Reservation:
    """Zero-filled address space for up to ``rows`` rows of ``row_shape`` and ``dtype``; its
    :meth:`view` of the first ``n`` rows is an ordinary writable C-contiguous numpy array."""

    def __init__(self, rows: int, row_shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.row_shape = tuple(row_shape)
        self.dtype = np.dtype(dtype)
        self._row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.rows = int(rows)
        self._map = mmap.mmap(-1, max(1, self.rows * self._row_bytes), flags=mmap.MAP_PRIVATE)
        self._advise()
        self._traced = [0]  # the address registered with tracemalloc (0: none)
        weakref.finalize(self, _untrack, self._traced)

    def _advise(self) -> None:
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            try:  # fewer page faults on first touch where transparent huge pages are on
                self._map.madvise(advice)
            except OSError:
                pass

    def extend(self, rows: int) -> bool:
        """Make room for ``rows`` rows in place (``mremap``: the rows stay, nothing is copied);
        False when a view of the mapping is still alive or the system refuses (the caller
        copies instead)."""
        try:
            self._map.resize(max(1, rows * self._row_bytes))
        except (BufferError, OSError, ValueError, SystemError):
            return False
        self.rows = int(rows)
        self._advise()
        return True

    def view(self, n: int) -> np.ndarray:
        """The first ``n`` rows (``n <= rows``); rows never written read as zeros."""
        if not 0 <= n <= self.rows:
            raise ValueError(f"a view of {n} rows of a reservation of {self.rows}")
        a = np.frombuffer(self._map, dtype=np.uint8, count=n * self._row_bytes)
        a = a.view(self.dtype).reshape(n, *self.row_shape)
        if _TRACE is not None and n:
            _untrack(self._traced)
            self._traced[0] = a.ctypes.data
            _TRACE[0](_TRACE_DOMAIN, self._traced[0], a.nbytes)  # type: ignore[operator]
        return a


def allocate(
    rows: int, row_shape: tuple[int, ...], dtype: np.dtype, reserve: bool
) -> tuple[np.ndarray, Reservation | None]:
    """A zeroed array of ``rows`` rows, on a :class:`Reservation` of ``RESERVE * rows`` rows when
    ``reserve`` and the array is large (else, or if the mapping fails, an ordinary array)."""
    dtype = np.dtype(dtype)
    per_row = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    if reserve and rows * per_row >= MIN_BYTES:
        try:
            res = Reservation(RESERVE * rows, row_shape, dtype)
        except (OSError, ValueError, OverflowError):
            pass
        else:
            return res.view(rows), res
    return np.zeros((rows, *row_shape), dtype=dtype), None


__all__ = ["MIN_BYTES", "RESERVE", "Reservation", "allocate"]
