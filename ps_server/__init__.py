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

Layout, one room per layer (each subpackage's docstring says what it may import)::

    core/        tables (table, sparse_table, dense_table, serving_table, factory), storage
                 (row_store, row_flags, hash_index, hashing, batch_ops, compiled kernels), rules
                 (optimizers, initializers, entry, registry), routing (key -> shard -> server),
                 shard payloads and snapshots
    checkpoint/  snapshot / save / load of tables (save_load), manifests (manifest), the binary
                 shard file (shard_file), atomic checksummed files (files), numbered job
                 checkpoints (series: commit, latest_good, prune), background writes (writer),
                 serving exports (serving) and the roots requests are confined to (roots)
    rpc/         the gRPC layer: proto/, codec and wire (bytes), shm (same-host path), service
                 (the RPCs as functions) + sync (rounds, barriers), checkpoint_service (job
                 checkpoints, serving, read-only refusals), servicer, status (errors <-> codes),
                 rpc_client (channels, retries), checkpoint_client (PSClient's checkpoint and
                 export calls), channel_options, auth (the job's token on every call), tls
    server.py  client.py  __main__.py     PSServer / serve, PSClient, ``python -m ps_server``
    config.py  errors.py  telemetry.py    table configs, error types, Prometheus metrics

``core`` and ``checkpoint`` are numpy-only; ``rpc``, ``server`` and ``client`` need gRPC and are
imported on first use, so ``import ps_server`` stays numpy-only. The server and the client::

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
from collective.moved_modules import install_moved_modules

_NOT_YET: dict[str, str] = {}
"""Names that are announced but not implemented yet (using one raises FleetNotImplementedError)."""

_LAZY = {
    "checkpoint": "ps_server.checkpoint.",
    "create_tables": "ps_server.checkpoint",
    "load": "ps_server.checkpoint",
    "read_checkpoint": "ps_server.checkpoint",
    "save": "ps_server.checkpoint",
    "DenseTableConfig": "ps_server.config",
    "NonFinitePolicy": "ps_server.config",
    "SparseTableConfig": "ps_server.config",
    "check_same_config": "ps_server.config",
    "config_diff": "ps_server.config",
    "config_from_dict": "ps_server.config",
    "config_to_dict": "ps_server.config",
    "DenseTable": "ps_server.core.dense_table",
    "CountFilterEntry": "ps_server.core.entry",
    "EntryPolicy": "ps_server.core.entry",
    "ProbabilityEntry": "ps_server.core.entry",
    "make_table": "ps_server.core.factory",
    "Constant": "ps_server.core.initializers",
    "Initializer": "ps_server.core.initializers",
    "Normal": "ps_server.core.initializers",
    "TruncatedNormal": "ps_server.core.initializers",
    "Uniform": "ps_server.core.initializers",
    "SGD": "ps_server.core.optimizers",
    "Adagrad": "ps_server.core.optimizers",
    "Adam": "ps_server.core.optimizers",
    "OptimizerRule": "ps_server.core.optimizers",
    "RowsMeta": "ps_server.core.optimizers",
    "block_shard": "ps_server.core.routing",
    "group_by_server": "ps_server.core.routing",
    "shard_of": "ps_server.core.routing",
    "shards_of_server": "ps_server.core.routing",
    "SparseTable": "ps_server.core.sparse_table",
    "PushStats": "ps_server.core.table",
    "Table": "ps_server.core.table",
    "PSClient": "ps_server.client",
    "PSServer": "ps_server.server",
    "serve": "ps_server.server",
    "serve_from_env": "ps_server.server",
    "PSRpcError": "ps_server.rpc.status",
}
"""Every public name, imported on first use: ``import ps_server`` (which importing any of its
modules runs first) loads nothing more; the gRPC layer's names load grpc."""

MOVED_MODULES: dict[str, str] = {
    "ps_server.batch_ops": "ps_server.core.batch_ops",
    "ps_server.dense_table": "ps_server.core.dense_table",
    "ps_server.entry": "ps_server.core.entry",
    "ps_server.hash_index": "ps_server.core.hash_index",
    "ps_server.hashing": "ps_server.core.hashing",
    "ps_server.initializers": "ps_server.core.initializers",
    "ps_server.kernels": "ps_server.core.kernels",
    "ps_server.optimizers": "ps_server.core.optimizers",
    "ps_server.registry": "ps_server.core.registry",
    "ps_server.routing": "ps_server.core.routing",
    "ps_server.row_store": "ps_server.core.row_store",
    "ps_server.sparse_table": "ps_server.core.sparse_table",
    "ps_server.table": "ps_server.core.table",
    "ps_server._kernels": "ps_server.core._kernels",
    "ps_server.tables": "ps_server.core.factory",
    "ps_server.codec": "ps_server.rpc.codec",
    "ps_server.rpc_client": "ps_server.rpc.rpc_client",
    "ps_server.service": "ps_server.rpc.service",
    "ps_server.servicer": "ps_server.rpc.servicer",
    "ps_server.shm": "ps_server.rpc.shm",
    "ps_server.status": "ps_server.rpc.status",
    "ps_server.sync": "ps_server.rpc.sync",
    "ps_server.wire": "ps_server.rpc.wire",
    "ps_server.proto": "ps_server.rpc.proto",
    "ps_server.proto.ps_pb2": "ps_server.rpc.proto.ps_pb2",
    "ps_server.proto.ps_pb2_grpc": "ps_server.rpc.proto.ps_pb2_grpc",
    "ps_server.shard_file": "ps_server.checkpoint.shard_file",
}
"""Module paths from before the subpackages (old → new). Importing an old path gives the new
module itself, with a DeprecationWarning (:mod:`collective.moved_modules`). ``ps_server.checkpoint``
is not here: the package re-exports what the module of that name had. ``ps_server.table_ops`` is
gone: its GEO delta is :meth:`SparseTable.add_delta`."""
install_moved_modules("ps_server", MOVED_MODULES)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        if module.endswith("."):
            value: Any = importlib.import_module(module[:-1])
        else:
            value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if f"ps_server.{name}" in MOVED_MODULES:  # ``ps_server.routing.X``: warns, as its import does
        return importlib.import_module(f"ps_server.{name}")
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
