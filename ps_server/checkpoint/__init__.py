"""Checkpoints of parameter-server tables on disk.

* :mod:`~ps_server.checkpoint.save_load` — snapshot the tables under their locks (a memcpy),
  write the snapshot (``save`` / ``write_snapshot``), ``load`` with N → M resharding;
* :mod:`~ps_server.checkpoint.manifest` — the per-server manifests of a directory (every file's
  size and CRC-32), read back merged and checked (``read_checkpoint``);
* :mod:`~ps_server.checkpoint.shard_file` — the binary format of one (table, shard) file;
* :mod:`~ps_server.checkpoint.files` — atomic, fsynced, checksummed file writes;
* :mod:`~ps_server.checkpoint.ssd_files` — the cold rows of SSD tables as RocksDB checkpoints
  (hard-linked or copied in, adopted whole by a load with the same sharding);
* :mod:`~ps_server.checkpoint.series` — numbered job checkpoints ``<root>/ckpt-<step>``:
  ``commit`` (``checkpoint.json`` last), ``latest_good`` (falls back past unfinished or corrupt
  ones, naming them), ``prune`` (keep K);
* :mod:`~ps_server.checkpoint.writer` — a server's background checkpoint writes;
* :mod:`~ps_server.checkpoint.serving` — serving exports: a base and its deltas loaded into
  read-only tables;
* :mod:`~ps_server.checkpoint.roots` — the roots Save / Load / checkpoint requests are
  confined to.

May import :mod:`ps_server.core` (the tables and their shard payloads), :mod:`ps_server.config`,
:mod:`ps_server.errors` and :mod:`collective`; never :mod:`ps_server.rpc`, the server or the
client (the RPCs call this package, not the other way). numpy only, no gRPC.

The names of the module ``ps_server.checkpoint`` this package replaced still import from here
(``from ps_server.checkpoint import save, load``).
"""

from __future__ import annotations

from ps_server.checkpoint.manifest import (
    MANIFEST_FORMAT,
    MODES,
    CheckpointInfo,
    TableEntry,
    read_checkpoint,
    shard_path,
)
from ps_server.checkpoint.save_load import create_tables, load, save
from ps_server.checkpoint.series import (
    CheckpointRecord,
    CheckpointStatus,
    LatestGood,
    Verify,
    checkpoint_name,
    latest_good,
    list_checkpoints,
    read_record,
)
from ps_server.checkpoint.serving import load_serving
from ps_server.checkpoint.shard_file import FORMAT_VERSION

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FORMAT",
    "MODES",
    "CheckpointInfo",
    "CheckpointRecord",
    "CheckpointStatus",
    "LatestGood",
    "TableEntry",
    "Verify",
    "checkpoint_name",
    "create_tables",
    "latest_good",
    "list_checkpoints",
    "load",
    "load_serving",
    "read_checkpoint",
    "read_record",
    "save",
    "shard_path",
]
