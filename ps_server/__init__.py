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

The gRPC layer (imported on first use, so ``import ps_server`` stays numpy-only): ``proto``
(``ps.proto`` and its generated modules), ``codec`` (packed bytes), ``service`` (the RPCs),
``sync`` (SYNC rounds, barriers), ``status`` (errors ↔ status codes), ``server`` (``PSServer``,
``serve``, ``serve_from_env``; ``python -m ps_server``) and ``client`` (``PSClient``)::

    from ps_server import PSClient, PSServer

    server = PSServer(port=0); port = server.start()
    client = PSClient([f"127.0.0.1:{port}"])
    client.create_table("emb", dim=8, optimizer=Adagrad(lr=0.05))
    rows = client.pull_sparse("emb", np.array([7, 3, 7]))               # float32[3, 8]
    client.push_sparse("emb", np.array([7, 3, 7]), np.ones((3, 8), np.float32))
    client.stop_servers(); server.wait()
"""

from __future__ import annotations

import importlib
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

_NOT_YET: dict[str, str] = {}
"""Names that are announced but not implemented yet (using one raises FleetNotImplementedError)."""

_LAZY = {
    "PSClient": "ps_server.client",
    "PSServer": "ps_server.server",
    "serve": "ps_server.server",
    "serve_from_env": "ps_server.server",
    "PSRpcError": "ps_server.status",
}
"""The gRPC layer, imported on first use (``import ps_server`` does not import grpc)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
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
    "PSClient",
    "PSRpcError",
    "PSServer",
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
    "serve",
    "serve_from_env",
    "shard_of",
    "shards_of_server",
]
