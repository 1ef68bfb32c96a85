"""The ``/metrics`` servers' start and stop (collective.metrics_http): a stop closes the port and
ends the serving thread without waiting for its poll interval, also while it serves a scrape."""

from __future__ import annotations

import socket
import threading
import urllib.request

import pytest

from collective.metrics_http import serve_metrics, stop_metrics


def _serving_threads() -> set[int]:
    return {
        t.ident
        for t in threading.enumerate()
        if t.ident is not None and "serve_forever" in repr(getattr(t, "_target", None))
    }


@pytest.mark.timeout(30)
def test_stop_closes_the_port_and_ends_the_thread() -> None:
    before = _serving_threads()
    httpd, port = serve_metrics("127.0.0.1", 0)
    mine = _serving_threads() - before
    assert len(mine) == 1
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200 and b"python_info" in reply.read()
    stop_metrics(httpd)
    assert not (_serving_threads() & mine)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


@pytest.mark.timeout(30)
def test_stop_while_a_client_holds_a_connection_open() -> None:
    httpd, port = serve_metrics("127.0.0.1", 0)
    idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # a scraper that never sends
    try:
        stop_metrics(httpd)
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        idle.close()


@pytest.mark.timeout(30)
def test_a_busy_port_is_an_oserror() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(OSError):
            serve_metrics("127.0.0.1", sock.getsockname()[1])
