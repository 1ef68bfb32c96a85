"""The ``/metrics`` HTTP servers of fleetrun's processes (launcher, trainers, parameter servers):
started and stopped here, so a process's exit does not wait on its metrics server.

``prometheus_client.start_http_server`` serves from a thread that checks for a shutdown request
only every half second; a plain ``shutdown()`` therefore adds up to 0.5 s to every process that
ends, the launcher included (on a trivial job, a sixth of launch-to-exit). :func:`stop_metrics`
asks for the shutdown and wakes the serving thread at once with a connection to its own port.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from prometheus_client import start_http_server

STOP_TIMEOUT_S = 2.0
"""How long :func:`stop_metrics` waits for the serving thread before closing the socket anyway."""


def serve_metrics(host: str = "127.0.0.1", port: int = 0) -> tuple[Any, int]:
    """Serve the default registry's ``/metrics`` on ``host:port`` (0: a free port) from a daemon
    thread; returns (server, bound port). OSError when the port cannot be bound."""
    httpd, _thread = start_http_server(port, addr=host)
    return httpd, int(httpd.server_port)


def _wake_address(httpd: Any) -> tuple[str, int]:
    host, port = httpd.server_address[:2]
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, int(port)


def stop_metrics(httpd: Any, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop a server of :func:`serve_metrics` and close its socket, at once: the shutdown request
    is made from a helper thread while connections to the server's own port wake its loop (one
    that arrives before the request is served as an ordinary request, and the next one wakes
    it again)."""
    stopper = threading.Thread(target=httpd.shutdown, name="metrics-http-stop", daemon=True)
    stopper.start()
    address = _wake_address(httpd)
    deadline = time.monotonic() + timeout_s
    while stopper.is_alive() and time.monotonic() < deadline:
        try:
            socket.create_connection(address, timeout=0.1).close()
        except OSError:
            pass
        stopper.join(0.02)
    httpd.server_close()


__all__ = ["STOP_TIMEOUT_S", "serve_metrics", "stop_metrics"]
