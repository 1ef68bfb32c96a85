"""The per-server manifests of a checkpoint directory: what each server wrote, and reading them
back merged and checked.

Layout of one checkpoint (or serving export) directory::

    <dir>/manifest.<writer>.json        one per saving server ("server-0", "server-1", ...)
    <dir>/<table>/shard-00007.bin       one per shard (format: ps_server.checkpoint.shard_file)
    <dir>/<table>/rocksdb-00000/        SSD tables: one server's cold rows, a RocksDB checkpoint
    <dir>/graphs/<graph table>/part-00001-of-00002.npz, config.json   a graph table's parts

A server writes its shard files first (each atomically), fsyncs their directories, then its own
manifest, atomically: a manifest lists only complete files. It holds the format version, the
kind (``checkpoint``, or ``serving`` for a serving export), the mode (``all`` / ``delta``), per
table its config (optimizer, initializer and entry as dicts), dim, state_dim, shard count, the
shards written, rows, the ``end_day`` calls since the previous save, and for SSD tables
the RocksDB checkpoints of their cold rows (``cold``: :mod:`ps_server.checkpoint.ssd_files`);
and per file (path
relative to the directory) its size and CRC-32 (:class:`~ps_server.checkpoint.files.FileRecord`;
manifests written by earlier fleetrun versions have no ``files``: their shard files are then
checked by their own header and payload CRCs only). A server holding graph tables lists them
under ``graph_tables`` (config, its part index, the number of parts, nodes, edges) and their
files under ``files``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ps_server.checkpoint.files import FileRecord, read_manifest_json
from ps_server.checkpoint.shard_file import FORMAT_VERSION
from ps_server.config import GraphTableConfig, TableConfig, config_diff, config_from_dict
from ps_server.errors import CheckpointCorruptError, CheckpointError

MANIFEST_FORMAT = "fleetrun-ps-checkpoint"
MODES = ("all", "delta")
KINDS = ("checkpoint", "serving")
"""``checkpoint``: everything a server needs to resume (optimizer state, count-filter keys);
``serving``: a serving export (rows with count >= min_show, values and counts only)."""
MANIFEST_GLOB = "manifest.*.json"
GRAPHS_DIR = "graphs"
"""Subdirectory of a checkpoint holding its graph tables' parts."""


def shard_path(directory: str | os.PathLike, table: str, shard: int) -> Path:
    """Where the file of ``shard`` of ``table`` lives in a checkpoint directory."""
    return Path(directory) / table / f"shard-{shard:05d}.bin"


def shard_relpath(table: str, shard: int) -> str:
    """The key of a shard file in a manifest's ``files`` (POSIX path relative to the dir)."""
    return f"{table}/shard-{shard:05d}.bin"


def manifest_path(directory: str | os.PathLike, writer: str) -> Path:
    """The manifest of ``writer`` in a checkpoint directory."""
    return Path(directory) / f"manifest.{writer}.json"


@dataclass(frozen=True)
class TableEntry:
    """One table of a checkpoint, merged over the manifests of all writers."""

    kind: str
    config: TableConfig
    dim: int
    state_dim: int
    shards: tuple[int, ...]
    days_since_last_save: int
    rows: int
    cold: tuple[dict[str, Any], ...] = ()
    """SSD tables: each saving server's cold rows as a RocksDB checkpoint
    (:mod:`ps_server.checkpoint.ssd_files`); empty when every row is in the shard files."""


@dataclass(frozen=True)
class GraphEntry:
    """One graph table of a checkpoint, merged over the manifests of all writers."""

    config: GraphTableConfig
    parts: int
    """Servers that saved it (one part each)."""
    nodes: int
    edges: int


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint directory holds (every manifest merged and checked)."""

    directory: Path
    mode: str
    writers: tuple[str, ...]
    tables: dict[str, TableEntry]
    kind: str = "checkpoint"
    files: dict[str, FileRecord] | None = None
    """Size and CRC-32 per file (relative path); None for manifests that carry none."""
    graph_tables: dict[str, GraphEntry] = field(default_factory=dict)
    """The graph tables, by name."""

    def record(self, table: str, shard: int) -> FileRecord | None:
        """The manifest's record of a shard file (None: the manifest has no file records)."""
        if self.files is None:
            return None
        record = self.files.get(shard_relpath(table, shard))
        if record is None:
            raise CheckpointCorruptError(
                f"{shard_path(self.directory, table, shard)}: not listed in the manifests"
            )
        return record


def _read_manifest(p: Path) -> dict[str, Any]:
    return read_manifest_json(p, MANIFEST_FORMAT, FORMAT_VERSION, "parameter-server manifest")


def _one(root: Path, manifests: list[tuple[Path, dict[str, Any]]], key: str, default: str) -> str:
    values = {m.get(key, default) for _, m in manifests}
    if len(values) != 1:
        raise CheckpointError(
            f"{root}: manifests disagree on the {key} ({sorted(values)}): the directory mixes "
            "saves; use one directory per save"
        )
    return values.pop()


def _merge_tables(
    root: Path, manifests: list[tuple[Path, dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    owner: dict[tuple[str, int], str] = {}
    for p, m in manifests:
        for name, e in m["tables"].items():
            cur = merged.setdefault(
                name, {**e, "shards": [], "rows": 0, "first": p.name, "cold": []}
            )
            for key in ("kind", "config", "dim", "state_dim", "num_shards", "days_since_last_save"):
                if cur[key] != e[key]:
                    diff = config_diff(cur["config"], e["config"]) if key == "config" else []
                    raise CheckpointError(
                        f"{root}: table {name!r}: {p.name} and {cur['first']} disagree on {key} "
                        f"({cur[key] if key != 'config' else diff} vs "
                        f"{e[key] if key != 'config' else ''}): the directory mixes saves"
                    )
            for s in e["shards"]:
                if (name, s) in owner:
                    raise CheckpointError(
                        f"{root}: table {name!r} shard {s} written by both "
                        f"{owner[(name, s)]} and {p.name}: the directory mixes saves"
                    )
                owner[(name, s)] = p.name
            cur["shards"].extend(e["shards"])
            cur["rows"] += e["rows"]
            cur["cold"].extend(e.get("cold") or [])
    return merged


def _merge_graphs(
    root: Path, manifests: list[tuple[Path, dict[str, Any]]]
) -> dict[str, GraphEntry]:
    merged: dict[str, dict[str, Any]] = {}
    for p, m in manifests:
        for name, e in (m.get("graph_tables") or {}).items():
            try:
                cfg, part, parts = e["config"], int(e["part"]), int(e["parts"])
                nodes, edges = int(e["nodes"]), int(e["edges"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointCorruptError(
                    f"{p}: malformed graph_tables[{name!r}] ({type(err).__name__}: {err})"
                ) from None
            cur = merged.setdefault(
                name,
                {"config": cfg, "parts": parts, "seen": {}, "nodes": 0, "edges": 0, "first": p},
            )
            if cur["config"] != cfg or cur["parts"] != parts:
                raise CheckpointError(
                    f"{root}: graph table {name!r}: {p.name} and {cur['first'].name} disagree on "
                    "its config or its number of parts: the directory mixes saves"
                )
            if part in cur["seen"]:
                raise CheckpointError(
                    f"{root}: graph table {name!r} part {part} written by both "
                    f"{cur['seen'][part]} and {p.name}: the directory mixes saves"
                )
            cur["seen"][part] = p.name
            cur["nodes"] += nodes
            cur["edges"] += edges
    out = {}
    for name, cur in merged.items():
        missing = sorted(set(range(cur["parts"])) - set(cur["seen"]))
        if missing:
            raise CheckpointError(
                f"{root}: graph table {name!r} is incomplete: parts {missing} of {cur['parts']} "
                "missing (did a server's save fail?)"
            )
        try:
            config = GraphTableConfig.from_dict(cur["config"], f"{name}.config")
        except (ValueError, TypeError) as err:
            raise CheckpointCorruptError(f"{root}: graph table {name!r}: {err}") from None
        out[name] = GraphEntry(config, cur["parts"], cur["nodes"], cur["edges"])
    return out


def read_checkpoint(directory: str | os.PathLike) -> CheckpointInfo:
    """Merge and check the manifests of ``directory`` (agreeing configs, kinds, modes,
    versions; every shard of every table written exactly once)."""
    root = Path(directory)
    paths = sorted(root.glob(MANIFEST_GLOB))
    if not paths:
        raise CheckpointError(
            f"{root}: no manifest.*.json: not a checkpoint, or its save did not finish"
        )
    manifests = [(p, _read_manifest(p)) for p in paths]
    mode = _one(root, manifests, "mode", "all")
    kind = _one(root, manifests, "kind", "checkpoint")
    if mode not in MODES or kind not in KINDS:
        raise CheckpointCorruptError(f"{root}: unknown mode {mode!r} or kind {kind!r}")
    merged = _merge_tables(root, manifests)
    tables = {}
    for name, e in merged.items():
        missing = sorted(set(range(e["num_shards"])) - set(e["shards"]))
        if missing:
            shown = missing[:20] + (["..."] if len(missing) > 20 else [])
            raise CheckpointError(
                f"{root}: table {name!r} is incomplete: {len(missing)} of {e['num_shards']} shards "
                f"missing ({shown}); writers present: {[p.name for p, _ in manifests]}. Did a "
                "server's save fail?"
            )
        tables[name] = TableEntry(
            e["kind"],
            config_from_dict(e["config"], f"{name}.config"),
            e["dim"],
            e["state_dim"],
            tuple(sorted(e["shards"])),
            e["days_since_last_save"],
            e["rows"],
            tuple(e["cold"]),
        )
    files: dict[str, FileRecord] | None = {}
    for p, m in manifests:
        if "files" not in m or files is None:
            files = None  # an older manifest: its files are checked by their own CRCs only
            continue
        for rel, rec in m["files"].items():
            files[rel] = FileRecord.from_dict(rec, f"{p}: files[{rel!r}]")
    writers = tuple(str(m.get("writer")) for _, m in manifests)
    graphs = _merge_graphs(root, manifests)
    return CheckpointInfo(root, mode, writers, tables, kind, files, graphs)


__all__ = [
    "GRAPHS_DIR",
    "KINDS",
    "MANIFEST_FORMAT",
    "MANIFEST_GLOB",
    "MODES",
    "CheckpointInfo",
    "GraphEntry",
    "TableEntry",
    "manifest_path",
    "read_checkpoint",
    "shard_path",
    "shard_relpath",
]
