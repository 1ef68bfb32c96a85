"""fleetrun's parameter server: sharded sparse (embedding) and dense tables with server-side
optimizers, admission, aging and per-shard checkpoints.

This package is the server-side core (numpy only; no gRPC, never imports ``fleet`` or
``launcher``)::

    import numpy as np
    from ps_server import Adagrad, CountFilterEntry, SparseTable, SparseTableConfig, Uniform

    cfg = SparseTableConfig("emb", dim=8, optimizer=Adagrad(lr=0.05),
                            initializer=Uniform(-0.01, 0.01), entry=CountFilterEntry(2))
    table = SparseTable.for_server(cfg, server_index=0, num_servers=1)
    rows = table.pull(np.array([1, 2, 3], dtype=np.int64))           # float32[3, 8]
    table.push(np.array([1, 2, 3], dtype=np.int64), np.ones((3, 8), np.float32))

Modules: ``optimizers`` / ``initializers`` / ``entry`` (registered rule families), ``config``,
``routing`` (key → shard → server), ``sparse_table``, ``dense_table``, ``checkpoint`` and
``shard_file`` (on-disk format), ``row_store`` / ``hash_index`` (storage), ``errors``.
``PSClient`` (the gRPC client) has not landed yet: using it raises FleetNotImplementedError.
"""

from __future__ import annotations

from typing import Any

from collective.errors import FleetNotImplementedError
from ps_server import checkpoint
from ps_server.checkpoint import create_tables, load, read_checkpoint, save
from ps_server.config import (
    DenseTableConfig,
    NonFinitePolicy,
    SparseTableConfig,
    check_same_config,
    config_diff,
    config_from_dict,
    config_to_dict,
)
from ps_server.dense_table import DenseTable
from ps_server.entry import CountFilterEntry, EntryPolicy, ProbabilityEntry
from ps_server.initializers import Constant, Initializer, Normal, TruncatedNormal, Uniform
from ps_server.optimizers import SGD, Adagrad, Adam, OptimizerRule, RowsMeta
from ps_server.routing import block_shard, group_by_server, shard_of, shards_of_server
from ps_server.sparse_table import PushStats, SparseTable
from ps_server.table import Table
from ps_server.tables import make_table

_NOT_YET = {"PSClient": "the gRPC parameter-server client has not landed yet"}


def __getattr__(name: str) -> Any:
    if name in _NOT_YET:
        raise FleetNotImplementedError(f"ps_server.{name}", _NOT_YET[name])
    raise AttributeError(f"module 'ps_server' has no attribute {name!r}")


__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "Constant",
    "CountFilterEntry",
    "DenseTable",
    "DenseTableConfig",
    "EntryPolicy",
    "Initializer",
    "NonFinitePolicy",
    "Normal",
    "OptimizerRule",
    "ProbabilityEntry",
    "PushStats",
    "RowsMeta",
    "SparseTable",
    "SparseTableConfig",
    "Table",
    "TruncatedNormal",
    "Uniform",
    "block_shard",
    "check_same_config",
    "checkpoint",
    "config_diff",
    "config_from_dict",
    "config_to_dict",
    "create_tables",
    "group_by_server",
    "load",
    "make_table",
    "read_checkpoint",
    "save",
    "shard_of",
    "shards_of_server",
]
