"""SampleNeighbors through shared memory: the layout of a same-host request and its reply in one
segment of :mod:`ps_server.rpc.shm` (the segments, attach protocol and fallbacks are that
module's; the sparse pulls and pushes use the same segments).

Why: a GraphSAGE hop moves far more bytes than it computes on: a hop of 15 k nodes with fanout
10 sends 60-120 KB of ids and receives 0.6-1.2 MB of neighbours, and through gRPC over loopback
each of these is serialised, copied through the kernel and parsed on both sides.

A SampleNeighbors request of ``n`` nodes with fanout ``f`` to a server on this host is a small
frame (no arrays) naming the segment (``shm_segment``) and ``n`` (``shm_num_nodes``). The
segment holds these sections, each starting on a multiple of :data:`~ps_server.rpc.shm.ALIGN`
bytes from offset 0, in this order:

* ``nodes``: int64[n], the query nodes, written by the client;
* ``counts``: int64[n], the neighbours sampled per node, written by the server;
* ``values``: int64[n * f], the sampled neighbours node after node (the first ``total`` are set);
* ``weights``: float32[n * f] and ``eids``: int64[n * f], only when the request asks for them.

The reply frame carries ``total`` and no arrays. The sections are sized for the upper bound of
``n * f`` neighbours, which the client knows before sending; a request whose bound is below
:data:`~ps_server.rpc.shm.MIN_SHM_BYTES` or above ``shm_max_mb`` goes through gRPC, as does a
request to a server that cannot attach a segment.
"""

from __future__ import annotations

import mmap

import numpy as np

from ps_server.rpc.shm import ALIGN
from ps_server.rpc.status import RequestDecodeError

_I8 = np.dtype("<i8")
_F4 = np.dtype("<f4")
_PER_NODE = ("nodes", "counts")


def _kinds(weights: bool, eids: bool) -> list[tuple[str, np.dtype]]:
    kinds = [("nodes", _I8), ("counts", _I8), ("values", _I8)]
    return kinds + [("weights", _F4)] * weights + [("eids", _I8)] * eids


def layout(
    num_nodes: int, fanout: int, weights: bool = False, eids: bool = False
) -> tuple[dict[str, tuple[int, np.dtype, int]], int]:
    """({section: (byte offset, dtype, items)}, bytes needed) of a request of ``num_nodes``
    nodes with ``fanout``."""
    sections, offset = {}, 0
    for name, dtype in _kinds(weights, eids):
        count = num_nodes if name in _PER_NODE else num_nodes * fanout
        sections[name] = (offset, dtype, count)
        offset += -(-count * dtype.itemsize // ALIGN) * ALIGN
    return sections, offset


def bytes_needed(num_nodes: int, fanout: int, weights: bool = False, eids: bool = False) -> int:
    """Segment bytes for a request of ``num_nodes`` nodes with ``fanout`` and its reply."""
    return layout(num_nodes, fanout, weights, eids)[1]


def views(
    buf: mmap.mmap,
    size: int,
    num_nodes: object,
    fanout: int,
    weights: bool = False,
    eids: bool = False,
) -> dict[str, np.ndarray]:
    """Writable views of the sections of a ``size``-byte segment mapped at ``buf``;
    RequestDecodeError when ``num_nodes`` is not a count or the sections do not fit."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 0:
        raise RequestDecodeError(f"shm: shm_num_nodes must be an integer >= 0, got {num_nodes!r}")
    sections, need = layout(num_nodes, fanout, weights, eids)
    if need > size:
        raise RequestDecodeError(
            f"shm: SampleNeighbors of {num_nodes} nodes with fanout {fanout} needs {need} bytes; "
            f"the segment has {size}"
        )
    return {
        name: np.frombuffer(buf, dtype, count, offset)
        for name, (offset, dtype, count) in sections.items()
    }


__all__ = ["bytes_needed", "layout", "views"]
