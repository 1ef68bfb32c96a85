"""Durable, verifiable files: every checkpoint file is written to a temporary name, fsynced and
renamed, and its directory is fsynced, so after a crash a file is either absent or complete;
manifests record each file's size and CRC-32 so a reader can tell a complete checkpoint from a
damaged one.

Why CRC-32 (``zlib.crc32``): it is in the standard library, releases the GIL on large buffers,
and measured 1.44 GB/s against 0.85 GB/s for BLAKE2b-128 and 0.63 GB/s for SHA-256 on this
project's 2-core machine (80 MB, best of 3; xxhash is not a dependency). It detects every
burst error up to 32 bits and random damage with probability 1 - 2^-32 — the threat is a torn
or bit-rotted file, not an adversary (the checkpoint roots and the job's token guard against
those). The checksum runs on the writer's background thread, never while training waits.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps_server.errors import CheckpointCorruptError, CheckpointVersionError

TMP_SUFFIX = ".tmp"
"""Suffix of a file being written (never read as part of a checkpoint)."""


@dataclass(frozen=True)
class FileRecord:
    """What a manifest says about one file: its size and the CRC-32 of its bytes."""

    bytes: int
    crc32: int

    def to_dict(self) -> dict[str, int]:
        """Plain data for a manifest."""
        return {"bytes": self.bytes, "crc32": self.crc32}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> FileRecord:
        """Parse a manifest entry (CheckpointCorruptError naming ``where`` if malformed)."""
        try:
            return cls(int(data["bytes"]), int(data["crc32"]))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointCorruptError(f"{where}: malformed file record {data!r}") from err


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory, so the renames inside it survive a crash."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, chunks: Iterable[bytes | memoryview]) -> FileRecord:
    """Write ``chunks`` to ``path`` atomically (temp file, fsync, rename); returns its record.
    The caller fsyncs the directory once all its files are written (:func:`fsync_dir`)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    crc = size = 0
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return FileRecord(size, crc)


def json_bytes(data: Any) -> bytes:
    """The bytes a manifest is written as (sorted keys, one space indent)."""
    return json.dumps(data, indent=1, sort_keys=True).encode("utf-8")


def write_json_atomic(path: Path, data: Any) -> FileRecord:
    """Write ``data`` as JSON atomically and fsync its directory; returns its record."""
    record = write_atomic(path, [json_bytes(data)])
    fsync_dir(path.parent)
    return record


def read_manifest_json(path: Path, fmt: str, version: int, what: str) -> dict[str, Any]:
    """The JSON object of manifest ``path``: CheckpointCorruptError if unreadable or not of
    format ``fmt``, CheckpointVersionError if of another format version."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointCorruptError(f"{path}: unreadable {what}: {err}") from err
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise CheckpointCorruptError(f"{path}: not a fleetrun {what}")
    if data.get("format_version") != version:
        raise CheckpointVersionError(
            f"{path}: {what} format version {data.get('format_version')!r}, this fleetrun reads "
            f"version {version}; load it with the fleetrun version that wrote it"
        )
    return data


def _check_size(path: Path, size: int, record: FileRecord) -> None:
    if size != record.bytes:
        what = "truncated (was the save interrupted?)" if size < record.bytes else "too long"
        raise CheckpointCorruptError(
            f"{path}: {size} bytes, the manifest says {record.bytes}: the file is {what}"
        )


def _check_crc(path: Path, crc: int, record: FileRecord) -> None:
    if crc != record.crc32:
        raise CheckpointCorruptError(
            f"{path}: CRC-32 {crc:#010x}, the manifest says {record.crc32:#010x}: the file is "
            "corrupted"
        )


def check_record(path: Path, raw: bytes | memoryview, record: FileRecord) -> None:
    """CheckpointCorruptError naming ``path`` unless ``raw`` (its bytes) has the size and CRC-32
    ``record`` gives."""
    _check_size(path, len(raw), record)
    _check_crc(path, zlib.crc32(raw), record)


def record_of(path: Path) -> FileRecord:
    """The size and CRC-32 of a (small) file as it is now."""
    raw = Path(path).read_bytes()
    return FileRecord(len(raw), zlib.crc32(raw))


def verify_file(path: Path, record: FileRecord, block_bytes: int = 16 << 20) -> None:
    """Check ``path`` against ``record``, reading it in blocks (CheckpointCorruptError naming
    the file when it is missing, of another size or fails its CRC-32)."""
    try:
        _check_size(path, os.path.getsize(path), record)
        crc = 0
        with open(path, "rb") as f:
            while block := f.read(block_bytes):
                crc = zlib.crc32(block, crc)
    except OSError as err:
        raise CheckpointCorruptError(f"{path}: cannot read it: {err}") from err
    _check_crc(path, crc, record)


__all__ = [
    "TMP_SUFFIX",
    "FileRecord",
    "check_record",
    "fsync_dir",
    "json_bytes",
    "read_manifest_json",
    "record_of",
    "verify_file",
    "write_atomic",
    "write_json_atomic",
]
