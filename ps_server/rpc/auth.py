"""Who may call a parameter server: the job's token, checked on every RPC.

A job's processes share one random token (fleetrun makes one per job: ``FLEET_PS_TOKEN`` in the
environment locally and on Ray, a Secret on Kubernetes). The client sends it as the gRPC metadata
entry :data:`METADATA_KEY` on every call; the server's :class:`TokenInterceptor` compares it in
constant time (``hmac.compare_digest``) before gRPC even parses the request, and answers
UNAUTHENTICATED (:class:`~ps_server.rpc.status.AuthError`, through the one status mapping) when
it is missing or wrong: the RPC's function never runs, so such a call changes nothing. Refusals
are counted (``fleet_ps_auth_failures_total`` by op and cause, and the server's Stats errors) and
logged at most once a minute.

The standard health service (``grpc.health.v1.Health``) stays open: it only says SERVING or
NOT_SERVING, and load balancers and ``wait_ready`` probe it without the job's secret.

Why an interceptor rather than a check in the servicer: it covers every method the server has,
also ones a caller made up (refused the same way, not UNIMPLEMENTED), and refuses before the
request body is parsed, so a stranger's bytes never reach the protobuf or wire decoders.

A server without a token admits anyone who reaches its port, so :func:`check_bind_allowed`
lets it bind only a loopback address unless it was started with ``--insecure``.

Without TLS (:mod:`ps_server.rpc.tls`) the token travels in clear text: enough to keep other jobs
and strangers' mistakes out on a trusted network, not an eavesdropper.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from collective.errors import ConfigError
from ps_server import telemetry
from ps_server.rpc.proto import ps_pb2
from ps_server.rpc.status import AuthError, status_of

logger = logging.getLogger(__name__)

TOKEN_ENV = "FLEET_PS_TOKEN"
"""The environment variable holding the job's token (servers and clients read it)."""
INSECURE_ENV = "FLEET_PS_INSECURE"
"""``1``: a server without a token may bind a non-loopback address (``--insecure``)."""
METADATA_KEY = "fleet-ps-token"
"""gRPC metadata key the client sends the token under."""
OPEN_SERVICES = ("/grpc.health.v1.Health/",)
"""Method prefixes served without a token."""
_SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
_OPS = {f"/{_SERVICE.full_name}/{m.name}": m.name for m in _SERVICE.methods}
"""Method path -> op label; any other path is counted as op ``unknown`` (labels stay bounded)."""
LOG_EVERY_S = 60.0
"""Refusals are logged at most this often (each log line says how many there were since)."""


def check_token(token: str, what: str) -> str:
    """``token`` when it can travel as gRPC metadata (printable ASCII, no spaces, not empty);
    ConfigError naming ``what`` (never the token) otherwise."""
    if not token or not all(33 <= ord(c) <= 126 for c in token):
        raise ConfigError(
            "must be a non-empty string of printable ASCII characters without spaces "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')",
            key=what,
        )
    return token


def read_token_file(path: str) -> str:
    """The token in file ``path`` (surrounding whitespace removed); ConfigError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the token file {path!r}: {err}", key="token_file") from None
    return check_token(text, f"token_file ({path})")


def resolve_token(
    token: str | None = None,
    token_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The token to use: ``token``, else the contents of ``token_file``, else ``FLEET_PS_TOKEN``
    from the environment, else None (no token)."""
    if token is not None:
        return check_token(token, "token")
    if token_file:
        return read_token_file(token_file)
    raw = (os.environ if environ is None else environ).get(TOKEN_ENV, "")
    return check_token(raw, TOKEN_ENV) if raw else None


def insecure_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FLEET_PS_INSECURE=1`` is set."""
    return (os.environ if environ is None else environ).get(INSECURE_ENV, "") == "1"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); False for anything
    else, including 0.0.0.0 / :: (every interface) and host names."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_allowed(host: str, has_token: bool, insecure: bool) -> None:
    """ConfigError before binding a non-loopback ``host`` without a token, unless ``insecure``."""
    if has_token or insecure or is_loopback(host):
        return
    raise ConfigError(
        f"refusing to serve on {host} without a token: anyone who can reach the port could "
        "stop the server, drop rows or write checkpoints. Give the job's token (--token_file "
        f"PATH or {TOKEN_ENV}; fleetrun does this for its jobs), bind 127.0.0.1, or pass "
        f"--insecure ({INSECURE_ENV}=1, PSServer(insecure=True)) to serve without one",
        key="insecure",
    )


class _RefusalLog:
    """Counts refusals and logs them at most every :data:`LOG_EVERY_S` seconds."""

    def __init__(self, server_index: int) -> None:
        self.server_index = server_index
        self._lock = threading.Lock()
        self._since = 0
        self._next = 0.0

    def add(self, op: str, cause: str, peer: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._since += 1
            if now < self._next:
                return
            count, self._since, self._next = self._since, 0, now + LOG_EVERY_S
        logger.warning(
            "server %d refused %d call(s) without the job's token (latest: %s from %s, %s)",
            self.server_index,
            count,
            op,
            peer or "?",
            cause.replace("_", " "),
        )


class TokenInterceptor(grpc.ServerInterceptor):
    """Admit a call only with the job's token in its metadata (health checks: always)."""

    def __init__(
        self,
        token: str,
        server_index: int = 0,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_refused(op, cause)`` is called for each refusal (the server counts it)."""
        self._token = check_token(token, "token").encode("ascii")
        self._on_refused = on_refused
        self._log = _RefusalLog(server_index)

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        method = handler_call_details.method
        sent = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == METADATA_KEY:
                sent = value
                break
        if isinstance(sent, str):
            sent = sent.encode("ascii", "replace")
        if sent is not None and hmac.compare_digest(sent, self._token):
            return continuation(handler_call_details)
        if method.startswith(OPEN_SERVICES):
            return continuation(handler_call_details)
        return self._refuse(method, "missing_token" if sent is None else "wrong_token")

    def _refuse(self, method: str, cause: str) -> Any:
        op = _OPS.get(method, "unknown")
        telemetry.AUTH_FAILURES.labels(op=op, cause=cause).inc()
        if self._on_refused is not None:
            self._on_refused(op, cause)
        err = AuthError(
            f"{op}: {'no' if cause == 'missing_token' else 'wrong'} token; this parameter server "
            "admits only the processes of its job (PSClient(token=...) or "
            f"{TOKEN_ENV}, as fleetrun sets it)"
        )
        code, details = status_of(err), str(err)

        def refuse(request: Any, context: grpc.ServicerContext) -> None:
            self._log.add(op, cause, context.peer())
            context.abort(code, details)

        # no deserializer: the refused request's bytes are never parsed
        return grpc.unary_unary_rpc_method_handler(refuse)


__all__ = [
    "INSECURE_ENV",
    "METADATA_KEY",
    "OPEN_SERVICES",
    "TOKEN_ENV",
    "TokenInterceptor",
    "check_bind_allowed",
    "check_token",
    "insecure_from_env",
    "is_loopback",
    "read_token_file",
    "resolve_token",
]
