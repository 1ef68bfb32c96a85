"""Whether another agent's process is gone, without waiting for its heartbeats to lapse.

Every elastic agent listens on a small TCP socket (:class:`LivenessListener`, port 0 on its node
address) for its whole life and publishes the port in its round record
(:class:`launcher.elastic.membership.NodeRecord`). A connection to that port answers three ways:

* accepted — the agent process is alive (maybe busy: nothing is read or written);
* refused — the host answered with a reset: nothing listens on the port any more, so the agent
  process that held it has exited (killed, crashed). This is proof, and only this drops a node
  early (:func:`launcher.elastic.rdzv.drop_dead_nodes`);
* no answer within the timeout, or any other error — a machine powered off, a network cut: we
  know nothing, and torch's heartbeat window decides as before.

A firewall that answers every unknown port with a reset would make a live node look dead, so a
node counts as dead only when its port was seen accepting earlier (:class:`LivenessTracker`
probes every member once when a round forms). Standard library only.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from collective.env import StrEnum

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.5
"""How long one probe waits for an answer before it says :attr:`Liveness.UNKNOWN`."""


class Liveness(StrEnum):
    """What one probe of an agent's liveness port found."""

    ALIVE = "alive"
    """The connection was accepted."""
    DEAD = "dead"
    """The connection was refused: the agent process is gone."""
    UNKNOWN = "unknown"
    """No answer in time, or another error: leave it to the heartbeats."""


class LivenessListener:
    """A listening socket that accepts and closes connections on a daemon thread, until
    :meth:`close` or the process exits (the kernel then refuses connections to its port)."""

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="fleetrun-liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            conn.close()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> Liveness:
    """One connection attempt to ``host:port`` (see :class:`Liveness`)."""
    if not port:
        return Liveness.UNKNOWN
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return Liveness.ALIVE
    except ConnectionRefusedError:
        return Liveness.DEAD
    except OSError as err:
        if err.errno == errno.ECONNREFUSED:
            return Liveness.DEAD
        return Liveness.UNKNOWN


def probe_all(
    targets: Iterable[tuple[str, str, int]], timeout_s: float = PROBE_TIMEOUT_S
) -> dict[str, Liveness]:
    """``{name: Liveness}`` for ``(name, host, port)`` targets, probed in parallel."""
    items = list(targets)
    if not items:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        found = pool.map(lambda t: probe(t[1], t[2], timeout_s), items)
        return {name: result for (name, _, _), result in zip(items, found, strict=True)}


class LivenessTracker:
    """Which members' liveness ports were seen accepting (checked once per round, off the
    agent's main thread), so that a refusal later proves a death rather than a firewall."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def check_in_background(self, targets: Iterable[tuple[str, str, int]]) -> None:
        """Probe ``(name, host, port)`` targets on a daemon thread; remember the ones alive."""
        items = [t for t in targets if t[2] and t[0] not in self.seen()]
        if not items:
            return

        def run() -> None:
            found = probe_all(items)
            with self._lock:
                self._seen.update(n for n, r in found.items() if r is Liveness.ALIVE)

        threading.Thread(target=run, name="fleetrun-liveness-check", daemon=True).start()

    def seen(self) -> set[str]:
        with self._lock:
            return set(self._seen)

    def proven_dead(self, targets: Iterable[tuple[str, str, int]]) -> list[str]:
        """Names among ``(name, host, port)`` targets that were seen accepting and now refuse."""
        seen = self.seen()
        items = [t for t in targets if t[0] in seen]
        found = probe_all(items)
        return [name for name, result in found.items() if result is Liveness.DEAD]


__all__ = [
    "PROBE_TIMEOUT_S",
    "Liveness",
    "LivenessListener",
    "LivenessTracker",
    "probe",
    "probe_all",
]
