"""A graph table's adjacency for one edge type: the CSR arrays, their build from edge lists
(a stable sort by source: the compiled radix sort, else :func:`stable_order`), lookups of a
node's edges, and the store that buffers added edges until the next query merges them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ps_server.core import graph_kernels


def stable_order(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the stable sorting permutation of int64 ``keys``, the sorted keys), by one ``np.sort``
    of packed int64 words (key rank in the high bits, position in the low bits): numpy sorts
    int64 values with SIMD, several times faster than ``argsort``. Keys whose span leaves no
    room for the position bits are first replaced by their rank among the distinct keys."""
    n = int(keys.shape[0])
    if n < 2:
        return np.arange(n, dtype=np.int64), keys.copy()
    bits = (n - 1).bit_length()
    lo, hi = int(keys.min()), int(keys.max())
    uniq = None
    if hi - lo < 1 << (63 - bits):
        packed = keys - np.int64(lo)
    else:
        uniq = np.unique(keys)
        packed = np.searchsorted(uniq, keys).astype(np.int64)
    packed <<= np.int64(bits)
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    rank = packed >> np.int64(bits)
    packed &= np.int64((1 << bits) - 1)
    if uniq is None:
        rank += np.int64(lo)
        return packed, rank
    return packed, uniq[rank]


@dataclass(frozen=True)
class CSR:
    """One edge type's adjacency: sorted unique ``src``, ``indptr`` and per edge ``dst``,
    ``weight`` and ``eid`` (arrays replaced, never changed in place)."""

    src: np.ndarray
    indptr: np.ndarray
    dst: np.ndarray
    weight: np.ndarray
    eid: np.ndarray

    @staticmethod
    def empty() -> CSR:
        z = np.empty(0, np.int64)
        return CSR(z, np.zeros(1, np.int64), z, np.empty(0, np.float32), z)

    @staticmethod
    def build(src: np.ndarray, dst: np.ndarray, weight: np.ndarray, eid: np.ndarray) -> CSR:
        radix = graph_kernels.sort_order(src)
        order, s = radix if radix is not None else stable_order(src)
        n = order.shape[0]
        if n and int(eid[-1]) - int(eid[0]) == n - 1 and np.all(np.diff(eid) == 1):
            eid = eid[0] + order  # consecutive ids (a load): no random gather
        else:
            eid = eid[order]
        if n and weight.min() == weight.max():
            weight = np.full(n, weight[0], np.float32)  # all equal (unweighted): no gather
        else:
            weight = weight[order]
        cuts = np.flatnonzero(s[1:] != s[:-1]) + 1
        heads = np.concatenate([[0], cuts]) if s.shape[0] else cuts
        indptr = np.concatenate([heads, [s.shape[0]]]).astype(np.int64)
        return CSR(s[heads], indptr, dst[order], weight, eid)

    def edge_src(self) -> np.ndarray:
        return np.repeat(self.src, np.diff(self.indptr))

    @property
    def num_edges(self) -> int:
        return int(self.dst.shape[0])

    def locate(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(CSR start, degree) of each node (degree 0 for nodes without edges here)."""
        if self.src.shape[0] == 0:
            z = np.zeros(nodes.shape[0], np.int64)
            return z, z.copy()
        i = np.searchsorted(self.src, nodes)
        ic = np.minimum(i, self.src.shape[0] - 1)
        found = self.src[ic] == nodes
        starts = self.indptr[ic]
        deg = np.where(found, self.indptr[ic + 1] - starts, 0)
        return starts, deg


class EdgeStore:
    """One edge type's CSR plus the buffered additions."""

    def __init__(self) -> None:
        self.csr = CSR.empty()
        self.pending: list[tuple[np.ndarray, ...]] = []

    def merged(self) -> CSR:
        if self.pending:
            c = self.csr
            parts = [(c.edge_src(), c.dst, c.weight, c.eid)] if c.num_edges else []
            parts += self.pending
            self.csr = CSR.build(*(np.concatenate([p[k] for p in parts]) for k in range(4)))
            self.pending = []
        return self.csr


__all__ = ["CSR", "EdgeStore", "stable_order"]
