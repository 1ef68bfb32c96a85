"""The graph tables' hot loops: compiled (``_graph_kernels.c``) when built, numpy otherwise.

Five loops, each with a numpy twin that stays the reference (same results; the sampler the
same distribution):

* :func:`parse_edges`: ``src<TAB>dst[<TAB>weight]`` lines straight into int64 / float32 arrays
  in one pass over the bytes (the numpy path needs a ``bytes.translate`` check, an
  ``np.fromstring`` parse and copies);
* :func:`sort_order`: the stable order of the edges by source, an LSD radix sort of 11-bit
  digits over the span of the source ids (two passes for a million node ids), each pass a
  streaming read and a 2,048-way scatter: several times faster than ``np.sort``;
* :func:`owned_mask`: which edges a server owns (the routing hash of every source) in one pass;
* :func:`sample_uniform`: uniform neighbour sampling (binary search of each node, then Floyd's
  algorithm for a subset without replacement) in one pass over the query nodes, no temporaries;
* :func:`place_segments`: the client's merge of the servers' jagged replies back into the
  caller's order, one ``memcpy`` per node instead of index arithmetic over every item.

``pip install`` compiles them (setup.py makes it optional); ``FLEET_PS_KERNELS=numpy`` forces
the numpy path, as for the sparse table's kernels.
"""

from __future__ import annotations

import os

import numpy as np

try:
    from ps_server.core import _graph_kernels as _c
except ImportError:  # not built (no C compiler at install time)
    _c = None

ENABLED = _c is not None and os.environ.get("FLEET_PS_KERNELS", "c").lower() != "numpy"
"""Whether the compiled graph loops are in use in this process."""


def parse_edges(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """(src, dst, weight or None when no line has one) of ``data``'s edge lines, or None when
    a line is not ``src<TAB>dst[<TAB>weight]`` with int64 ids and a decimal weight (blank lines
    are skipped). Compiled path only."""
    assert _c is not None
    # an edge line takes 4 bytes at least ("1<TAB>2<NL>"): room for every line without counting
    # them first; the pages past the last edge are never written, so never backed by memory
    cap = len(data) // 4 + 1
    src = np.empty(cap, np.int64)
    dst = np.empty(cap, np.int64)
    weight = np.empty(cap, np.float32)
    got = _c.parse_edges(bytes(data), src, dst, weight)
    if got is None:
        return None
    n, weighted = got
    return src[:n], dst[:n], weight[:n] if weighted else None


def sort_order(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(the stable sorting permutation of int64 ``keys``, the sorted keys) by an LSD radix sort
    of 11-bit digits over the keys' span, or None when the span and the position need more than
    63 bits together (or the kernels are not in use)."""
    n = int(keys.shape[0])
    if not ENABLED or n < 2:
        return None
    lo, hi = int(keys.min()), int(keys.max())
    key_bits = (hi - lo).bit_length()
    if key_bits + (n - 1).bit_length() > 63:
        return None
    order = np.empty(n, np.int64)
    ordered = np.empty(n, np.int64)
    assert _c is not None
    _c.radix_order(np.ascontiguousarray(keys, dtype=np.int64), lo, key_bits, order, ordered)
    return order, ordered


def owned_mask(
    keys: np.ndarray, salt: int, num_shards: int, num_servers: int, index: int
) -> np.ndarray:
    """bool mask of the ``keys`` whose shard (``mix64(key ^ salt) % num_shards``) server
    ``index`` of ``num_servers`` owns. Compiled path only."""
    assert _c is not None
    out = np.empty(keys.shape[0], np.uint8)
    _c.owned_mask(
        np.ascontiguousarray(keys, dtype=np.int64), salt, num_shards, num_servers, index, out
    )
    return out.view(bool)


def place_segments(
    offsets: np.ndarray,
    positions: np.ndarray,
    counts: np.ndarray,
    values: np.ndarray,
    out: np.ndarray,
) -> None:
    """Copy one server's jagged reply into the caller's order: node ``positions[i]``'s
    ``counts[i]`` items (the next ones of ``values``) to ``out[offsets[p]:offsets[p + 1]]``.
    Compiled path only."""
    assert _c is not None
    _c.place_segments(
        offsets,
        np.ascontiguousarray(positions, dtype=np.int64),
        np.ascontiguousarray(counts, dtype=np.int64),
        np.ascontiguousarray(values, dtype=out.dtype),
        out,
    )


def sample_uniform(
    src: np.ndarray,
    indptr: np.ndarray,
    nodes: np.ndarray,
    fanout: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """(CSR positions, counts) as :func:`ps_server.core.graph_sampling.sample_segments` gives
    them for uniform sampling, looking the nodes up in the CSR's sorted ``src`` itself; the
    random stream is seeded from ``rng``. Compiled path only."""
    assert _c is not None
    nodes = np.ascontiguousarray(nodes, dtype=np.int64)
    pos = np.empty(nodes.shape[0] * fanout, np.int64)
    counts = np.empty(nodes.shape[0], np.int64)
    seed = int(rng.integers(0, 2**63 - 1, dtype=np.int64))
    total = _c.sample_uniform(src, indptr, nodes, fanout, seed, pos, counts)
    return pos[:total], counts


__all__ = [
    "ENABLED",
    "owned_mask",
    "parse_edges",
    "place_segments",
    "sample_uniform",
    "sort_order",
]
