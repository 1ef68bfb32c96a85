"""The parameter server's storage core: the tables (:mod:`~ps_server.core.table` base,
:mod:`~ps_server.core.sparse_table` with its input checks in :mod:`~ps_server.core.sparse_inputs`,
:mod:`~ps_server.core.dense_table`,
:mod:`~ps_server.core.factory` from config to table), their per-shard payloads
(:mod:`~ps_server.core.shard_data`, :mod:`~ps_server.core.sparse_shards`), the row storage
(:mod:`~ps_server.core.row_store` over :mod:`~ps_server.core.hash_index`,
:mod:`~ps_server.core.hashing`, :mod:`~ps_server.core.batch_ops` and the compiled
:mod:`~ps_server.core.kernels`), the registered rule families (:mod:`~ps_server.core.optimizers`,
:mod:`~ps_server.core.initializers`, :mod:`~ps_server.core.entry` on
:mod:`~ps_server.core.registry`) and :mod:`~ps_server.core.routing` (key → shard → server, shared
by the client and the server). SSD-tiered sparse tables are the ``ssd_*`` modules
(:mod:`~ps_server.core.ssd_table` over a RocksDB tier, :mod:`~ps_server.core.ssd_tier`; a pass's
read-through pull in :mod:`~ps_server.core.ssd_pass`), graph tables the ``graph_*`` modules
(:mod:`~ps_server.core.graph_table`).

May import numpy, :mod:`collective`, and the leaf modules :mod:`ps_server.config` and
:mod:`ps_server.errors`; never :mod:`ps_server.rpc`, :mod:`ps_server.checkpoint`, the server or
the client, and nothing of gRPC. This file imports nothing (``import ps_server.core.routing``
loads only what routing needs).
"""
