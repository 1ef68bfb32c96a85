"""Same-host fast path: the bulk arrays of sparse pulls and pushes through shared memory.

Why: on one host (trainers colocated with their servers, Paddle's usual PS layout) the keys,
rows and gradients of a large sparse request cost far more to move through gRPC over loopback
TCP (serialise, kernel copies both ways, parse: measured ~0.7 M keys/s of pull+push at dim 64)
than to compute on. torch.distributed.rpc (TensorPipe's shm channel) and Ray (its object store)
move such arrays through shared memory; so do we, and keep gRPC for everything else: the
request still travels as a (small) gRPC message, the status codes, deadlines, metrics and error
handling are those of the normal path, and any failure to set the segment up falls back to TCP.

Protocol:

1. The client creates a segment ``/dev/shm/fleetps_<32 hex>`` (mode 0600, its own user), writes a
   random 16-byte token at offset 0 and calls ``ShmAttach(segment, token)``.
2. The server opens the file by that name (names are checked against :data:`NAME_RE`; nothing
   else under /dev/shm is ever opened), maps it, checks the token (this proves both processes see
   the same /dev/shm: same host, same IPC mount) and remembers it (at most
   :data:`MAX_SEGMENTS_PER_SERVER`). The client then unlinks the file: both keep their mapping,
   and the memory goes away with the last of them, so a crash leaks nothing.
3. A PullSparse / PushSparse request names the segment and the key count instead of carrying the
   arrays: keys at offset 0, rows / gradients at :func:`rows_offset`. The server reads them in
   place (zero copy) and writes the pulled rows back there; the reply carries no values. One
   segment serves one call at a time (the client leases it for the call).
4. ``ShmDetach(segment)`` when the client closes; a segment a server does not know (it restarted,
   or never attached it) is a FAILED_PRECONDITION naming it.

SampleNeighbors of the graph tables uses the same segments, with a layout of its own
(:mod:`ps_server.rpc.graph_shm`).

Used for requests of at least :data:`MIN_SHM_BYTES` (below that the copies are cheap and one
extra code path is not worth it) up to ``shm_max_mb``; off with ``PSClient(..., shm=False)`` or
``FLEET_PS_SHM=0``.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import threading
from dataclasses import dataclass, field

import numpy as np

from ps_server.errors import ShmSegmentError
from ps_server.rpc.status import RequestDecodeError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"^fleetps_[0-9a-f]{32}$")
"""The only names a server opens (under :data:`SHM_DIR`)."""
TOKEN_BYTES = 16
ALIGN = 64
MIN_SHM_BYTES = 64 * 1024
"""Requests smaller than this go through gRPC as usual (a CTR batch's pull or push of ~6 k keys
at dim 8, ~250 KB, costs the server and the client each ~0.3 ms less CPU through a segment)."""
MIN_SEGMENT_BYTES = 1 << 20
MAX_SEGMENTS_PER_SERVER = 256
"""Segments one server keeps mapped (clients lease one per concurrent call per server)."""
KEY_DTYPE = np.dtype("<i8")
VALUE_DTYPE = np.dtype("<f4")


def enabled_by_env() -> bool:
    """False when ``FLEET_PS_SHM=0`` (or /dev/shm is missing)."""
    return os.environ.get("FLEET_PS_SHM", "1") != "0" and os.path.isdir(SHM_DIR)


def rows_offset(num_keys: int) -> int:
    """Byte offset of the rows / gradients in a segment holding ``num_keys`` keys."""
    return -(-num_keys * KEY_DTYPE.itemsize // ALIGN) * ALIGN


def bytes_needed(num_keys: int, dim: int) -> int:
    """Segment bytes for ``num_keys`` keys and their float32 rows of ``dim``."""
    return rows_offset(num_keys) + num_keys * dim * VALUE_DTYPE.itemsize


def blocks(rows: np.ndarray, widths: tuple[int, ...]) -> list[np.ndarray]:
    """The ``[n, sum(widths)]`` rows region of a segment as consecutive C-contiguous blocks
    ``[n, width]`` (a pull with state: the values, then the optimizer state)."""
    n = rows.shape[0]
    flat = rows.reshape(-1)
    out, at = [], 0
    for width in widths:
        out.append(flat[at : at + n * width].reshape(n, width))
        at += n * width
    return out


def _views(buf: mmap.mmap, size: int, num_keys: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    if bytes_needed(num_keys, dim) > size:
        raise RequestDecodeError(
            f"shm: {num_keys} keys of dim {dim} need {bytes_needed(num_keys, dim)} bytes; the "
            f"segment has {size}"
        )
    keys = np.frombuffer(buf, KEY_DTYPE, num_keys, 0)
    rows = np.frombuffer(buf, VALUE_DTYPE, num_keys * dim, rows_offset(num_keys))
    return keys, rows.reshape(num_keys, dim)


# -- the client side ---------------------------------------------------------------------------
@dataclass
class Segment:
    """One segment this client created (and unlinked after the server attached it)."""

    server: int
    name: str
    size: int
    buf: mmap.mmap

    def views(self, num_keys: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """Writable (keys, rows[num_keys, dim]) views of the segment."""
        return _views(self.buf, self.size, num_keys, dim)


def create_segment(server: int, size: int) -> tuple[Segment, bytes]:
    """A new segment of at least ``size`` bytes and its token (written at offset 0)."""
    size = max(MIN_SEGMENT_BYTES, 1 << (max(size, TOKEN_BYTES) - 1).bit_length())
    name = f"fleetps_{secrets.token_hex(16)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    token = secrets.token_bytes(TOKEN_BYTES)
    buf[:TOKEN_BYTES] = token
    return Segment(server, name, size, buf), token


def close_quietly(buf: mmap.mmap) -> None:
    """Unmap ``buf``; while numpy views of it are alive, the mapping goes with the last one."""
    try:
        buf.close()
    except BufferError:
        pass


def unlink_quietly(name: str) -> None:
    """Remove ``/dev/shm/<name>`` if it is still there."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


@dataclass
class ShmPool:
    """The client's segments: leased one per call, per server; servers that cannot attach (not
    on this host) are remembered and get TCP from then on."""

    max_bytes: int
    free: dict[int, list[Segment]] = field(default_factory=dict)
    attached: dict[str, Segment] = field(default_factory=dict)
    off: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def usable(self, server: int, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` to ``server`` should go through shared memory."""
        return MIN_SHM_BYTES <= nbytes <= self.max_bytes and server not in self.off

    def lease(self, server: int, nbytes: int, attach: object) -> Segment | None:
        """A segment of ``server`` with room for ``nbytes`` (created and attached when none is
        free: ``attach(server, name, token) -> bool``); None when ``server`` cannot use one."""
        with self.lock:
            if server in self.off:
                return None
            segs = self.free.setdefault(server, [])
            for i, seg in enumerate(segs):
                if seg.size >= nbytes:
                    return segs.pop(i)
        seg, token = create_segment(server, nbytes)
        try:
            ok = attach(server, seg.name, token)  # type: ignore[operator]
        finally:
            unlink_quietly(seg.name)
        if not ok:
            close_quietly(seg.buf)
            with self.lock:
                self.off.add(server)
            return None
        with self.lock:
            self.attached[seg.name] = seg
        return seg

    def release(self, seg: Segment) -> None:
        """Give a leased segment back."""
        with self.lock:
            if seg.name in self.attached:
                self.free.setdefault(seg.server, []).append(seg)

    def forget_server(self, server: int) -> list[str]:
        """Drop every free segment of ``server`` (it lost them: restarted); their names."""
        with self.lock:
            segs = self.free.pop(server, [])
            for seg in segs:
                self.attached.pop(seg.name, None)
        for seg in segs:
            close_quietly(seg.buf)
        return [s.name for s in segs]

    def close(self) -> list[Segment]:
        """Unmap everything; the segments that were attached (to detach them on the servers)."""
        with self.lock:
            segs = list(self.attached.values())
            self.attached.clear()
            self.free.clear()
        for seg in segs:
            close_quietly(seg.buf)
        return segs


# -- the server side ---------------------------------------------------------------------------
class ShmRegistry:
    """The segments clients attached to this server."""

    def __init__(self, limit: int = MAX_SEGMENTS_PER_SERVER, enabled: bool | None = None) -> None:
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}
        self._lock = threading.Lock()
        self.limit = limit
        self.enabled = enabled_by_env() if enabled is None else enabled
        """False (``FLEET_PS_SHM=0`` in the server's environment): every attach is refused."""

    def __len__(self) -> int:
        return len(self._maps)

    def attach(self, name: str, token: bytes) -> None:
        """Map ``/dev/shm/<name>`` and check its token; errors name the segment."""
        if not NAME_RE.match(name):
            raise RequestDecodeError(f"shm: segment name {name!r} is not fleetps_<32 hex digits>")
        if not self.enabled:
            raise ShmSegmentError("shm: shared memory is off on this server (FLEET_PS_SHM=0)")
        with self._lock:
            if name in self._maps:
                return
            if len(self._maps) >= self.limit:
                raise ShmSegmentError(
                    f"shm: this server already maps {self.limit} segments; use TCP "
                    "(PSClient(shm=False)) or fewer concurrent clients"
                )
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as err:
            raise ShmSegmentError(
                f"shm: cannot open segment {name} ({err.strerror}): client and server do not "
                "share /dev/shm (another host or container); the client falls back to TCP"
            ) from err
        try:
            size = os.fstat(fd).st_size
            if size < MIN_SEGMENT_BYTES:
                raise RequestDecodeError(f"shm: segment {name} has {size} bytes, too small")
            buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if bytes(buf[:TOKEN_BYTES]) != bytes(token):
            close_quietly(buf)
            raise ShmSegmentError(f"shm: segment {name} does not carry the client's token")
        with self._lock:
            self._maps[name] = (buf, size)

    def detach(self, name: str) -> bool:
        """Unmap segment ``name``; False when it was not attached."""
        with self._lock:
            entry = self._maps.pop(name, None)
        if entry is None:
            return False
        close_quietly(entry[0])  # a request may still read it
        return True

    def mapping(self, name: str) -> tuple[mmap.mmap, int]:
        """(the mapping, its size in bytes) of attached segment ``name``."""
        entry = self._maps.get(name)
        if entry is None:
            raise ShmSegmentError(
                f"shm: segment {name} is not attached to this server (it restarted, or the "
                "client never called ShmAttach); the client re-attaches on its next call"
            )
        return entry

    def views(self, name: str, num_keys: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, rows[num_keys, dim]) views of attached segment ``name``."""
        return _views(*self.mapping(name), num_keys, dim)

    def close(self) -> None:
        """Unmap every segment."""
        for name in list(self._maps):
            self.detach(name)


__all__ = [
    "MIN_SHM_BYTES",
    "NAME_RE",
    "Segment",
    "ShmPool",
    "ShmRegistry",
    "ShmSegmentError",
    "blocks",
    "bytes_needed",
    "create_segment",
    "enabled_by_env",
    "rows_offset",
]
