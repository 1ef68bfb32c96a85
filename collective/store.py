"""A torch TCPStore whose server listens only on the address it is given.

torch's TCPStore server binds every interface (``*:port``). Jobs on one machine must stay on
loopback, and a cluster job should listen only on the rendezvous address, so the master side
binds the socket itself and hands it to the store (``master_listen_fd``).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

from torch.distributed import TCPStore

_LISTENERS: list[socket.socket] = []
"""Sockets handed to live store servers; they must stay open as long as the process runs."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 = any free one). OSError when busy."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def make_store(host: str, port: int, is_master: bool, timeout_s: float) -> Any:
    """Server (``is_master``) or client of a TCPStore at ``host:port``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return TCPStore(host, port, None, False, timeout)
    sock = bind_listener(host, port)
    store = TCPStore(
        host,
        sock.getsockname()[1],
        None,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    _LISTENERS.append(sock)
    return store
