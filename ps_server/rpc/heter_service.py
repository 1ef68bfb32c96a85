"""The heter worker's RPCs: the ``fleetrun.ps.v1.Heter`` gRPC service of a heterogeneous PS job.

A heter worker (``TRAINING_ROLE=HETER_TRAINER``, :mod:`fleet.heter`) runs the dense half of the
model for the CPU trainers. Each trainer sends a micro-batch's activations and labels, and gets
back the activations' gradients and the loss. The methods take and return raw bytes in the
graph service's frame format (:func:`ps_server.rpc.graph_service.encode` / ``decode``: a JSON
header and numpy arrays read as zero-copy views), so this package imports no torch: the work
is done by a *handler* object the worker passes in (:class:`HeterHandler`).

Methods (each ``(header, arrays) -> (header, arrays)``):

* ``Hello``: a trainer announces itself (``trainer``, ``trainers``); the reply says the
  worker's index, device and mode. Idempotent.
* ``Step``: one training micro-batch (``trainer``, ``seq``; arrays ``act0..actN`` and
  ``label``) -> ``loss`` and the arrays ``grad0..gradN`` (and ``out``). The reply is sent once
  the worker's dense update of that micro-batch reached the servers.
* ``Predict``: forward only (evaluation) -> ``out``. Idempotent.
* ``Stop``: the trainer is done (``trainer``); the worker returns once every trainer stopped.

Security as on the parameter server: the job's token in every call's metadata
(:class:`~ps_server.rpc.auth.TokenInterceptor`, FLEET_PS_TOKEN), TLS from FLEET_PS_TLS_*
(:mod:`ps_server.rpc.tls`), a non-loopback bind refused without a token. The health service
answers SERVING while the worker serves. Messages are bounded by ``max_message_mb`` on both
ends (:mod:`ps_server.rpc.channel_options`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any, Protocol

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ps_server.errors import PSError
from ps_server.rpc.auth import TokenInterceptor, check_bind_allowed, resolve_token
from ps_server.rpc.channel_options import DEFAULT_MAX_MESSAGE_MB, grpc_message_options
from ps_server.rpc.graph_service import decode, encode
from ps_server.rpc.service import MAX_DETAILS_CHARS
from ps_server.rpc.status import status_of
from ps_server.rpc.tls import TLSConfig, server_credentials

logger = logging.getLogger(__name__)

HETER_SERVICE = "fleetrun.ps.v1.Heter"
"""The gRPC service name of the heter worker's calls."""
METHODS = ("Hello", "Step", "Predict", "Stop")
"""The service's methods."""
IDEMPOTENT = frozenset({"Hello", "Predict"})
"""Methods a client may send again after a lost reply."""

Reply = tuple[dict[str, Any], dict[str, np.ndarray]]


class HeterHandler(Protocol):
    """What serves the calls (the heter worker's runtime, :mod:`fleet.heter.worker`)."""

    def hello(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> Reply: ...

    def step(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> Reply: ...

    def predict(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> Reply: ...

    def stop(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> Reply: ...


def _method(handler: HeterHandler, op: str) -> Callable[[bytes, Any], bytes]:
    fn = getattr(handler, op.lower())

    def handle(request: bytes, context: Any) -> bytes:
        try:
            header, arrays = decode(request)
            out_h, out_a = fn(header, arrays)
            return encode(out_h, out_a)
        except Exception as err:  # noqa: BLE001 - every error becomes a status code
            code = status_of(err)
            if code is grpc.StatusCode.INTERNAL:
                logger.error("Heter.%s failed with an unexpected error", op, exc_info=err)
                details = f"{type(err).__name__}: {err} (see the heter worker's log)"
            else:
                details = str(err)
            context.abort(code, details[:MAX_DETAILS_CHARS])
            raise AssertionError("context.abort returned") from None  # pragma: no cover

    return handle


class HeterServer:
    """A gRPC server with the Heter service (and health) on ``host:port``, calling ``handler``.

    ``threads``: request threads (several CPU trainers at once; the handler serializes the
    device work); ``token``: the job's token (None: FLEET_PS_TOKEN); ``tls``: None reads
    FLEET_PS_TLS_*; ``insecure``: allow a non-loopback bind without a token."""

    def __init__(
        self,
        handler: HeterHandler,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        threads: int = 16,
        token: str | None = None,
        tls: TLSConfig | None = None,
        insecure: bool = False,
        max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    ) -> None:
        self.handler = handler
        self.host, self.port = host, port
        self.threads = threads
        self.token = resolve_token(token)
        self.tls = TLSConfig.resolve() if tls is None else tls
        self.insecure = insecure
        self._options = grpc_message_options(max_message_mb)
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        """``host:port`` it serves on (the bound port after :meth:`start`)."""
        return f"{self.host}:{self.port}"

    def start(self) -> int:
        """Bind and serve; returns the port (PSError naming the address if it cannot bind)."""
        check_bind_allowed(self.host, self.token is not None, self.insecure)
        interceptors = [TokenInterceptor(self.token)] if self.token is not None else []
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="heter"),
            interceptors=interceptors,
            options=[*self._options, ("grpc.so_reuseport", 0)],
        )
        handlers = {
            op: grpc.unary_unary_rpc_method_handler(_method(self.handler, op)) for op in METHODS
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(HETER_SERVICE, handlers),)
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            if self.tls.server_enabled:
                port = server.add_secure_port(address, server_credentials(self.tls))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as err:
            raise PSError(
                f"heter worker cannot listen on {address}: {err} (port busy, or the host is not "
                "an address of this machine)"
            ) from err
        if port == 0:
            raise PSError(f"heter worker cannot listen on {address} (port busy?)")
        server.start()
        self._server, self.port = server, port
        for service in ("", HETER_SERVICE):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "heter worker serving on %s (%s, %s)",
            self.endpoint,
            "job token required" if self.token is not None else "no token",
            "TLS" if self.tls.server_enabled else "no TLS",
        )
        return port

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving (idempotent); calls in progress get ``grace_s`` to finish."""
        with self._lock:
            server, self._server = self._server, None
        if server is None:
            return
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        server.stop(grace_s).wait()


__all__ = ["HETER_SERVICE", "IDEMPOTENT", "METHODS", "HeterHandler", "HeterServer"]
