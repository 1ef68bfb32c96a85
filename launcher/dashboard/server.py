"""The dashboard's HTTP server (stdlib ``ThreadingHTTPServer`` on 127.0.0.1).

Routes::

    GET /                     the page (HTML + a small hand-written SVG renderer, no CDN)
    GET /api/state            Monitor.snapshot() as JSON (the page polls it every second)
    GET /logs/<role>/<rank>   that process's log, only when job_state.json lists it (no paths
                              from the request are ever opened); the last max_log_bytes
    GET /healthz              {"status": "ok", ...}

The stdlib server is enough here: one local user, a JSON poll per second. Why not a framework:
nothing to install, nothing to build, and no torch import (the launcher's CLI rule).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from collective.errors import LaunchError
from launcher.dashboard.config import DEFAULT_PORT, DashboardConfig
from launcher.dashboard.monitor import Monitor
from launcher.dashboard.page import PAGE_HTML

logger = logging.getLogger(__name__)


def read_tail(path: str, max_bytes: int) -> bytes:
    """The last ``max_bytes`` of a file (a note first when it was cut)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        data = f.read()
    if size > max_bytes:
        data = (
            f"[fleetrun dashboard: showing the last {max_bytes} of {size} bytes of {path}]\n".encode()
            + data
        )
    return data


def make_handler(monitor: Monitor) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to ``monitor``."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "fleetrun-dashboard"

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s " + format, self.address_string(), *args)

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, data: Any) -> None:
            self._send(
                status, json.dumps(data, allow_nan=False, default=str).encode(), "application/json"
            )

        def _text(self, status: int, text: str) -> None:
            self._send(status, text.encode(), "text/plain; charset=utf-8")

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, PAGE_HTML.encode(), "text/html; charset=utf-8")
            elif path == "/api/state":
                self._json(HTTPStatus.OK, monitor.snapshot())
            elif path == "/healthz":
                self._json(
                    HTTPStatus.OK,
                    {
                        "status": "ok",
                        "log_dir": monitor.log_dir,
                        "polls": monitor.polls,
                        "last_poll": monitor.last_poll,
                        "job_state_found": monitor.job is not None,
                    },
                )
            elif path.startswith("/logs/"):
                self._log(path)
            else:
                self._text(HTTPStatus.NOT_FOUND, f"no such page: {path}\n")

        def _log(self, path: str) -> None:
            parts = [unquote(p) for p in path.split("/")[2:]]
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                self._text(HTTPStatus.NOT_FOUND, "log links are /logs/<role>/<rank>\n")
                return
            role, rank = parts[0], int(parts[1])
            listed = [
                t.info.get("log") for t in monitor.targets if t.role == role and t.rank == rank
            ]
            log = next((p for p in listed if isinstance(p, str) and p), None)
            if log is None:
                self._text(
                    HTTPStatus.NOT_FOUND,
                    f"job_state.json lists no log for {role} {rank} in {monitor.log_dir}\n",
                )
                return
            try:
                data = read_tail(log, monitor.config.max_log_bytes)
            except OSError as err:
                self._text(HTTPStatus.NOT_FOUND, f"cannot read {log}: {err.strerror}\n")
                return
            self._send(HTTPStatus.OK, data, "text/plain; charset=utf-8")

    return Handler


def bind(config: DashboardConfig, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """The listening server: ``config.port``; with no port, DEFAULT_PORT or else a free one."""
    ports = [config.port] if config.port is not None else [DEFAULT_PORT, 0]
    for i, port in enumerate(ports):
        try:
            server = ThreadingHTTPServer((config.host, port), handler)
            server.daemon_threads = True
            return server
        except OSError as err:
            if err.errno == errno.EADDRINUSE and i + 1 < len(ports):
                logger.info("dashboard port %d is busy; taking a free one", port)
                continue
            raise LaunchError(
                f"the dashboard cannot listen on {config.host}:{port} ({err.strerror}); "
                "pass another --port, or --port 0 for any free one"
            ) from None
    raise AssertionError("unreachable")


class Dashboard:
    """A running dashboard: the poller thread and the HTTP server thread."""

    def __init__(self, config: DashboardConfig) -> None:
        self.config = config
        self.monitor = Monitor(config)
        self.server = bind(config, make_handler(self.monitor))
        host, port = self.server.server_address[:2]
        self.url = f"http://{host}:{port}/"
        self._threads: list[threading.Thread] = []

    def start(self) -> Dashboard:
        """Start polling and serving in daemon threads; returns self."""
        self.monitor.poll_once()  # the first page load already has the job state
        for name, target in (
            ("dashboard-poll", self.monitor.run),
            ("dashboard-http", self.server.serve_forever),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        """Stop serving and polling; join the threads (bounded)."""
        self.monitor.stop()
        if self._threads:  # serve_forever runs: shutdown() waits for it to return
            self.server.shutdown()
        self.server.server_close()
        deadline = time.monotonic() + 5.0
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.monitor.close()
