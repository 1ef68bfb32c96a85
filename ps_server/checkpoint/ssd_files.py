"""The cold rows of SSD tables in a checkpoint: RocksDB checkpoints, hard-linked or copied.

A checkpoint (not a serving export) of an SSD table (``storage="ssd"``) holds, per saving
server, its shards' memory rows as ordinary shard files and its cold rows as the files of a
RocksDB checkpoint of its tier (:class:`~ps_server.core.ssd_snapshot.NativeSnapshot`)::

    <dir>/<table>/shard-00007.bin         the shard's memory rows (and count-filter keys)
    <dir>/<table>/rocksdb-00000/          the cold rows of the server owning shards 0, 2, ...
        000012.sst, MANIFEST-000005, CURRENT, OPTIONS-000007, ...

Each server's manifest lists the RocksDB files under ``files`` (size and CRC-32, as every other
file) and, in the table's entry, ``cold``: one item per server with ``format``
(:data:`COLD_FORMAT`), ``dir``, the ``shards`` the tier held, its ``rows``, the table's ``day``,
eviction ``seq`` and change-log ``epochs`` at the cut, and how many files were ``linked`` and
``copied``, and ``keyfilter``: the table's key filter at the cut (``<table>/keyfilter-00000.npz``,
its bit arrays as they were when written: a filter only gains bits, so it holds every key of the
cut), which spares a load the key scan that would rebuild it.

:func:`write_cold` hard-links the staged files (on the tier's filesystem) into the checkpoint
directory when both are on one filesystem: the save then takes no disk space for the cold rows
until training compacts the tier's files away. Elsewhere (another filesystem, or one without
hard links) it copies them, fsynced. A load (:func:`cold_rows`) into an SSD table that owns
exactly the shards of one item adopts its files as the tier's database (SST files linked, the
small others copied: RocksDB appends to its MANIFEST); any other reader (another server count,
a memory table) opens each item read-only and streams its rows shard by shard.
"""

from __future__ import annotations

import logging
import os
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ps_server.checkpoint.files import FileRecord, fsync_dir, verify_file
from ps_server.checkpoint.manifest import CheckpointInfo, TableEntry
from ps_server.core.ssd_filter import KeyFilter
from ps_server.core.ssd_snapshot import ColdCut, ColdReader, NativeSnapshot
from ps_server.errors import CheckpointCorruptError, SsdTierError

logger = logging.getLogger(__name__)

COLD_FORMAT = "rocksdb-checkpoint"
"""The ``format`` of a ``cold`` item of a manifest's table entry."""
_COPY_BLOCK = 16 << 20


def cold_relpath(table: str, first_shard: int) -> str:
    """The directory (relative to the checkpoint) of the cold rows of the server whose first
    owned shard is ``first_shard``."""
    return f"{table}/rocksdb-{first_shard:05d}"


def keyfilter_relpath(table: str, first_shard: int) -> str:
    """The file (relative to the checkpoint) of the key filter saved with the cold rows of the
    server whose first owned shard is ``first_shard``."""
    return f"{table}/keyfilter-{first_shard:05d}.npz"


def _write_keyfilter(path: Path, parts: tuple[tuple[np.ndarray, int], ...]) -> FileRecord:
    """The bit arrays and key counts of a key filter as one ``.npz`` (atomic, fsynced)."""
    arrays = {f"words{i}": words for i, (words, _count) in enumerate(parts)}
    arrays["counts"] = np.array([count for _words, count in parts], dtype=np.int64)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return _record(path)


def read_keyfilter(cut: ColdCut) -> KeyFilter | None:
    """The key filter saved with ``cut`` (verified with the other files); None if none was."""
    if not cut.keyfilter_path:
        return None
    try:
        with np.load(cut.keyfilter_path) as data:
            counts = data["counts"]
            parts = [(data[f"words{i}"], int(counts[i])) for i in range(counts.shape[0])]
        return KeyFilter.from_parts(parts)
    except (OSError, KeyError, ValueError) as err:
        raise CheckpointCorruptError(
            f"table {cut.table!r}: {cut.keyfilter_path}: not a key filter: {err}"
        ) from None


def place_file(src: str | os.PathLike, dst: str | os.PathLike, link: bool = True) -> bool:
    """Put ``src`` at ``dst``: a hard link when ``link`` and the filesystem allows it, else an
    fsynced copy. True if linked."""
    if link:
        try:
            os.link(src, dst)
            return True
        except FileNotFoundError:
            raise
        except OSError:
            pass  # another filesystem (EXDEV) or no hard links there: copy
    tmp = f"{dst}.tmp"
    with open(src, "rb") as f, open(tmp, "wb") as g:
        shutil.copyfileobj(f, g, _COPY_BLOCK)
        g.flush()
        os.fsync(g.fileno())
    os.replace(tmp, dst)
    return False


def _record(path: Path) -> FileRecord:
    crc = size = 0
    with open(path, "rb") as f:
        while block := f.read(_COPY_BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return FileRecord(size, crc)


def write_cold(root: Path, snap: NativeSnapshot) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Put the staged RocksDB checkpoint of ``snap`` into checkpoint ``root`` (links where the
    filesystem allows, copies elsewhere); returns (the ``cold`` item, the files' records for
    the manifest, their bytes). The staged files are left for :meth:`NativeSnapshot.release`."""
    cut = snap.cold_cut
    if not os.path.isdir(cut.path):
        raise SsdTierError(
            cut.table,
            cut.path,
            "the staged RocksDB checkpoint is gone: the table was cleared or closed while its "
            "checkpoint was being written; save again",
        )
    rel = cold_relpath(cut.table, cut.shards[0])
    dest = root / rel
    if dest.exists():
        shutil.rmtree(dest)  # left by an earlier, failed write of this directory
    dest.mkdir(parents=True)
    linked = copied = total = 0
    files: dict[str, Any] = {}
    for name in sorted(os.listdir(cut.path)):
        if place_file(os.path.join(cut.path, name), dest / name):
            linked += 1
        else:
            copied += 1
        record = _record(dest / name)
        files[f"{rel}/{name}"] = record.to_dict()
        total += record.bytes
    fsync_dir(dest)
    item = {"format": COLD_FORMAT, "dir": rel, **cut.to_dict(), "linked": linked}
    item["copied"] = copied
    if cut.keyfilter:  # a load then needs no key scan
        kf_rel = keyfilter_relpath(cut.table, cut.shards[0])
        record = _write_keyfilter(root / kf_rel, cut.keyfilter)
        files[kf_rel] = record.to_dict()
        total += record.bytes
        item["keyfilter"] = kf_rel
    if copied:
        logger.info(
            "table %r: %d of %d RocksDB files copied into %s (not on the tier's filesystem, "
            "or no hard links there)",
            cut.table,
            copied,
            linked + copied,
            dest,
        )
    return item, files, total


@dataclass
class ColdRows:
    """The cold rows a table of a checkpoint keeps in RocksDB checkpoints (its ``cold`` items),
    for one loading table."""

    info: CheckpointInfo
    entry: TableEntry
    table: str
    cuts: list[ColdCut] = field(default_factory=list)
    _readers: dict[int, ColdReader] = field(default_factory=dict)

    @classmethod
    def of(cls, info: CheckpointInfo, entry: TableEntry, table: str) -> ColdRows:
        """The ``cold`` items of ``table`` in ``info`` (none for row-file tables)."""
        out = cls(info, entry, table)
        decay = float(getattr(entry.config, "show_decay_rate", 1.0))
        for item in entry.cold:
            if item.get("format") != COLD_FORMAT:
                raise CheckpointCorruptError(
                    f"{info.directory}: table {table!r}: unknown cold-row format "
                    f"{item.get('format')!r} (a newer fleetrun wrote it?)"
                )
            try:
                path = str(info.directory / item["dir"])
                cut = ColdCut.from_dict(
                    item,
                    path,
                    table,
                    entry.config.num_shards,
                    entry.dim,
                    entry.state_dim,
                    decay,
                    str(info.directory / item["keyfilter"]) if item.get("keyfilter") else "",
                )
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointCorruptError(
                    f"{info.directory}: table {table!r}: malformed cold item {item!r}: {err}"
                ) from None
            out.cuts.append(cut)
        return out

    def adoptable(self, shards: tuple[int, ...]) -> ColdCut | None:
        """The item holding the cold rows of exactly ``shards``, if the checkpoint has one."""
        for cut in self.cuts:
            if cut.shards == tuple(shards):
                return cut
        return None

    def touching(self, shards: tuple[int, ...]) -> list[ColdCut]:
        """The items holding rows of any of ``shards``."""
        want = set(shards)
        return [c for c in self.cuts if want.intersection(c.shards)]

    def verify(self, cuts: list[ColdCut]) -> None:
        """Every file of ``cuts`` against the manifest (CheckpointCorruptError naming the table
        and the file: missing, of another size, or failing its CRC-32)."""
        files = self.info.files or {}
        for cut in cuts:
            rel = os.path.relpath(cut.path, self.info.directory).replace(os.sep, "/") + "/"
            kf = os.path.relpath(cut.keyfilter_path, self.info.directory).replace(os.sep, "/")
            listed = {
                r: rec
                for r, rec in files.items()
                if r.startswith(rel) or (cut.keyfilter_path and r == kf)
            }
            if not listed:
                raise CheckpointCorruptError(
                    f"table {self.table!r}: {cut.path}: the manifests list no file of this "
                    "RocksDB checkpoint"
                )
            for r, rec in sorted(listed.items()):
                try:
                    verify_file(self.info.directory / r, rec)
                except CheckpointCorruptError as err:
                    raise CheckpointCorruptError(
                        f"table {self.table!r}: cold rows (RocksDB checkpoint): {err}"
                    ) from None

    def rows(self, shard: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(keys, records aged to the save's day) of ``shard``'s cold rows, None if none."""
        for cut in self.cuts:
            if shard in cut.shards:
                reader = self._readers.get(id(cut))
                if reader is None:
                    reader = self._readers[id(cut)] = ColdReader(cut)
                return reader.shard(shard)
        return None

    def count(self, shards: tuple[int, ...]) -> int:
        """At most how many cold rows ``shards`` have (the items touching them)."""
        return sum(c.rows for c in self.touching(shards))

    def close(self) -> None:
        """Close the databases opened for reading."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def adopt_files(cut: ColdCut) -> Any:
    """``place(db_dir)`` for :func:`~ps_server.core.ssd_import.adopted`: the SST files of
    ``cut`` hard-linked (copied where the filesystem cannot link), the others copied."""

    def place(db: str) -> None:
        linked = copied = 0
        for name in sorted(os.listdir(cut.path)):
            src, dst = os.path.join(cut.path, name), os.path.join(db, name)
            if place_file(src, dst, link=name.endswith(".sst")):
                linked += 1
            else:
                copied += 1
        logger.info(
            "table %r: tier database from %s (%d files linked, %d copied)",
            cut.table,
            cut.path,
            linked,
            copied,
        )

    return place


__all__ = [
    "COLD_FORMAT",
    "ColdRows",
    "adopt_files",
    "cold_relpath",
    "keyfilter_relpath",
    "place_file",
    "read_keyfilter",
    "write_cold",
]
