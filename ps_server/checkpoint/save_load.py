"""Checkpoints of parameter-server tables: one binary file per (table, shard) plus a manifest.

Layout of a checkpoint directory (one save per directory)::

    <dir>/manifest.<writer>.json        one per saving server ("server-0", "server-1", ...)
    <dir>/<table>/shard-00007.bin       one per shard (format: ps_server.checkpoint.shard_file)

Each server saves the shards it owns and then writes its own manifest (so N servers can save into
one directory without coordinating): format version, mode, and per table its config (optimizer,
initializer and entry as dicts), dim, state_dim, shard count, the shards written, rows, and the
``end_day`` calls since the previous save. Shard files and manifests are written to a temporary
name and renamed, the manifest last: a manifest lists only complete files.

``load`` merges every manifest of the directory, checks they agree and cover every shard, reads
the files of the shards each target table owns — under any server count, which is how a
checkpoint saved by N servers loads into M — and replaces (``all``) or updates (``delta``) the
table.

Delta checkpoints hold the rows changed since the previous save or load of the same table (a
dirty flag per row), the keys deleted since (shrink, eviction, admission out of the count-filter
store) and the number of ``end_day`` calls since, which the loader replays on the rows the delta
does not carry. Loading a full checkpoint and then its deltas in order restores the state at the
last delta. A save holds the locks of its tables for its duration: pulls and pushes wait.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps_server.checkpoint.shard_file import FORMAT_VERSION, read_shard, write_shard
from ps_server.config import (
    TableConfig,
    config_diff,
    config_from_dict,
    config_to_dict,
)
from ps_server.core.factory import make_table
from ps_server.core.table import Table
from ps_server.errors import CheckpointCorruptError, CheckpointError, CheckpointVersionError

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = "fleetrun-ps-checkpoint"
MODES = ("all", "delta")
_WRITER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}$")


def shard_path(directory: str | os.PathLike, table: str, shard: int) -> Path:
    """Where the file of ``shard`` of ``table`` lives in a checkpoint directory."""
    return Path(directory) / table / f"shard-{shard:05d}.bin"


def _as_table_list(tables: Iterable[Table] | Mapping[str, Table]) -> list[Table]:
    items = list(tables.values()) if isinstance(tables, Mapping) else list(tables)
    names = [t.name for t in items]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise CheckpointError(f"tables {dup} given more than once")
    return sorted(items, key=lambda t: t.name)


def save(
    directory: str | os.PathLike,
    tables: Iterable[Table] | Mapping[str, Table],
    mode: str = "all",
    writer: str = "server-0",
) -> dict[str, Any]:
    """Save ``tables`` (this server's parts) into ``directory``; returns the manifest written.

    ``mode``: ``"all"`` (every row) or ``"delta"`` (changes since the previous save/load).
    ``writer`` names this server's manifest (``manifest.<writer>.json``); servers saving into one
    directory need distinct writers (e.g. ``f"server-{index}"``).
    """
    if mode not in MODES:
        raise CheckpointError(f"mode must be 'all' or 'delta', got {mode!r}")
    if not _WRITER_RE.match(writer):
        raise CheckpointError(
            f"writer must be 1-64 of letters, digits, '_', '.', '-', got {writer!r}"
        )
    items = _as_table_list(tables)
    root = Path(directory)
    delta = mode == "delta"
    t0 = time.monotonic()
    entries: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        for t in items:  # sorted by name: a fixed lock order
            stack.enter_context(t.lock)
        try:
            for t in items:
                (root / t.name).mkdir(parents=True, exist_ok=True)
                payloads = t.export_shards(delta)
                rows = written = 0
                for shard, payload in sorted(payloads.items()):
                    written += write_shard(
                        shard_path(root, t.name, shard),
                        payload,
                        mode,
                        getattr(t, "dim", 0),
                        t.state_dim,
                    )
                    rows += len(payload.blocks) if t.KIND == "dense" else int(payload.keys.shape[0])
                entries[t.name] = {
                    "kind": t.KIND,
                    "config": config_to_dict(t.config),
                    "dim": getattr(t, "dim", 0),
                    "state_dim": t.state_dim,
                    "num_shards": t.config.num_shards,
                    "shards": sorted(payloads),
                    "rows": rows,
                    "bytes": written,
                    "days_since_last_save": t.days_since_save,
                }
            manifest = {
                "format": MANIFEST_FORMAT,
                "format_version": FORMAT_VERSION,
                "mode": mode,
                "writer": writer,
                "created_unix": time.time(),
                "tables": entries,
            }
            _write_json(root / f"manifest.{writer}.json", manifest)
        except OSError as err:
            raise CheckpointError(f"saving to {root} failed: {err}") from err
        for t in items:
            t.mark_saved()
    logger.info(
        "saved %s checkpoint of %d table(s) to %s in %.2fs",
        mode,
        len(items),
        root,
        time.monotonic() - t0,
    )
    return manifest


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint directory holds (every manifest merged and checked)."""

    directory: Path
    mode: str
    writers: tuple[str, ...]
    tables: dict[str, TableEntry]


def read_checkpoint(directory: str | os.PathLike) -> CheckpointInfo:
    """Merge and check the manifests of ``directory`` (agreeing configs, modes, versions; every
    shard of every table written exactly once)."""
    root = Path(directory)
    paths = sorted(root.glob("manifest.*.json"))
    if not paths:
        raise CheckpointError(
            f"{root}: no manifest.*.json: not a checkpoint, or its save did not finish"
        )
    manifests = []
    for p in paths:
        try:
            m = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CheckpointCorruptError(f"{p}: unreadable manifest: {err}") from err
        if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
            raise CheckpointCorruptError(f"{p}: not a fleetrun parameter-server manifest")
        if m.get("format_version") != FORMAT_VERSION:
            raise CheckpointVersionError(
                f"{p}: checkpoint format version {m.get('format_version')!r}, this fleetrun reads "
                f"version {FORMAT_VERSION}; load it with the fleetrun version that wrote it"
            )
        manifests.append((p, m))
    modes = {m["mode"] for _, m in manifests}
    if len(modes) != 1 or not modes <= set(MODES):
        raise CheckpointError(
            f"{root}: manifests disagree on the mode ({sorted(modes)}): the "
            "directory mixes saves; use one directory per save"
        )
    merged: dict[str, dict[str, Any]] = {}
    owner: dict[tuple[str, int], str] = {}
    for p, m in manifests:
        for name, e in m["tables"].items():
            cur = merged.setdefault(name, {**e, "shards": [], "rows": 0, "first": p.name})
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
        )
    writers = tuple(str(m.get("writer")) for _, m in manifests)
    return CheckpointInfo(root, modes.pop(), writers, tables)


def _check_compatible(root: Path, table: Table, entry: TableEntry) -> None:
    cfg = table.config
    problems = []
    if entry.kind != table.KIND:
        problems.append(f"kind {entry.kind} (checkpoint) vs {table.KIND} (table)")
    else:
        if getattr(table, "dim", 0) != entry.dim:
            problems.append(f"dim {entry.dim} (checkpoint) vs {getattr(table, 'dim', 0)} (table)")
        if cfg.num_shards != entry.config.num_shards:
            problems.append(
                f"num_shards {entry.config.num_shards} (checkpoint) vs {cfg.num_shards}"
            )
        if (
            type(cfg.optimizer) is not type(entry.config.optimizer)
            or table.state_dim != entry.state_dim
        ):
            problems.append(
                f"optimizer {entry.config.optimizer.TYPE!r} (checkpoint) vs "
                f"{cfg.optimizer.TYPE!r} (table): the optimizer state differs"
            )
    if problems:
        raise CheckpointError(
            f"{root}: table {table.name!r} cannot load this checkpoint: " + "; ".join(problems)
        )
    if entry.config != cfg:
        logger.info(
            "table %r loads a checkpoint saved with another config: %s",
            table.name,
            "; ".join(config_diff(config_to_dict(entry.config), config_to_dict(cfg))),
        )


def load(
    directory: str | os.PathLike, tables: Iterable[Table] | Mapping[str, Table]
) -> dict[str, int]:
    """Load the shards each of ``tables`` owns from ``directory``; returns rows read per table.

    A full checkpoint replaces the tables' contents; a delta is applied on top of their current
    state (which must be the state of the save the delta follows). Every shard file is read and
    verified before any of the tables changes.
    """
    info = read_checkpoint(directory)
    delta = info.mode == "delta"
    items = _as_table_list(tables)
    staged = []
    for t in items:  # read and verify everything before any table changes
        entry = info.tables.get(t.name)
        if entry is None:
            raise CheckpointError(
                f"{info.directory}: no table {t.name!r} in this checkpoint; it "
                f"holds {sorted(info.tables)}"
            )
        _check_compatible(info.directory, t, entry)
        payloads = []
        for shard in t.shards:
            path = shard_path(info.directory, t.name, shard)
            head, payload = read_shard(path)
            expect = (entry.kind, info.mode, shard, entry.dim, entry.state_dim)
            got = (head.kind, head.mode, head.shard, head.dim, head.state_dim)
            if got != expect:
                raise CheckpointCorruptError(
                    f"{path}: header (kind, mode, shard, dim, state_dim) = "
                    f"{got}, the manifest says {expect}"
                )
            payloads.append(payload)
        staged.append((t, entry, payloads))
    result = {}
    for t, entry, payloads in staged:
        with t.lock:
            if delta:
                t.replay_end_days(entry.days_since_last_save)
            else:
                t.clear()
            result[t.name] = sum(t.import_shard(p, delta) for p in payloads)
            t.mark_saved()
        cap = getattr(t.config, "max_capacity", None)
        if cap is not None and t.num_rows > cap:
            logger.warning(
                "table %r holds %d rows after loading, above max_capacity=%d: the next "
                "batch that creates rows evicts the excess",
                t.name,
                t.num_rows,
                cap,
            )
    logger.info("loaded %s checkpoint %s: %s", info.mode, info.directory, result)
    return result


def create_tables(
    directory: str | os.PathLike, server_index: int = 0, num_servers: int = 1
) -> dict[str, Table]:
    """Empty tables, configured as in the checkpoint, for server ``server_index`` of
    ``num_servers`` (any count: the shards are re-spread). Follow with :func:`load`."""
    info = read_checkpoint(directory)
    return {
        name: make_table(e.config, server_index, num_servers)
        for name, e in sorted(info.tables.items())
    }


__all__ = [
    "CheckpointInfo",
    "TableEntry",
    "create_tables",
    "load",
    "read_checkpoint",
    "save",
    "shard_path",
]
