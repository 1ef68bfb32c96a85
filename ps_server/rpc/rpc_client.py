"""The transport under :class:`ps_server.client.PSClient`: one gRPC channel per server, calls
sent at once and awaited, retries and deadlines, health checks, and the same-host shared-memory
path (:mod:`ps_server.rpc.shm`).

Retries: idempotent calls (pulls, CreateTable, ListTables, InitDense, Stats, CheckpointWait,
ListCheckpoints, health) are retried up to ``retries`` times with exponential backoff on
UNAVAILABLE / DEADLINE_EXCEEDED, each attempt with its own deadline of ``timeout_s``. Pushes, Save,
Load, Shrink, EndDay, Barrier, CheckpointBegin, CheckpointCommit and Stop are never retried: when a reply is lost the server may already have acted, and a second push would
apply a gradient twice (APPLY), count one trainer twice toward a SYNC round (the mean and the
round boundary go wrong) or add a GEO delta twice. (gRPC's built-in retry policy is not used: it
shares one deadline across attempts and cannot retry DEADLINE_EXCEEDED.)

Reconnect: with ``reconnect_s`` > 0 (default FLEET_PS_RECONNECT_S, else 0) an idempotent call that
still finds a server UNAVAILABLE after its retries keeps trying, backoff doubling up to
:data:`MAX_BACKOFF_S`, until ``reconnect_s`` seconds after the first failure: a server being
restarted on its endpoint is waited for, for a bounded time. The channels reconnect within
:data:`MAX_BACKOFF_S` of the server's return (gRPC's own reconnect backoff is capped to it).
APPLY and GEO-delta pushes (not SYNC ones) are sent again too, only while their server is
UNAVAILABLE: an UNAVAILABLE push did not reach a live server's tables, and one that reached a
server which then died was lost with it (fleetrun restarts that server alone from its last
checkpoint in async/GEO mode; the push applies to the restored state).

Security: every call carries the job's token (``token=``, else FLEET_PS_TOKEN) as gRPC
metadata (:mod:`ps_server.rpc.auth`); a server that wants another answers UNAUTHENTICATED
(:class:`~ps_server.rpc.status.PSUnauthenticatedError`, never retried). TLS when a CA or a client
certificate is given (:mod:`ps_server.rpc.tls`; default from the FLEET_PS_TLS_* variables). The
shared-memory attach is an RPC like any other: it carries the token too.

Shared memory: a large sparse request to a server on this host leases a segment of this client
(created and attached on first use, see :mod:`ps_server.rpc.shm`); a server that cannot attach one
(another host or container, an older server) gets TCP from then on. A server that lost its
segments (it restarted) answers FAILED_PRECONDITION; the client drops them, and a pull (or an
APPLY/GEO push: the server refused it unread) is retried once over fresh ones (a SYNC push is not:
it raises, as any failed push does).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collective.errors import ConfigError
from ps_server.core.routing import split_for_messages
from ps_server.rpc import shm as shm_mod
from ps_server.rpc.auth import METADATA_KEY, resolve_token
from ps_server.rpc.channel_options import DEFAULT_MAX_MESSAGE_MB, MIB, grpc_message_options
from ps_server.rpc.proto import ps_pb2
from ps_server.rpc.service import SERVICE_NAME
from ps_server.rpc.shm import Segment
from ps_server.rpc.status import (
    PSDeadlineExceededError,
    PSFailedPreconditionError,
    PSRpcError,
    rpc_error,
)
from ps_server.rpc.tls import TLSConfig, channel_credentials, channel_options
from ps_server.rpc.wire import wire_message

logger = logging.getLogger(__name__)

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Status codes an idempotent call is retried on."""
MAX_BACKOFF_S = 0.5
"""Longest wait between two tries of a call, and of a channel to reconnect to its server."""
RECONNECT_ENV = "FLEET_PS_RECONNECT_S"
"""Default of ``reconnect_s``: seconds an idempotent call waits for an UNAVAILABLE server."""
MESSAGE_OVERHEAD_BYTES = 64 * 1024
"""Room left in each message for everything but the packed arrays (names, framing)."""
_PULL_SPARSE_RESPONSE = wire_message(ps_pb2.PullSparseResponse)


def _methods(channel: grpc.Channel) -> dict[str, Any]:
    """The service's methods on ``channel``: generated (de)serializers, except the sparse
    pull/push, which go through :mod:`ps_server.rpc.wire` (requests are encoded by the caller)."""
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    out = {}
    for m in service.methods:
        serializer = getattr(ps_pb2, m.input_type.name).SerializeToString
        deserializer = getattr(ps_pb2, m.output_type.name).FromString
        if m.name in ("PullSparse", "PushSparse"):
            serializer = None  # already wire-encoded bytes
        if m.name == "PullSparse":
            deserializer = _PULL_SPARSE_RESPONSE.decode
        out[m.name] = channel.unary_unary(
            f"/{SERVICE_NAME}/{m.name}",
            request_serializer=serializer,
            response_deserializer=deserializer,
        )
    return out


@dataclass
class Call:
    server: int
    method: str
    request: Any
    """A generated message, or wire-encoded bytes (PullSparse, PushSparse)."""


class _Inline:
    """A call run on the spot, with a future's ``result()``."""

    def __init__(self, fn: Any, call: Any) -> None:
        self._fn, self._call = fn, call

    def result(self) -> Any:
        return self._fn(self._call)


class RpcClient:
    """The channels to the servers at ``endpoints`` (``["host:port", ...]`` or ``"h:p,h:p"``),
    in server-index order; base of :class:`~ps_server.client.PSClient`."""

    def __init__(
        self,
        endpoints: Sequence[str] | str,
        *,
        timeout_s: float = 60.0,
        retries: int = 3,
        max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
        backoff_s: float = 0.2,
        shm: bool | None = None,
        shm_max_mb: float = 512.0,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        reconnect_s: float | None = None,
    ) -> None:
        """``timeout_s``: deadline of each attempt; ``retries``: extra attempts of idempotent
        calls; ``max_message_mb``: largest message this client sends or accepts (larger requests
        are split); ``shm``: move large sparse requests to servers on this host through shared
        memory (:mod:`ps_server.rpc.shm`; None: unless ``FLEET_PS_SHM=0``), for requests up to
        ``shm_max_mb``. ``token``: the job's token sent with every call (None: FLEET_PS_TOKEN,
        else none). ``tls_*``: PEM paths and the server-name override of
        :class:`~ps_server.rpc.tls.TLSConfig` (None: the FLEET_PS_TLS_* variables).
        ``reconnect_s``: how long an idempotent call keeps trying a server that is UNAVAILABLE
        after its ``retries`` (None: FLEET_PS_RECONNECT_S, else 0 = no longer than the retries)."""
        eps = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        eps = [e.strip() for e in eps if e.strip()]
        if not eps:
            raise ConfigError("must name at least one server (host:port)", key="endpoints")
        if not timeout_s > 0:
            raise ConfigError(f"must be > 0, got {timeout_s!r}", key="timeout_s")
        if not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"must be an integer >= 0, got {retries!r}", key="retries")
        if reconnect_s is None:
            raw = os.environ.get(RECONNECT_ENV) or "0"
            try:
                reconnect_s = float(raw)
            except ValueError:
                raise ConfigError(
                    f"must be a number of seconds >= 0, got {raw!r}", key=RECONNECT_ENV
                ) from None
        if not reconnect_s >= 0:
            raise ConfigError(
                f"must be a number of seconds >= 0, got {reconnect_s!r}", key="reconnect_s"
            )
        self.reconnect_s = float(reconnect_s)
        options = grpc_message_options(max_message_mb) + [
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", int(MAX_BACKOFF_S * 1000)),
        ]
        token = resolve_token(token)
        self._metadata: tuple[tuple[str, str], ...] | None = (
            ((METADATA_KEY, token),) if token is not None else None
        )
        self.tls = TLSConfig.resolve(
            ca=tls_ca, cert=tls_cert, key=tls_key, server_name=tls_server_name
        )
        self.endpoints: tuple[str, ...] = tuple(eps)
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_message_bytes = int(max_message_mb * MIB)
        self._payload_bytes = max(self.max_message_bytes - MESSAGE_OVERHEAD_BYTES, 1024)
        if self.tls.client_enabled:
            creds = channel_credentials(self.tls)
            options += channel_options(self.tls)
            self._channels = [grpc.secure_channel(e, creds, options=options) for e in eps]
        else:
            self._channels = [grpc.insecure_channel(e, options=options) for e in eps]
        self._methods = [_methods(c) for c in self._channels]
        self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        use_shm = shm_mod.enabled_by_env() if shm is None else bool(shm)
        self._shm = shm_mod.ShmPool(int(shm_max_mb * MIB)) if use_shm else None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(4, 2 * len(self.endpoints)), thread_name_prefix="psclient"
        )

    @property
    def num_servers(self) -> int:
        """Number of servers."""
        return len(self.endpoints)

    # -- plumbing ---------------------------------------------------------------------------
    def _invoke(
        self,
        calls: list[Call],
        idempotent: bool,
        timeout_s: float | None = None,
        reconnect: bool = False,
        keep_errors: bool = False,
    ) -> list[Any]:
        """Send ``calls`` at once, wait for every reply; raise the first failure. ``reconnect``
        (a call that is not idempotent, e.g. an async/GEO push): no retries, but with
        ``reconnect_s`` > 0 it is sent again while its server is UNAVAILABLE (restarting: a push
        re-applied to a server restored from a checkpoint is safe, that server lost it).
        ``keep_errors``: a failed call's PSRpcError takes its place in the list, nothing is
        raised."""
        timeout = self.timeout_s if timeout_s is None else timeout_s

        def blocking(c: Call) -> Any:
            return self._methods[c.server][c.method](
                c.request, timeout=timeout, metadata=self._metadata
            )

        # grpc's .future() starts a thread per call (~1 ms each on this class of machine): the
        # first call runs inline on this thread, the others on the client's long-lived pool, in
        # parallel with it (submitted before it starts: one hand-off fewer than all on the pool)
        futs: list[Any] = [_Inline(blocking, calls[0])] if calls else []
        futs += [self._pool.submit(blocking, c) for c in calls[1:]]
        results: list[Any] = [None] * len(calls)
        error: Exception | None = None
        for i, (call, fut) in enumerate(zip(calls, futs)):
            try:
                results[i] = fut.result()
            except grpc.RpcError as err:
                again = (
                    idempotent and err.code() in RETRYABLE and (self.retries or self.reconnect_s)
                ) or (
                    reconnect and err.code() is grpc.StatusCode.UNAVAILABLE and self.reconnect_s > 0
                )
                if again:
                    try:
                        results[i] = self._retry(
                            call, timeout, err, self.retries if idempotent else 0
                        )
                        continue
                    except grpc.RpcError as last:
                        err = last
                failed = rpc_error(call.method, self.endpoints[call.server], err)
                if keep_errors:
                    results[i] = failed
                error = error or failed
        if error is not None and not keep_errors:
            raise error
        return results

    def _retry(self, call: Call, timeout: float, err: grpc.RpcError, retries: int) -> Any:
        """Try ``call`` again: ``retries`` times, then while the server is UNAVAILABLE and
        ``reconnect_s`` has not passed since now; raise the last error."""
        method = self._methods[call.server][call.method]
        deadline = time.monotonic() + self.reconnect_s
        attempt = 0
        while True:
            attempt += 1
            left = deadline - time.monotonic()
            reconnecting = attempt > retries
            if reconnecting and (err.code() is not grpc.StatusCode.UNAVAILABLE or left <= 0):
                raise err
            delay = min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
            if reconnecting:
                delay = min(delay, left)
            logger.warning(
                "%s on %s: %s; %s in %.1fs",
                call.method,
                self.endpoints[call.server],
                err.code().name,
                f"waiting for it to return ({left:.0f}s left)"
                if reconnecting
                else f"retry {attempt}/{retries}",
                delay,
            )
            time.sleep(delay)
            try:
                return method(call.request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as again:
                if again.code() not in RETRYABLE:
                    raise
                err = again

    def _all(self, method: str, request: Message, idempotent: bool) -> list[Any]:
        return self._invoke([Call(s, method, request) for s in range(self.num_servers)], idempotent)

    def _chunks(self, keys: np.ndarray, row_bytes: int, keep_keys_together: bool) -> list[Any]:
        """Slices (or position arrays) of ``keys`` that each fit one message."""
        per = max(1, self._payload_bytes // row_bytes)
        return split_for_messages(keys, per, keep_keys_together)

    # -- same-host shared memory (ps_server/rpc/shm.py) -------------------------------------------
    def _lease(self, server: int, num_keys: int, dim: int) -> Segment | None:
        """A shared-memory segment for a request of ``num_keys`` rows to ``server``, or None
        (TCP: small request, shm off, or the server is not on this host)."""
        return self._lease_bytes(server, shm_mod.bytes_needed(num_keys, dim))

    def _lease_bytes(self, server: int, nbytes: int) -> Segment | None:
        """A shared-memory segment of at least ``nbytes`` for a request to ``server``, or None
        (TCP: small or too large a request, shm off, or the server is not on this host)."""
        if self._shm is None or not self._shm.usable(server, nbytes):
            return None
        return self._shm.lease(server, nbytes, self._attach)

    def _attach(self, server: int, name: str, token: bytes) -> bool:
        request = ps_pb2.ShmAttachRequest(segment=name, token=token)
        try:
            self._invoke([Call(server, "ShmAttach", request)], idempotent=True)
        except PSRpcError as err:
            if err.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                raise
            logger.info(
                "%s: no shared memory with this client, using TCP: %s",
                self.endpoints[server],
                err.details,
            )
            return False
        return True

    def _release(self, segs: list[Segment | None], lost: BaseException | None) -> bool:
        """Give the call's segments back; True when ``lost`` says a server no longer knows its
        segment (it restarted): its segments are dropped and the caller may retry once."""
        leased = [s for s in segs if s is not None]
        if self._shm is None or not leased:
            return False
        for seg in leased:
            self._shm.release(seg)
        if not (isinstance(lost, PSFailedPreconditionError) and "shm:" in lost.details):
            return False
        for server in {s.server for s in leased}:
            self._shm.forget_server(server)
        return True

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until every server answers its health check with SERVING."""
        deadline = time.monotonic() + timeout_s
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        for server, stub in enumerate(self._health):
            while True:
                remaining = deadline - time.monotonic()
                status, err = None, None
                if remaining > 0:
                    try:
                        reply = stub.Check(request, timeout=remaining, wait_for_ready=True)
                        status = reply.status
                    except grpc.RpcError as exc:
                        err = exc
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                if time.monotonic() >= deadline:
                    raise PSDeadlineExceededError(
                        "health check",
                        self.endpoints[server],
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"not serving after {timeout_s:g}s (last: "
                        f"{err.code().name if err is not None else status}); servers not "
                        f"checked yet: {list(self.endpoints[server + 1 :])}",
                    )
                time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))

    def close(self) -> None:
        """Detach this client's shared-memory segments, close the channels and the call pool."""
        if self._shm is not None:
            for seg in self._shm.close():
                request = ps_pb2.ShmDetachRequest(segment=seg.name)
                try:  # best effort: a stopped server has unmapped them already
                    self._methods[seg.server]["ShmDetach"](
                        request, timeout=2.0, metadata=self._metadata
                    )
                except grpc.RpcError:
                    pass
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> RpcClient:  # noqa: PYI034 - py3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MESSAGE_OVERHEAD_BYTES", "RETRYABLE", "Call", "RpcClient"]
