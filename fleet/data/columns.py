"""Columnar examples: how a dataset holds its data in memory, with no Python object per example.

Per slot, in ``use_var`` order:

* a dense slot: one ``[N, dim]`` array (int64 or float32);
* a sparse slot: ``values`` (all values of all examples, end to end) and ``offsets`` int64
  ``[N + 1]`` (example ``i`` holds ``values[offsets[i]:offsets[i + 1]]``, ``offsets[0] == 0``).

So an example costs its payload (8 B an id, 4 B a float) plus 8 B per sparse slot. A dataset
keeps a list of such :class:`Columns` chunks -- the parsed blocks as they come from the parser
(~4 MiB of text each), or the chunks a shuffle writes -- and never concatenates them: a copy of
everything into fresh pages costs about as much as the parse itself (page faults and the kernel's
zeroing). Shuffles gather rows across chunks (:func:`take_rows`, compiled in ``_parser.c``: one
``memcpy`` per row and column, without the GIL; numpy otherwise); batches are slices of a chunk,
or a concatenation where a batch spans two (:mod:`fleet.data.batch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from fleet.data.slots import Slot

try:
    from fleet.data import _parser as _c
except ImportError:  # not built: numpy gathers
    _c = None

Column = np.ndarray | tuple[np.ndarray, np.ndarray]
"""A dense slot's ``[N, dim]`` array, or a sparse slot's ``(values, offsets [N + 1])``."""


@dataclass
class Columns:
    """Examples of one dataset (or one parsed block of lines), column by column."""

    slots: tuple[Slot, ...]
    """The slots, in line order."""
    data: list[Column]
    """One column per slot (module docstring)."""
    num_examples: int
    """N, the examples held."""

    @classmethod
    def empty(cls, slots: Sequence[Slot]) -> Columns:
        """No examples."""
        data: list[Column] = []
        for slot in slots:
            dtype = slot.dtype.numpy  # type: ignore[union-attr]
            if slot.dense:
                data.append(np.empty((0, slot.dim), dtype=dtype))
            else:
                data.append((np.empty(0, dtype=dtype), np.zeros(1, dtype=np.int64)))
        return cls(tuple(slots), data, 0)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays."""
        total = 0
        for col in self.data:
            total += col.nbytes if isinstance(col, np.ndarray) else col[0].nbytes + col[1].nbytes
        return total

    def slice(self, lo: int, hi: int) -> Columns:
        """Examples ``lo .. hi - 1`` (views where possible; offsets rebased to 0)."""
        data: list[Column] = []
        for col in self.data:
            if isinstance(col, np.ndarray):
                data.append(col[lo:hi])
            else:
                values, offsets = col
                part = offsets[lo : hi + 1]
                data.append((values[part[0] : part[-1]], part - part[0]))
        return Columns(self.slots, data, hi - lo)

    def take(self, idx: np.ndarray) -> Columns:
        """The examples ``idx`` (int64 positions), in that order (a copy)."""
        return take_rows([self], idx)


def locate(chunks: Sequence[Columns], idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(chunk, row)`` int64 of each global position ``idx`` over ``chunks`` end to end."""
    starts = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([c.num_examples for c in chunks], out=starts[1:])
    idx = np.asarray(idx, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= starts[-1]):
        raise IndexError(f"example index out of range 0..{starts[-1] - 1}")
    chunk = np.searchsorted(starts, idx, side="right") - 1
    return chunk, idx - starts[chunk]


def _take_numpy(chunks: Sequence[Columns], s: int, chunk: np.ndarray, row: np.ndarray) -> Column:
    """The fallback of :func:`take_rows` for column ``s`` (per chunk, vectorized)."""
    first = chunks[0].data[s]
    if isinstance(first, np.ndarray):
        out = np.empty((chunk.shape[0], *first.shape[1:]), dtype=first.dtype)
        for c in np.unique(chunk):
            sel = chunk == c
            out[sel] = chunks[c].data[s][row[sel]]
        return out
    lengths = np.empty(chunk.shape[0], dtype=np.int64)
    for c in np.unique(chunk):
        sel = chunk == c
        offsets = chunks[c].data[s][1]
        lengths[sel] = offsets[row[sel] + 1] - offsets[row[sel]]
    out_offsets = np.zeros(chunk.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=out_offsets[1:])
    values = np.empty(int(out_offsets[-1]), dtype=first[0].dtype)
    for c in np.unique(chunk):
        sel = np.flatnonzero(chunk == c)
        src_values, src_offsets = chunks[c].data[s]
        starts, lens = src_offsets[row[sel]], lengths[sel]
        # rank of each value within its row, then its place in the source and in the output
        firsts = np.repeat(np.cumsum(lens) - lens, lens)
        within = np.arange(int(lens.sum()), dtype=np.int64) - firsts
        dest = np.repeat(out_offsets[sel], lens) + within
        values[dest] = src_values[np.repeat(starts, lens) + within]
    return values, out_offsets


def take_column(chunks: Sequence[Columns], s: int, chunk: np.ndarray, row: np.ndarray) -> Column:
    """Column ``s`` of the rows ``(chunk, row)`` (:func:`locate`) of ``chunks``, in order."""
    if _c is None:
        return _take_numpy(chunks, s, chunk, row)
    first = chunks[0].data[s]
    if isinstance(first, np.ndarray):
        out = np.empty((chunk.shape[0], *first.shape[1:]), dtype=first.dtype)
        row_bytes = first.itemsize * int(np.prod(first.shape[1:], dtype=np.int64))
        _c.gather_rows(tuple(c.data[s] for c in chunks), row_bytes, chunk, row, out)
        return out
    values = tuple(c.data[s][0] for c in chunks)
    offsets = tuple(c.data[s][1] for c in chunks)
    out_offsets = np.empty(chunk.shape[0] + 1, dtype=np.int64)
    total = _c.jagged_take(values, offsets, first[0].itemsize, chunk, row, out_offsets)
    out_values = np.empty(total, dtype=first[0].dtype)
    _c.jagged_take(values, offsets, first[0].itemsize, chunk, row, out_offsets, out_values)
    return out_values, out_offsets


def take_rows(chunks: Sequence[Columns], idx: np.ndarray) -> Columns:
    """The examples at global positions ``idx`` of ``chunks`` (end to end), in that order."""
    chunk, row = locate(chunks, idx)
    data = [take_column(chunks, s, chunk, row) for s in range(len(chunks[0].slots))]
    return Columns(chunks[0].slots, data, int(chunk.shape[0]))


def permute_chunks(
    chunks: list[Columns], perm: np.ndarray, chunk_examples: int = 65536
) -> list[Columns]:
    """``chunks``' examples in the order ``perm`` (global positions), as new chunks of
    ``chunk_examples``. Column by column, each input column dropped once copied: the peak is the
    data plus one column (plus 16 B per example of positions)."""
    n = int(perm.shape[0])
    if n == 0:
        return []
    chunk, row = locate(chunks, perm)
    bounds = list(range(0, n, chunk_examples)) + [n]
    out: list[list[Column]] = [[] for _ in bounds[:-1]]
    for s in range(len(chunks[0].slots)):
        for j, (lo, hi) in enumerate(pairwise(bounds)):
            out[j].append(take_column(chunks, s, chunk[lo:hi], row[lo:hi]))
        for c in chunks:
            c.data[s] = None  # type: ignore[call-overload]
    slots = chunks[0].slots
    chunks.clear()
    return [Columns(slots, data, hi - lo) for data, lo, hi in zip(out, bounds[:-1], bounds[1:])]


def concat_columns(slots: Sequence[Slot], parts: list[Columns]) -> Columns:
    """All examples of ``parts`` in order, in one array per column. Empties ``parts`` as it goes
    (each part's column is dropped once copied), so the peak is the result plus one column."""
    total = sum(p.num_examples for p in parts)
    if len(parts) == 1:
        only = parts.pop()
        return Columns(tuple(slots), only.data, only.num_examples)
    data: list[Column] = []
    for s, slot in enumerate(slots):
        dtype = slot.dtype.numpy  # type: ignore[union-attr]
        if slot.dense:
            out = np.empty((total, slot.dim), dtype=dtype)
            pos = 0
            for p in parts:
                col = p.data[s]
                out[pos : pos + col.shape[0]] = col
                pos += col.shape[0]
                p.data[s] = None  # type: ignore[call-overload]
            data.append(out)
            continue
        nnz = sum(int(p.data[s][1][-1]) for p in parts)
        values = np.empty(nnz, dtype=dtype)
        offsets = np.empty(total + 1, dtype=np.int64)
        offsets[0] = 0
        pos = vpos = 0
        for p in parts:
            v, o = p.data[s]
            n = o.shape[0] - 1
            values[vpos : vpos + v.shape[0]] = v
            np.add(o[1:], vpos, out=offsets[pos + 1 : pos + n + 1])
            pos += n
            vpos += v.shape[0]
            p.data[s] = None  # type: ignore[call-overload]
        data.append((values, offsets))
    parts.clear()
    return Columns(tuple(slots), data, total)


def trim_heap() -> None:
    """Give the heap pages freed by a load back to the OS (glibc; a no-op elsewhere): the
    parser's temporary blocks would otherwise stay in the process's resident memory."""
    if _c is not None:
        _c.trim_heap()


__all__ = [
    "Column",
    "Columns",
    "concat_columns",
    "locate",
    "permute_chunks",
    "take_column",
    "take_rows",
    "trim_heap",
]
