"""The CPU trainer's client of one heter worker (:mod:`ps_server.rpc.heter_service`).

``HeterClient(endpoint)`` sends micro-batches (``step`` blocks; ``submit`` returns a future, so
up to K can be in flight) and evaluation batches (``predict``), and tells the worker when the
trainer is done (``stop``). Every call carries the job's token (FLEET_PS_TOKEN) and uses TLS as
the PS client does (FLEET_PS_TLS_*).

Recovery: a call that finds the worker UNAVAILABLE (killed, being restarted on its endpoint) is
sent again, backoff doubling up to 0.5 s, until ``recovery_s`` seconds after the first failure;
then :class:`HeterUnavailableError` names the endpoint. A ``Step`` whose reply came back was
applied (the worker replies after its dense update reached the servers); one that is sent again
after the worker died may have been applied before it died (at least once, never lost).

Messages are bounded: a request larger than ``max_message_mb`` is refused before it is sent
(ConfigError with the size, the limit and what to change).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collective.errors import ConfigError
from ps_server.errors import PSError
from ps_server.rpc.auth import METADATA_KEY, resolve_token
from ps_server.rpc.channel_options import DEFAULT_MAX_MESSAGE_MB, MIB, grpc_message_options
from ps_server.rpc.graph_service import decode, encode
from ps_server.rpc.heter_service import HETER_SERVICE, METHODS
from ps_server.rpc.status import rpc_error
from ps_server.rpc.tls import TLSConfig, channel_credentials, channel_options

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 0.5
"""Longest wait between two tries of a call to an unavailable heter worker."""

Reply = tuple[dict[str, Any], dict[str, np.ndarray]]


class HeterUnavailableError(PSError, ConnectionError):
    """The heter worker did not answer within the recovery window (names its endpoint)."""


class HeterClient:
    """Calls to the heter worker at ``endpoint`` (``host:port``).

    ``timeout_s``: deadline of one call (the worker's device work included); ``recovery_s``: how
    long a call keeps trying an UNAVAILABLE worker; ``in_flight``: calls :meth:`submit` may
    have running at once; ``token`` / ``tls``: None reads FLEET_PS_TOKEN / FLEET_PS_TLS_*."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 600.0,
        recovery_s: float = 60.0,
        in_flight: int = 1,
        token: str | None = None,
        tls: TLSConfig | None = None,
        max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    ) -> None:
        if not recovery_s >= 0:
            raise ConfigError(f"must be >= 0 seconds, got {recovery_s!r}", key="recovery_s")
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self.recovery_s = float(recovery_s)
        self.max_message_bytes = int(max_message_mb * MIB)
        options = grpc_message_options(max_message_mb) + [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(MAX_BACKOFF_S * 1000)),
        ]
        token = resolve_token(token)
        self._metadata = ((METADATA_KEY, token),) if token is not None else None
        self.tls = TLSConfig.resolve() if tls is None else tls
        if self.tls.client_enabled:
            options += channel_options(self.tls)
            self._channel = grpc.secure_channel(
                endpoint, channel_credentials(self.tls), options=options
            )
        else:
            self._channel = grpc.insecure_channel(endpoint, options=options)
        self._methods = {op: self._channel.unary_unary(f"/{HETER_SERVICE}/{op}") for op in METHODS}
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, in_flight), thread_name_prefix="heterclient"
        )

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the worker serves; HeterUnavailableError naming it after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        request = health_pb2.HealthCheckRequest(service=HETER_SERVICE)
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HeterUnavailableError(
                    f"heter worker {self.endpoint} is unreachable: not serving after "
                    f"{timeout_s:g}s (last: {last}); check that it started (its log, heterlog.N "
                    "under fleetrun) and that this host can reach that address"
                )
            try:
                reply = self._health.Check(request, timeout=min(left, 2.0), wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as err:
                last = err.code().name
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))

    def call(
        self, op: str, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None
    ) -> Reply:
        """Send one call (retried while the worker is UNAVAILABLE, up to ``recovery_s``)."""
        body = encode(header, arrays)
        if len(body) > self.max_message_bytes:
            raise ConfigError(
                f"a Heter.{op} request of {len(body) / MIB:.1f} MiB exceeds the "
                f"{self.max_message_bytes / MIB:g} MiB message limit to {self.endpoint}; use "
                "smaller micro-batches (or a narrower cut)",
                key="max_message_mb",
            )
        method = self._methods[op]
        first_failure: float | None = None
        attempt = 0
        while True:
            try:
                return decode(method(body, timeout=self.timeout_s, metadata=self._metadata))
            except grpc.RpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise rpc_error(f"Heter.{op}", self.endpoint, err) from None
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                if now - first_failure >= self.recovery_s:
                    raise HeterUnavailableError(
                        f"heter worker {self.endpoint} is unavailable: Heter.{op} "
                        f"(micro-batch {header.get('seq', '-')} of trainer "
                        f"{header.get('trainer', '-')}) got no answer for {self.recovery_s:g}s "
                        f"({err.details()}); it died and was not restarted on its endpoint "
                        "within the recovery window"
                    ) from None
                attempt += 1
                if attempt == 1:
                    logger.warning(
                        "heter worker %s unavailable (%s); retrying for up to %gs",
                        self.endpoint,
                        err.code().name,
                        self.recovery_s,
                    )
                time.sleep(min(0.05 * 2**attempt, MAX_BACKOFF_S))

    def submit(
        self, op: str, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None
    ) -> concurrent.futures.Future[Reply]:
        """:meth:`call` on the client's pool; the future's result is the reply."""
        return self._pool.submit(self.call, op, header, arrays)

    def close(self) -> None:
        """Close the channel and the call pool (calls in flight finish first)."""
        self._pool.shutdown(wait=True)
        self._channel.close()

    def __enter__(self) -> HeterClient:  # noqa: PYI034 - py3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["HeterClient", "HeterUnavailableError"]
