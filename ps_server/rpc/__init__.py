"""The gRPC layer of the parameter server: the protocol (:mod:`~ps_server.rpc.proto`), bytes on
the wire (:mod:`~ps_server.rpc.codec` for packed arrays, :mod:`~ps_server.rpc.wire` for zero-copy
messages, :mod:`~ps_server.rpc.shm` for the same-host shared-memory path), the server side (the
RPCs as functions over a server state in :mod:`~ps_server.rpc.service`, with
:mod:`~ps_server.rpc.sync` for SYNC rounds, barriers and staged uploads; the thin
:mod:`~ps_server.rpc.servicer`), errors ↔ status codes in one place
(:mod:`~ps_server.rpc.status`), the client transport (:mod:`~ps_server.rpc.rpc_client`: channels,
retries, deadlines), the options both ends share (:mod:`~ps_server.rpc.channel_options`), who
may call (:mod:`~ps_server.rpc.auth`: the job's token, checked by a server interceptor) and
TLS / mutual TLS credentials (:mod:`~ps_server.rpc.tls`).

May import :mod:`ps_server.core`, :mod:`ps_server.checkpoint` (the Save / Load RPCs), the leaf
modules :mod:`ps_server.config`, :mod:`ps_server.errors` and :mod:`ps_server.telemetry`,
:mod:`collective` and gRPC; never :mod:`ps_server.server` or :mod:`ps_server.client`, which sit
on top. This file imports nothing, so ``import ps_server`` stays free of gRPC until a module of
this package is used.
"""
