"""Saving and loading parameter-server tables: a snapshot under the tables' locks, written to
one checkpoint directory (layout: :mod:`ps_server.checkpoint.manifest`), and loaded back under
any number of servers.

Saving is two steps so that training waits only for a copy (``bench/bench_ps_checkpoint.py``):

1. :func:`take_snapshot` holds the locks of the tables (in name order) while each copies its
   rows (:meth:`Table.snapshot <ps_server.core.table.Table.snapshot>`: a memcpy of the row
   arrays, ~30 ms per million rows of dim 8 with Adagrad) and resets the change log the save
   consumes: pulls and pushes wait only this long;
2. :func:`write_snapshot` splits the copies per shard, writes every shard file atomically (temp
   file, fsync, rename), fsyncs the directories, and writes this server's manifest last, with
   every file's size and CRC-32. It needs no lock: a server runs it on a background thread
   (:mod:`ps_server.checkpoint.writer`) while training goes on.

:func:`save` does both in the caller's thread. Which changes a save consumes: ``mode="all"``
and ``"delta"`` saves use the SAVE change log (a delta holds the rows changed since the
previous save or load of the same table, the keys deleted since, and the ``end_day`` calls
since, which the loader replays on the rows the delta does not carry); a recovery checkpoint
(``log=None``) consumes none, so it never breaks a chain of delta saves; serving exports
(``kind="serving"``) use their own EXPORT change log.

:func:`load` merges every manifest of the directory, checks they agree and cover every shard,
reads the files of the shards each target table owns — under any server count, which is how a
checkpoint saved by N servers loads into M — verifying each against the manifest's size and
CRC-32 and its own header and payload CRCs, and only then replaces (``all``) or updates
(``delta``) the tables.

Graph tables (:class:`~ps_server.core.graph_table.GraphTable`) ride along: :func:`take_snapshot`
holds their locks with the other tables' (one cut) and keeps references to their arrays
(:func:`~ps_server.core.graph_checkpoint.snapshot_part`), :func:`write_snapshot` writes each as
``graphs/<table>/part-<i>-of-<n>.npz`` plus its ``config.json`` (listed with size and CRC-32 in
the manifest's ``files``, and under ``graph_tables``), and :func:`load_graphs` builds this
server's share of each — under any server count — for the caller to swap in. A graph part is
always whole (a delta save writes the whole graph too: graph edits are rare bulk loads); a
serving export holds no graph tables.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ps_server.checkpoint.files import FileRecord, fsync_dir, verify_file, write_json_atomic
from ps_server.checkpoint.manifest import (
    GRAPHS_DIR,
    KINDS,
    MANIFEST_FORMAT,
    MODES,
    CheckpointInfo,
    TableEntry,
    manifest_path,
    read_checkpoint,
    shard_path,
    shard_relpath,
)
from ps_server.checkpoint.shard_file import FORMAT_VERSION, read_shard, write_shard
from ps_server.checkpoint.ssd_files import ColdRows, adopt_files, read_keyfilter, write_cold
from ps_server.config import config_diff, config_to_dict
from ps_server.core.factory import make_table
from ps_server.core.graph_checkpoint import (
    GraphPart,
    config_data,
    load_table,
    merge_pending,
    snapshot_part,
    write_part,
)
from ps_server.core.graph_table import GraphTable
from ps_server.core.shard_data import SparseShardData
from ps_server.core.ssd_import import adopted, import_hot
from ps_server.core.ssd_snapshot import ColdCut, NativeSnapshot, with_cold
from ps_server.core.ssd_table import EVICT_LOW, SsdSparseTable
from ps_server.core.table import ChangeLog, Table, TableSnapshot
from ps_server.errors import CheckpointCorruptError, CheckpointError

logger = logging.getLogger(__name__)

_WRITER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}$")


def _as_table_list(tables: Iterable[Table] | Mapping[str, Table]) -> list[Table]:
    items = list(tables.values()) if isinstance(tables, Mapping) else list(tables)
    names = [t.name for t in items]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise CheckpointError(f"tables {dup} given more than once")
    return sorted(items, key=lambda t: t.name)


def check_mode(mode: str) -> None:
    """CheckpointError unless ``mode`` is ``"all"`` or ``"delta"``."""
    if mode not in MODES:
        raise CheckpointError(f"mode must be 'all' or 'delta', got {mode!r}")


def check_writer(writer: str) -> None:
    """CheckpointError unless ``writer`` can name a manifest file."""
    if not _WRITER_RE.match(writer):
        raise CheckpointError(
            f"writer must be 1-64 of letters, digits, '_', '.', '-', got {writer!r}"
        )


@dataclass(frozen=True)
class Snapshot:
    """The tables of one server at one instant (:func:`take_snapshot`)."""

    tables: list[TableSnapshot]
    mode: str
    seconds: float
    """How long the tables' locks were held (what training waited)."""
    log: ChangeLog | None = None
    """The change log the snapshot consumed."""
    sources: tuple[Table, ...] = ()
    """The tables, in the order of ``tables``."""
    graphs: tuple[GraphPart, ...] = ()
    """The graph tables' parts (references to their arrays, not copies)."""

    @property
    def nbytes(self) -> int:
        """Memory the copies hold until they are written."""
        return sum(t.nbytes for t in self.tables)

    def requeue(self) -> None:
        """The snapshot was not written: give its changes back to the tables' change log, so
        the next delta still carries them."""
        if self.log is None:
            return
        for table, snap in zip(self.sources, self.tables, strict=True):
            table.requeue_changes(self.log, snap)


def take_snapshot(
    tables: Iterable[Table] | Mapping[str, Table],
    mode: str = "all",
    log: ChangeLog | None = ChangeLog.SAVE,
    graphs: Mapping[str, GraphTable] | None = None,
) -> Snapshot:
    """Copy ``tables`` under their locks (all held at once, taken in name order: one consistent
    instant across the tables) and reset change log ``log`` (None: a recovery checkpoint,
    which consumes no changes; ``mode="delta"`` needs a log). ``graphs``: graph tables, locked
    with them and kept as whole parts."""
    check_mode(mode)
    delta = mode == "delta"
    if delta and log is None:
        raise CheckpointError("a delta snapshot needs a change log (SAVE or EXPORT)")
    items = _as_table_list(tables)
    graph_items = [graphs[n] for n in sorted(graphs or {})]
    for g in graph_items:  # the CSR rebuild of new edges, before the other tables are locked
        merge_pending(g)
    with contextlib.ExitStack() as stack:
        for t in items:  # sorted by name: a fixed lock order
            stack.enter_context(t.lock)
        for g in graph_items:
            stack.enter_context(g._lock)
        t0 = time.perf_counter()
        snaps = [t.snapshot(delta, log) for t in items]
        parts = tuple(snapshot_part(g) for g in graph_items)
        seconds = time.perf_counter() - t0
    return Snapshot(snaps, mode, seconds, log, tuple(items), parts)


def serving_payload(payload: SparseShardData, min_show: int) -> SparseShardData:
    """A shard's rows as a serving export keeps them: count >= ``min_show``, values and counts
    (no optimizer state, no count-filter keys); a delta keeps its deleted keys."""
    keep = payload.count >= min_show
    n = int(keep.sum())
    none_i64 = np.zeros(0, np.int64)
    return SparseShardData(
        shard=payload.shard,
        keys=payload.keys[keep],
        values=payload.values[keep],
        state=np.zeros((n, 0), np.float32),
        count=payload.count[keep],
        unseen_days=payload.unseen_days[keep],
        flags=payload.flags[keep],
        pending_keys=none_i64,
        pending_count=np.zeros(0, np.uint32),
        pending_unseen_days=np.zeros(0, np.uint16),
        pending_flags=np.zeros(0, np.uint8),
        deleted_keys=payload.deleted_keys,
        deleted_pending_keys=none_i64,
    )


def write_snapshot(
    directory: str | os.PathLike,
    snapshot: Snapshot,
    writer: str = "server-0",
    kind: str = "checkpoint",
    min_show: int = 0,
) -> dict[str, Any]:
    """Write ``snapshot`` into ``directory``: shard files (atomic), directories fsynced, then
    this writer's manifest (``manifest.<writer>.json``) last. ``kind="serving"`` writes a
    serving export (sparse rows with count >= ``min_show``, no optimizer state). Returns the
    manifest; CheckpointError on an I/O failure."""
    check_writer(writer)
    if kind not in KINDS:
        raise CheckpointError(f"kind must be one of {KINDS}, got {kind!r}")
    root = Path(directory)
    t0 = time.monotonic()
    entries: dict[str, Any] = {}
    files: dict[str, Any] = {}
    try:
        root.mkdir(parents=True, exist_ok=True)
        for snap in snapshot.tables:
            meta = snap.meta
            (root / meta.name).mkdir(exist_ok=True)
            # an SSD table's checkpoint: memory rows in shard files, cold rows as RocksDB files
            native = kind == "checkpoint" and isinstance(snap, NativeSnapshot)
            payloads = snap.hot_shards() if native else snap.export_shards()
            serving = kind == "serving" and meta.kind == "sparse"
            state_dim = 0 if serving else meta.state_dim
            rows = written = 0
            for shard in sorted(payloads):  # one at a time: a payload may be read on access
                payload = payloads[shard]
                if serving:
                    payload = serving_payload(payload, min_show)
                record = write_shard(
                    shard_path(root, meta.name, shard), payload, snapshot.mode, meta.dim, state_dim
                )
                files[shard_relpath(meta.name, shard)] = record.to_dict()
                written += record.bytes
                rows += len(payload.blocks) if meta.kind == "dense" else int(payload.keys.shape[0])
            del payloads
            cold = []
            if native:
                item, cold_files, cold_bytes = write_cold(root, snap)
                files.update(cold_files)
                written += cold_bytes
                rows += int(item["rows"])
                cold.append(item)
            fsync_dir(root / meta.name)
            entries[meta.name] = {
                "kind": meta.kind,
                "config": config_to_dict(meta.config),
                "dim": meta.dim,
                "state_dim": state_dim,
                "num_shards": meta.config.num_shards,
                "shards": list(meta.shards),
                "rows": rows,
                "bytes": written,
                "days_since_last_save": meta.days_since_save,
            }
            if cold:
                entries[meta.name]["cold"] = cold
        graph_entries = {}
        if kind == "checkpoint":
            for part in snapshot.graphs:
                graph_entries[part.name] = _write_graph(root, part, files)
        manifest = {
            "format": MANIFEST_FORMAT,
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "mode": snapshot.mode,
            "writer": writer,
            "created_unix": time.time(),
            "snapshot_s": round(snapshot.seconds, 6),
            "tables": entries,
            "files": files,
        }
        if graph_entries:
            manifest["graph_tables"] = graph_entries
        if kind == "serving":
            manifest["min_show"] = int(min_show)
        fsync_dir(root)
        write_json_atomic(manifest_path(root, writer), manifest)
        fsync_dir(root.parent)  # the directory's own entry
    except OSError as err:
        raise CheckpointError(f"saving to {root} failed: {err}") from err
    finally:
        for snap in snapshot.tables:  # staged RocksDB checkpoints: linked or copied by now
            if isinstance(snap, NativeSnapshot):
                snap.release()
    logger.info(
        "wrote %s %s of %d table(s) to %s in %.2fs (tables locked %.3fs)",
        snapshot.mode,
        kind,
        len(snapshot.tables),
        root,
        time.monotonic() - t0,
        snapshot.seconds,
    )
    return manifest


def _write_graph(root: Path, part: GraphPart, files: dict[str, Any]) -> dict[str, Any]:
    """Write one graph part under ``root/graphs/``, add its files' records to ``files``;
    returns its manifest entry."""
    base = root / GRAPHS_DIR
    for rel, (size, crc) in write_part(part, base).items():
        files[f"{GRAPHS_DIR}/{rel}"] = FileRecord(size, crc).to_dict()
    fsync_dir(base / part.name)
    fsync_dir(base)
    return {
        "config": config_data(part.config),
        "part": part.server_index,
        "parts": part.num_servers,
        "nodes": part.nodes,
        "edges": part.edges,
    }


def save(
    directory: str | os.PathLike,
    tables: Iterable[Table] | Mapping[str, Table],
    mode: str = "all",
    writer: str = "server-0",
    graphs: Mapping[str, GraphTable] | None = None,
) -> dict[str, Any]:
    """Save ``tables`` (this server's parts) into ``directory``; returns the manifest written.

    ``mode``: ``"all"`` (every row) or ``"delta"`` (changes since the previous save/load).
    ``writer`` names this server's manifest (``manifest.<writer>.json``); servers saving into one
    directory need distinct writers (e.g. ``f"server-{index}"``). The tables are locked only
    while they are copied; the files are written after. If writing fails, the next delta save
    cannot follow this one: save ``mode="all"`` then.
    """
    check_mode(mode)
    check_writer(writer)
    snapshot = take_snapshot(tables, mode, ChangeLog.SAVE, graphs)
    try:
        return write_snapshot(directory, snapshot, writer)
    except BaseException:
        snapshot.requeue()
        raise


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
    directory: str | os.PathLike,
    tables: Iterable[Table] | Mapping[str, Table],
    kind: str = "checkpoint",
) -> dict[str, int]:
    """Load the shards each of ``tables`` owns from ``directory``; returns rows read per table.

    A full checkpoint replaces the tables' contents; a delta is applied on top of their current
    state (which must be the state of the save the delta follows). Every shard file is read and
    verified (CheckpointCorruptError naming the file) before any of the tables changes. A table
    larger than memory (``streams_load``: SSD tables) is verified the same way but keeps no
    shard in memory: its shards are read again one at a time as they are imported (a file
    changed between the two reads still fails its CRC, after the shards before it).
    ``kind``: what the directory must hold (``"serving"`` for a serving export).
    """
    info = read_checkpoint(directory)
    if info.kind != kind:
        raise CheckpointError(
            f"{info.directory} is a {info.kind} directory, not a {kind}: "
            + (
                "serve it with `python -m ps_server --serve DIR`"
                if info.kind == "serving"
                else "load it with PSServer.load_checkpoint / `--load DIR`"
            )
        )
    delta = info.mode == "delta"
    items = _as_table_list(tables)
    staged = []
    try:
        for t in items:  # read and verify everything before any table changes
            staged.append(_stage(info, t))
        result = {}
        for t, entry, payloads, cold, adopt in staged:
            with t.lock:
                if delta:
                    t.replay_end_days(entry.days_since_last_save)
                else:
                    t.clear()
                result[t.name] = _apply(info, t, entry, payloads, cold, adopt, delta)
                t.mark_saved()
            _warn_capacity(t)
    finally:
        for _t, _e, _p, cold, _a in staged:
            cold.close()
    logger.info("loaded %s checkpoint %s: %s", info.mode, info.directory, result)
    return result


def _stage(info: CheckpointInfo, t: Table) -> tuple[Any, ...]:
    """Read and verify what table ``t`` loads (nothing changes yet): (table, entry, payloads
    or row counts, the cold rows of an SSD table's checkpoint, the RocksDB checkpoint ``t``
    adopts whole or None)."""
    entry = info.tables.get(t.name)
    if entry is None:
        raise CheckpointError(
            f"{info.directory}: no table {t.name!r} in this checkpoint; it "
            f"holds {sorted(info.tables)}"
        )
    _check_compatible(info.directory, t, entry)
    streamed = getattr(t, "streams_load", False)
    cold = ColdRows.of(info, entry, t.name)
    # the same shards as a saving server: its RocksDB files become the tier (no row read)
    adopt = cold.adoptable(t.shards) if streamed and info.mode == "all" else None
    cold.verify([adopt] if adopt is not None else cold.touching(t.shards))
    payloads: list[Any] = []
    for shard in t.shards:
        payload = _read_checked(info, entry, t.name, shard)
        # a table larger than memory keeps only the row count now and reads again below
        if streamed:
            payloads.append(int(payload.keys.shape[0]))
        else:
            payloads.append(with_cold(payload, cold.rows(shard)))
    if streamed and adopt is None and payloads:
        payloads[0] += cold.count(t.shards)  # sizes the key filter (an upper bound)
    return t, entry, payloads, cold, adopt


def _apply(
    info: CheckpointInfo,
    t: Table,
    entry: TableEntry,
    payloads: list[Any],
    cold: ColdRows,
    adopt: ColdCut | None,
    delta: bool,
) -> int:
    """Import what :func:`_stage` read into ``t`` (its lock held, cleared for a full load);
    returns the rows read."""
    if adopt is not None:
        assert isinstance(t, SsdSparseTable)
        hot_rows, keep = sum(payloads), int(t.cache_rows * EVICT_LOW)
        kf = read_keyfilter(adopt)
        with adopted(t, adopt_files(adopt), adopt.to_dict(), hot_rows, kf):  # type: ignore[arg-type]
            hot = sum(import_hot(t, _read_checked(info, entry, t.name, s), keep) for s in t.shards)
        return hot + adopt.rows
    if isinstance(payloads[0] if payloads else None, int):
        with t.bulk_load(sum(payloads)):
            return sum(
                t.import_shard(
                    with_cold(_read_checked(info, entry, t.name, s), cold.rows(s)), delta
                )
                for s in t.shards
            )
    return sum(t.import_shard(p, delta) for p in payloads)


def _warn_capacity(t: Table) -> None:
    """Warn when a loaded table holds more rows than its ``max_capacity``."""
    cap = getattr(t.config, "max_capacity", None)
    if cap is not None and t.num_rows > cap:
        logger.warning(
            "table %r holds %d rows after loading, above max_capacity=%d: the next "
            "batch that creates rows evicts the excess",
            t.name,
            t.num_rows,
            cap,
        )


def _read_checked(info: CheckpointInfo, entry: TableEntry, table: str, shard: int) -> Any:
    """Shard ``shard`` of ``table``, verified against the manifest and its own header."""
    path = shard_path(info.directory, table, shard)
    head, payload = read_shard(path, info.record(table, shard))
    expect = (entry.kind, info.mode, shard, entry.dim, entry.state_dim)
    got = (head.kind, head.mode, head.shard, head.dim, head.state_dim)
    if got != expect:
        raise CheckpointCorruptError(
            f"{path}: header (kind, mode, shard, dim, state_dim) = "
            f"{got}, the manifest says {expect}"
        )
    return payload


def load_graphs(
    directory: str | os.PathLike,
    server_index: int = 0,
    num_servers: int = 1,
    info: CheckpointInfo | None = None,
) -> dict[str, GraphTable]:
    """New graph tables holding this server's share of each graph table of the checkpoint in
    ``directory`` (saved by any number of servers); every file is checked against the
    manifests' size and CRC-32 first. Nothing is swapped in: the caller replaces its tables."""
    info = info or read_checkpoint(directory)
    out = {}
    for name in sorted(info.graph_tables):
        for rel, record in sorted((info.files or {}).items()):
            if rel.startswith(f"{GRAPHS_DIR}/{name}/"):
                verify_file(info.directory / rel, record)
        out[name], counts = load_table(info.directory / GRAPHS_DIR, name, server_index, num_servers)
        logger.info("graph table %r of %s: %s held here", name, info.directory, counts)
    return out


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
    "Snapshot",
    "TableEntry",
    "check_mode",
    "check_writer",
    "create_tables",
    "load",
    "load_graphs",
    "read_checkpoint",
    "save",
    "serving_payload",
    "shard_path",
    "take_snapshot",
    "write_snapshot",
]
