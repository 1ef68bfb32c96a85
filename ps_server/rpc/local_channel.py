"""Same-host request channel of the graph service: SampleNeighbors requests whose arrays travel
in a shared-memory segment (:mod:`ps_server.rpc.graph_shm`) are sent over a Unix socket instead
of gRPC.

Why: once the arrays are in a segment, what is left of a request is its fixed cost, and gRPC's
Python path costs a few hundred microseconds of CPU per call on each side (measured on 2 cores:
a 1-node SampleNeighbors took ~0.8 ms of server CPU and ~0.65 ms of client CPU), several times
the sampling of a small request. Over a Unix socket a call is one ``send`` and one ``recv`` on
each side, on a thread that stays with its connection.

Protocol:

1. The client asks the server for its channel with the graph service's ``LocalChannel`` call (a
   gRPC call like any other: it carries the job token). The server opens, on first use, a
   listening socket in Linux's abstract namespace (``\\0fleetps_<32 hex>``: nothing on disk) and
   answers its name and a random 16-byte key.
2. The client connects and sends the key (the name is visible to every process of the host,
   the key only to holders of the job token); a connection without it is closed.
3. A request is a 4-byte little-endian length and a graph-service frame; the reply a 1-byte
   status code (0: OK, else a ``grpc.StatusCode`` value), a 4-byte length and the reply frame
   (or the error's details). One call at a time per connection; the client keeps a connection
   per call in flight per server.

Only same-host requests that already use a segment take this path; a server that cannot open
a channel (not Linux, or another network namespace: the connect fails) gets gRPC, and so does a
call whose connection breaks (the client drops that server's connections and sends the call
again through gRPC: SampleNeighbors is idempotent).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable

import grpc

logger = logging.getLogger(__name__)

KEY_BYTES = 16
MAX_REQUEST_BYTES = 1 << 20
"""Largest request frame a listener reads (a segment request is a few hundred bytes)."""
_LEN = struct.Struct("<I")
_REPLY = struct.Struct("<BI")
CODE_OF_VALUE = {c.value[0]: c for c in grpc.StatusCode}
"""grpc.StatusCode by its number (the reply's status byte)."""

Serve = Callable[[bytes], tuple[grpc.StatusCode | None, bytes | str]]
"""One request frame -> (None, reply frame) or (status code, details)."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = sock.recv(n, socket.MSG_WAITALL)
    while len(data) < n:  # MSG_WAITALL may still return early (a signal)
        more = sock.recv(n - len(data), socket.MSG_WAITALL)
        if not more:
            raise ConnectionError(f"connection closed after {len(data)} of {n} bytes")
        data += more
    return data


# -- the server side ---------------------------------------------------------------------------
class LocalListener:
    """A server's listening socket; one thread per connection runs ``serve``."""

    def __init__(self, serve: Serve, name: str) -> None:
        self.serve = serve
        self.key = secrets.token_bytes(KEY_BYTES)
        self.name = f"fleetps_{secrets.token_hex(16)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            if not hmac.compare_digest(_recv_exact(conn, KEY_BYTES), self.key):
                logger.warning("local channel %s: a connection without the key, closed", self.name)
                return
            while True:
                (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
                if n > MAX_REQUEST_BYTES:
                    logger.warning("local channel %s: a %d-byte request, closed", self.name, n)
                    return
                code, out = self.serve(_recv_exact(conn, n))
                data = out.encode() if isinstance(out, str) else out
                value = 0 if code is None else code.value[0]
                conn.sendall(_REPLY.pack(value, len(data)) + data)
        except OSError:
            pass  # the client went away, or close()
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting and end every connection (their calls fail over to gRPC)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for s in (self._sock, *conns):
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
            except OSError:
                pass
        self._sock.close()


# -- the client side ---------------------------------------------------------------------------
class LocalChannels:
    """A client's connections to its servers' listeners: leased one per call in flight;
    servers without a channel are remembered and get gRPC from then on."""

    def __init__(self) -> None:
        self.addresses: dict[int, tuple[str, bytes]] = {}
        self.free: dict[int, list[socket.socket]] = {}
        self.off: set[int] = set()
        self.lock = threading.Lock()

    def lease(
        self, server: int, hello: Callable[[int], tuple[str, bytes] | None]
    ) -> socket.socket | None:
        """A connection to ``server`` (the first asks ``hello(server) -> (name, key)`` for the
        channel, None: the server has none); None when ``server`` gets gRPC."""
        with self.lock:
            if server in self.off:
                return None
            free = self.free.get(server)
            if free:
                return free.pop()
            address = self.addresses.get(server)
        if address is None:
            address = hello(server)
            with self.lock:
                if address is None:
                    self.off.add(server)
                    return None
                self.addresses[server] = address
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect("\0" + address[0])
            sock.sendall(address[1])
        except OSError as err:
            sock.close()
            logger.info("no local channel to server %d (%s): using gRPC", server, err)
            with self.lock:
                self.off.add(server)
            return None
        return sock

    def release(self, server: int, sock: socket.socket) -> None:
        """Give a connection back after its reply was read (closed if the channel was dropped)."""
        with self.lock:
            if server in self.addresses:
                self.free.setdefault(server, []).append(sock)
                return
        sock.close()

    def broken(self, server: int, sock: socket.socket, err: OSError) -> None:
        """Close ``sock``, which failed (``err``), and :meth:`drop` ``server``'s channel."""
        logger.info("local channel to server %d broke (%s): the call goes through gRPC", server,
                    err)  # fmt: skip
        sock.close()
        self.drop(server)

    def drop(self, server: int) -> None:
        """Close ``server``'s free connections and forget its channel (asked again next time)."""
        with self.lock:
            socks = self.free.pop(server, [])
            self.addresses.pop(server, None)
        for s in socks:
            s.close()

    def close(self) -> None:
        with self.lock:
            socks = [s for v in self.free.values() for s in v]
            self.free.clear()
            self.addresses.clear()
        for s in socks:
            s.close()


def send(sock: socket.socket, frame: bytes, timeout_s: float) -> None:
    """Send one request frame."""
    sock.settimeout(timeout_s)
    sock.sendall(_LEN.pack(len(frame)) + frame)


def receive(sock: socket.socket) -> tuple[grpc.StatusCode | None, bytes]:
    """The reply to the frame last sent: (None, reply frame) or (status code, details)."""
    value, n = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
    data = _recv_exact(sock, n)
    return (None if value == 0 else CODE_OF_VALUE.get(value, grpc.StatusCode.UNKNOWN)), data


__all__ = ["LocalChannels", "LocalListener", "receive", "send"]
