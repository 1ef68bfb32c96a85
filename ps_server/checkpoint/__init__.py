"""Checkpoints of parameter-server tables on disk: :mod:`~ps_server.checkpoint.save_load` (the
directory, its manifests, ``save`` / ``load`` / ``read_checkpoint``, N → M resharding) and
:mod:`~ps_server.checkpoint.shard_file` (the binary format of one (table, shard) file).

May import :mod:`ps_server.core` (the tables and their shard payloads), :mod:`ps_server.config`,
:mod:`ps_server.errors` and :mod:`collective`; never :mod:`ps_server.rpc`, the server or the
client (the Save / Load RPCs call this package, not the other way). numpy only, no gRPC.

The names below are those of the module ``ps_server.checkpoint`` this package replaced, so
``from ps_server.checkpoint import save, load`` keeps working.
"""

from __future__ import annotations

from ps_server.checkpoint.save_load import (
    MANIFEST_FORMAT,
    MODES,
    CheckpointInfo,
    TableEntry,
    create_tables,
    load,
    read_checkpoint,
    save,
    shard_path,
)
from ps_server.checkpoint.shard_file import FORMAT_VERSION

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FORMAT",
    "MODES",
    "CheckpointInfo",
    "TableEntry",
    "create_tables",
    "load",
    "read_checkpoint",
    "save",
    "shard_path",
]
