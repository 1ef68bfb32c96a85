"""The binary shard file of a checkpoint: one file per (table, shard), explicit little-endian.

Layout (format version 1). A fixed 80-byte header::

    off size  field
      0    8  magic  b"FLRPSSHD"
      8    4  u32 format version (1)
     12    4  u32 header size (80)
     16    1  u8  kind: 0 sparse, 1 dense
     17    1  u8  mode: 0 all, 1 delta
     18    2  u16 reserved (0)
     20    4  u32 shard index
     24    4  u32 dim (floats per row; dense: 0)
     28    4  u32 state_dim (optimizer-state floats per row; dense: 0)
     32    8  u64 R: rows (sparse) or blocks (dense)
     40    8  u64 P: pending (not yet admitted) keys
     48    8  u64 D: deleted keys (delta only)
     56    8  u64 E: deleted pending keys (delta only)
     64    8  u64 payload size in bytes
     72    4  u32 CRC-32 of the payload
     76    4  u32 CRC-32 of header bytes 0..75

then the payload. Sparse: consecutive arrays — ``keys i64[R]``, ``values f32[R, dim]``,
``state f32[R, state_dim]``, ``count u32[R]``, ``unseen_days u16[R]``, ``flags u8[R]`` (bit 2 =
pushed since the last end_day), ``pending_keys i64[P]``, ``pending_count u32[P]``,
``pending_unseen_days u16[P]``, ``pending_flags u8[P]``, ``deleted_keys i64[D]``,
``deleted_pending_keys i64[E]``. Dense: R blocks, each ``u16 name length, UTF-8 name,
u64 numel, u64 state length, f32[numel] values, f32[state length] state``.

A reader rejects a wrong magic or CRC (:class:`CheckpointCorruptError`), a size other than the
header's (truncated), and an unknown version (:class:`CheckpointVersionError`).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ps_server.checkpoint.files import FileRecord, check_record, write_atomic
from ps_server.core.shard_data import DenseBlockData, DenseShardData, SparseShardData
from ps_server.errors import CheckpointCorruptError, CheckpointVersionError

MAGIC = b"FLRPSSHD"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIBBHIIIQQQQQII")
assert HEADER.size == 80
KIND_CODES = {"sparse": 0, "dense": 1}
MODE_CODES = {"all": 0, "delta": 1}


_SPARSE_ROW_DTYPES = ("<i8", "<f4", "<f4", "<u4", "<u2", "u1")
_SPARSE_PENDING_DTYPES = ("<i8", "<u4", "<u2", "u1")


def _sparse_chunks(d: SparseShardData) -> list[np.ndarray]:
    arrays = [d.keys, d.values, d.state, d.count, d.unseen_days, d.flags]
    out = [
        np.ascontiguousarray(a, dtype=t) for a, t in zip(arrays, _SPARSE_ROW_DTYPES, strict=True)
    ]
    pend = [d.pending_keys, d.pending_count, d.pending_unseen_days, d.pending_flags]
    out += [
        np.ascontiguousarray(a, dtype=t) for a, t in zip(pend, _SPARSE_PENDING_DTYPES, strict=True)
    ]
    out += [
        np.ascontiguousarray(d.deleted_keys, dtype="<i8"),
        np.ascontiguousarray(d.deleted_pending_keys, dtype="<i8"),
    ]
    return out


def _dense_chunks(d: DenseShardData) -> list[bytes | np.ndarray]:
    out: list[bytes | np.ndarray] = []
    for b in d.blocks:
        name = b.name.encode("utf-8")
        values = np.ascontiguousarray(b.values, dtype="<f4").reshape(-1)
        state = np.ascontiguousarray(b.state, dtype="<f4").reshape(-1)
        out.append(
            struct.pack("<H", len(name)) + name + struct.pack("<QQ", values.size, state.size)
        )
        out += [values, state]
    return out


def _as_bytes(chunk: bytes | np.ndarray) -> bytes | memoryview:
    if isinstance(chunk, np.ndarray):
        return memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
    return chunk


def write_shard(
    path: Path, data: SparseShardData | DenseShardData, mode: str, dim: int = 0, state_dim: int = 0
) -> FileRecord:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename; the caller fsyncs the
    directory); returns the file's size and CRC-32 for the manifest."""
    if isinstance(data, SparseShardData):
        kind, chunks = "sparse", _sparse_chunks(data)
        counts = (
            data.keys.shape[0],
            data.pending_keys.shape[0],
            data.deleted_keys.shape[0],
            data.deleted_pending_keys.shape[0],
        )
    else:
        kind, chunks = "dense", _dense_chunks(data)
        counts = (len(data.blocks), 0, 0, 0)
        dim = state_dim = 0
    crc = 0
    size = 0
    chunks = [_as_bytes(c) for c in chunks]
    for view in chunks:
        crc = zlib.crc32(view, crc)
        size += len(view)
    head = HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER.size,
        KIND_CODES[kind],
        MODE_CODES[mode],
        0,
        data.shard,
        dim,
        state_dim,
        *counts,
        size,
        crc,
        0,
    )
    head = head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]))
    return write_atomic(path, [head, *chunks])


@dataclass(frozen=True)
class ShardHeader:
    """The decoded header of a shard file."""

    version: int
    kind: str
    mode: str
    shard: int
    dim: int
    state_dim: int
    num_rows: int
    num_pending: int
    num_deleted: int
    num_deleted_pending: int
    payload_bytes: int
    payload_crc: int


def _parse_header(path: Path, raw: bytes) -> ShardHeader:
    if len(raw) < HEADER.size:
        raise CheckpointCorruptError(
            f"{path}: {len(raw)} bytes, shorter than the {HEADER.size}-byte header: the file is "
            "truncated (was the save interrupted?)"
        )
    (
        magic,
        version,
        header_size,
        kind,
        mode,
        _,
        shard,
        dim,
        state_dim,
        rows,
        pending,
        deleted,
        deleted_pending,
        payload_bytes,
        payload_crc,
        header_crc,
    ) = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CheckpointCorruptError(
            f"{path}: bad magic {magic!r} (expected {MAGIC!r}): not a "
            "fleetrun parameter-server shard file"
        )
    if version != FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{path}: shard format version {version}, this fleetrun reads version "
            f"{FORMAT_VERSION}; load it with the fleetrun version that wrote it"
        )
    if zlib.crc32(raw[: HEADER.size - 4]) != header_crc or header_size != HEADER.size:
        raise CheckpointCorruptError(f"{path}: header checksum mismatch: the file is corrupted")
    kinds = {v: k for k, v in KIND_CODES.items()}
    modes = {v: k for k, v in MODE_CODES.items()}
    if kind not in kinds or mode not in modes:
        raise CheckpointCorruptError(f"{path}: unknown kind {kind} or mode {mode} in the header")
    return ShardHeader(
        version,
        kinds[kind],
        modes[mode],
        shard,
        dim,
        state_dim,
        rows,
        pending,
        deleted,
        deleted_pending,
        payload_bytes,
        payload_crc,
    )


class _Reader:
    def __init__(self, path: Path, buf: memoryview) -> None:
        self.path, self.buf, self.pos = path, buf, 0

    def array(self, dtype: str, count: int, shape: tuple[int, ...] | None = None) -> np.ndarray:
        dt = np.dtype(dtype)
        end = self.pos + dt.itemsize * count
        if end > len(self.buf):
            raise CheckpointCorruptError(f"{self.path}: payload shorter than its header says")
        a = np.frombuffer(self.buf[self.pos : end], dtype=dt).astype(dt.newbyteorder("="))
        self.pos = end
        return a.reshape(shape) if shape is not None else a

    def raw(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise CheckpointCorruptError(f"{self.path}: payload shorter than its header says")
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out


def read_shard(
    path: Path, record: FileRecord | None = None
) -> tuple[ShardHeader, SparseShardData | DenseShardData]:
    """Read and verify one shard file (size, checksums, version; against the manifest's
    ``record`` too when given)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise CheckpointCorruptError(f"{path}: cannot read the shard file: {err}") from err
    head = _parse_header(path, raw)
    actual = len(raw) - HEADER.size
    if actual != head.payload_bytes:
        what = (
            "truncated (was the save interrupted?)"
            if actual < head.payload_bytes
            else "has trailing bytes"
        )
        raise CheckpointCorruptError(
            f"{path}: payload is {actual} bytes, the header says {head.payload_bytes}: "
            f"the file is {what}"
        )
    payload = memoryview(raw)[HEADER.size :]
    if zlib.crc32(payload) != head.payload_crc:
        raise CheckpointCorruptError(f"{path}: payload checksum mismatch: the file is corrupted")
    if record is not None:  # a sound file, but is it the one the manifest lists?
        check_record(path, raw, record)
    r = _Reader(path, payload)
    if head.kind == "sparse":
        n, p = head.num_rows, head.num_pending
        data: SparseShardData | DenseShardData = SparseShardData(
            shard=head.shard,
            keys=r.array("<i8", n),
            values=r.array("<f4", n * head.dim, (n, head.dim)),
            state=r.array("<f4", n * head.state_dim, (n, head.state_dim)),
            count=r.array("<u4", n),
            unseen_days=r.array("<u2", n),
            flags=r.array("u1", n),
            pending_keys=r.array("<i8", p),
            pending_count=r.array("<u4", p),
            pending_unseen_days=r.array("<u2", p),
            pending_flags=r.array("u1", p),
            deleted_keys=r.array("<i8", head.num_deleted),
            deleted_pending_keys=r.array("<i8", head.num_deleted_pending),
        )
    else:
        blocks = []
        for _ in range(head.num_rows):
            (name_len,) = struct.unpack("<H", r.raw(2))
            name = r.raw(name_len).decode("utf-8")
            numel, state_len = struct.unpack("<QQ", r.raw(16))
            blocks.append(DenseBlockData(name, r.array("<f4", numel), r.array("<f4", state_len)))
        data = DenseShardData(head.shard, blocks)
    if r.pos != len(payload):
        raise CheckpointCorruptError(f"{path}: {len(payload) - r.pos} unexplained payload bytes")
    return head, data


__all__ = [
    "FORMAT_VERSION",
    "DenseBlockData",
    "DenseShardData",
    "ShardHeader",
    "SparseShardData",
    "read_shard",
    "write_shard",
]
