"""Numbered checkpoints of a whole job in one root directory: the commit that makes one
complete, choosing the newest good one after a failure, and keeping the last K.

Layout::

    <root>/ckpt-000012/checkpoint.json          the job's manifest, written LAST (the commit)
    <root>/ckpt-000012/manifest.server-0.json   each server's manifest (ps_server.checkpoint.manifest)
    <root>/ckpt-000012/emb/shard-00003.bin      shard files
    <root>/ckpt-000024/...

A checkpoint is one consistent cut of the job (every server's tables at the same step, plus an
opaque JSON state per trainer, e.g. its data position). It is made in two phases: every server
snapshots its tables and writes its files and its own manifest (:mod:`ps_server.checkpoint.writer`);
only when every server reported its part durable does the coordinator :func:`commit` it, which
checks the servers' manifests and writes ``checkpoint.json`` — with the size and CRC-32 of each
server manifest, the step, the trainer states — atomically, then fsyncs the directories. A
directory without ``checkpoint.json`` is a checkpoint that did not finish and is never chosen.

:func:`latest_good` walks the checkpoints newest first and returns the first that verifies
(top manifest, server manifests, every file's size and CRC-32), naming each one it skipped and
why; :func:`prune` keeps the newest K complete ones and deletes older ones (and unfinished ones
older than the newest complete one) only after a new one is committed. A deleted checkpoint is
first renamed to ``.deleting-<name>``, so a crash during the deletion leaves no half checkpoint
that looks like one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from ps_server.checkpoint.files import (
    FileRecord,
    fsync_dir,
    read_manifest_json,
    record_of,
    verify_file,
    write_json_atomic,
)
from ps_server.checkpoint.manifest import MANIFEST_GLOB, CheckpointInfo, read_checkpoint
from ps_server.errors import CheckpointCorruptError, CheckpointError

logger = logging.getLogger(__name__)

TOP_MANIFEST = "checkpoint.json"
"""The job's manifest of one checkpoint (written last: its presence means complete)."""
TOP_FORMAT = "fleetrun-ps-job-checkpoint"
TOP_FORMAT_VERSION = 1
PREFIX = "ckpt-"
_NAME_RE = re.compile(r"^ckpt-(\d{6,})$")
DELETING_PREFIX = ".deleting-"


class Verify(StrEnum):
    """How much :func:`list_checkpoints` / :func:`latest_good` read of each checkpoint."""

    MANIFESTS = "manifests"
    """The top and server manifests, and every file's size (stat only): cheap."""
    FULL = "full"
    """Everything :data:`MANIFESTS` does plus every file's CRC-32 (reads every byte)."""


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (``ckpt-000012``)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"a checkpoint step must be an integer >= 0, got {step!r}")
    return f"{PREFIX}{step:06d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name, None for any other name."""
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointRecord:
    """A committed checkpoint (its ``checkpoint.json``, parsed)."""

    name: str
    directory: Path
    step: int
    kind: str
    mode: str
    created_unix: float
    writers: dict[str, FileRecord]
    """Server manifest file name -> its size and CRC-32."""
    rows: dict[str, int]
    """Rows (sparse) or blocks (dense) per table, over all servers."""
    bytes: int
    """Bytes of shard files."""
    trainer_states: dict[int, Any]
    """The opaque state each trainer passed (rank -> JSON value)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Whatever else the coordinator recorded (a serving export's model config, ...)."""
    graph_tables: dict[str, dict[str, int]] = field(default_factory=dict)
    """Nodes and edges of each graph table, over all servers."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready; the directory as a string)."""
        return {
            "name": self.name,
            "directory": str(self.directory),
            "step": self.step,
            "kind": self.kind,
            "mode": self.mode,
            "created_unix": self.created_unix,
            "writers": {k: v.to_dict() for k, v in self.writers.items()},
            "rows": self.rows,
            "bytes": self.bytes,
            "trainer_states": {str(k): v for k, v in self.trainer_states.items()},
            "extra": self.extra,
            "graph_tables": self.graph_tables,
        }


def _stat_files(info: CheckpointInfo) -> None:
    for rel, record in (info.files or {}).items():
        path = info.directory / rel
        try:
            size = os.path.getsize(path)
        except OSError as err:
            raise CheckpointCorruptError(f"{path}: listed in the manifests but {err}") from err
        if size != record.bytes:
            raise CheckpointCorruptError(
                f"{path}: {size} bytes, the manifest says {record.bytes}: the file is "
                + ("truncated" if size < record.bytes else "too long")
            )


def commit(
    directory: str | os.PathLike,
    step: int,
    *,
    num_writers: int | None = None,
    trainer_states: dict[int, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> CheckpointRecord:
    """Make the checkpoint in ``directory`` complete: check the servers' manifests (all
    ``num_writers`` present, agreeing, every shard of every table written, every file of the
    listed size), then write ``checkpoint.json`` atomically, last. Returns its record."""
    root = Path(directory)
    info = read_checkpoint(root)
    if num_writers is not None and len(info.writers) != num_writers:
        raise CheckpointError(
            f"{root}: {len(info.writers)} server manifest(s) ({', '.join(info.writers)}), "
            f"expected {num_writers}: a server's part is missing"
        )
    _stat_files(info)
    writers = {}
    for p in sorted(root.glob(MANIFEST_GLOB)):
        writers[p.name] = record_of(p)
    states = {str(int(k)): v for k, v in (trainer_states or {}).items()}
    top = {
        "format": TOP_FORMAT,
        "format_version": TOP_FORMAT_VERSION,
        "name": root.name,
        "step": int(step),
        "kind": info.kind,
        "mode": info.mode,
        "created_unix": time.time(),
        "writers": {k: v.to_dict() for k, v in writers.items()},
        "rows": {name: e.rows for name, e in sorted(info.tables.items())},
        "bytes": sum(r.bytes for r in (info.files or {}).values()),
        "trainer_states": states,
        "extra": extra or {},
        "graph_tables": {
            name: {"nodes": g.nodes, "edges": g.edges}
            for name, g in sorted(info.graph_tables.items())
        },
    }
    try:
        json.dumps(top)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"trainer states / extra are not JSON data: {err}") from err
    try:
        write_json_atomic(root / TOP_MANIFEST, top)
        fsync_dir(root.parent)
    except OSError as err:
        raise CheckpointError(f"committing {root} failed: {err}") from err
    logger.info("committed checkpoint %s (step %d, %d bytes)", root, step, top["bytes"])
    return _record(root, top)


def record_from_dict(data: dict[str, Any]) -> CheckpointRecord:
    """The record :meth:`CheckpointRecord.to_dict` gave (e.g. from a server's reply)."""
    return _record(Path(data["directory"]), data)


def _record(root: Path, top: dict[str, Any]) -> CheckpointRecord:
    where = root / TOP_MANIFEST
    try:
        return CheckpointRecord(
            name=root.name,
            directory=root,
            step=int(top["step"]),
            kind=str(top["kind"]),
            mode=str(top["mode"]),
            created_unix=float(top["created_unix"]),
            writers={k: FileRecord.from_dict(v, str(where)) for k, v in top["writers"].items()},
            rows={str(k): int(v) for k, v in top["rows"].items()},
            bytes=int(top["bytes"]),
            trainer_states={int(k): v for k, v in top["trainer_states"].items()},
            extra=dict(top.get("extra") or {}),
            graph_tables={
                str(k): {"nodes": int(v["nodes"]), "edges": int(v["edges"])}
                for k, v in (top.get("graph_tables") or {}).items()
            },
        )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointCorruptError(f"{where}: malformed ({type(err).__name__}: {err})") from err


def read_record(directory: str | os.PathLike) -> CheckpointRecord:
    """The committed record of a checkpoint (CheckpointError if it was never committed)."""
    root = Path(directory)
    path = root / TOP_MANIFEST
    if not path.exists():
        raise CheckpointError(
            f"{root}: incomplete: no {TOP_MANIFEST} (its save did not finish: a server or the "
            "coordinator stopped before the commit)"
        )
    top = read_manifest_json(path, TOP_FORMAT, TOP_FORMAT_VERSION, "job checkpoint manifest")
    return _record(root, top)


def verify(directory: str | os.PathLike, level: Verify = Verify.FULL) -> CheckpointRecord:
    """Check a committed checkpoint: its record, each server manifest against the record, the
    merged manifests, each file's size (and with ``Verify.FULL`` its CRC-32). Raises
    CheckpointError / CheckpointCorruptError naming the first bad file."""
    root = Path(directory)
    record = read_record(root)
    present = sorted(p.name for p in root.glob(MANIFEST_GLOB))
    if present != sorted(record.writers):
        raise CheckpointCorruptError(
            f"{root}: server manifests {present}, the checkpoint lists {sorted(record.writers)}"
        )
    for name, rec in record.writers.items():
        verify_file(root / name, rec)
    info = read_checkpoint(root)
    if level is Verify.FULL:
        for rel, rec in (info.files or {}).items():
            verify_file(root / rel, rec)
    else:
        _stat_files(info)
    return record


@dataclass(frozen=True)
class CheckpointStatus:
    """One numbered directory of a root: whether it is a good checkpoint and why not."""

    name: str
    step: int
    directory: Path
    record: CheckpointRecord | None
    """The verified record; None when the checkpoint is bad."""
    reason: str = ""
    """Why it is bad (empty when good)."""

    @property
    def ok(self) -> bool:
        """Whether it verified."""
        return self.record is not None


def _numbered(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(step_of(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted(((s, p) for s, p in found if s is not None), key=lambda sp: sp[0], reverse=True)


def list_checkpoints(
    root: str | os.PathLike, level: Verify = Verify.MANIFESTS
) -> list[CheckpointStatus]:
    """Every ``ckpt-<step>`` directory of ``root``, newest first, each verified at ``level``."""
    out = []
    for step, path in _numbered(Path(root)):
        try:
            out.append(CheckpointStatus(path.name, step, path, verify(path, level)))
        except CheckpointError as err:
            out.append(CheckpointStatus(path.name, step, path, None, str(err)))
    return out


@dataclass(frozen=True)
class LatestGood:
    """What :func:`latest_good` chose, and what it skipped on the way (newest first)."""

    chosen: CheckpointRecord | None
    skipped: tuple[tuple[str, str], ...] = ()
    """(checkpoint name, reason) of every newer checkpoint that did not verify."""

    @property
    def fell_back(self) -> bool:
        """True when a newer checkpoint was skipped."""
        return bool(self.skipped)

    def describe(self) -> str:
        """One line for a log: what was chosen and why the newer ones were not."""
        chosen = f"{self.chosen.name} (step {self.chosen.step})" if self.chosen else "none"
        if not self.skipped:
            return f"latest good checkpoint: {chosen}"
        why = "; ".join(f"{name}: {reason}" for name, reason in self.skipped)
        return f"latest good checkpoint: {chosen}, falling back past {why}"


def latest_good(root: str | os.PathLike, level: Verify = Verify.FULL) -> LatestGood:
    """The newest checkpoint of ``root`` that verifies at ``level``; each newer one is skipped
    with its reason (logged as a warning and kept in the result). ``chosen`` is None when
    ``root`` holds no good checkpoint."""
    skipped: list[tuple[str, str]] = []
    for _step, path in _numbered(Path(root)):
        try:
            record = verify(path, level)
        except CheckpointError as err:
            logger.warning("checkpoint %s skipped: %s", path, err)
            skipped.append((path.name, str(err)))
            continue
        result = LatestGood(record, tuple(skipped))
        (logger.warning if skipped else logger.info)("%s", result.describe())
        return result
    result = LatestGood(None, tuple(skipped))
    logger.warning("%s: %s", root, result.describe())
    return result


def _delete(path: Path) -> None:
    doomed = path.with_name(DELETING_PREFIX + path.name)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(root: str | os.PathLike, keep: int) -> list[str]:
    """Keep the newest ``keep`` committed checkpoints of ``root`` (0: keep all); delete older
    committed ones, and unfinished ones older than the newest committed one (they can never be
    chosen), plus leftovers of an interrupted deletion. Returns the names deleted."""
    if not isinstance(keep, int) or keep < 0:
        raise CheckpointError(f"keep must be an integer >= 0, got {keep!r}")
    base = Path(root)
    deleted: list[str] = []
    for leftover in base.glob(DELETING_PREFIX + "*") if base.is_dir() else []:
        shutil.rmtree(leftover, ignore_errors=True)
    numbered = _numbered(base)
    committed = [(s, p) for s, p in numbered if (p / TOP_MANIFEST).exists()]
    if not committed:
        return deleted
    newest = committed[0][0]
    doomed = committed[keep:] if keep else []
    doomed += [(s, p) for s, p in numbered if s < newest and not (p / TOP_MANIFEST).exists()]
    for _, path in sorted(doomed):
        _delete(path)
        deleted.append(path.name)
    if deleted:
        fsync_dir(base)
        logger.info("deleted old checkpoints of %s: %s", base, deleted)
    return deleted


__all__ = [
    "PREFIX",
    "TOP_MANIFEST",
    "CheckpointRecord",
    "CheckpointStatus",
    "LatestGood",
    "Verify",
    "checkpoint_name",
    "commit",
    "latest_good",
    "list_checkpoints",
    "prune",
    "read_record",
    "record_from_dict",
    "step_of",
    "verify",
]
