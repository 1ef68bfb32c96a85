"""The wire protocol between PS trainers and their coordinator (standard library only).

A PS job with automatic checkpoints in async or GEO mode lets one dead trainer be restarted
alone while the others go on. Its trainers then form no gloo group (a gloo group cannot admit a
replacement, and its store lives in trainer 0); they meet through a coordinator that fleetrun's
agent hosts (``launcher.recovery.coordinator``, the server; ``fleet.base.coordination``, the trainers'
client). Both import this module: the launcher may not import fleet, and fleet may not import
the launcher.

Transport: :mod:`multiprocessing.connection` over TCP (127.0.0.1 locally; the Ray driver's node IP
on Ray; the coordinator pod's address on Kubernetes), authenticated by the job's token (FLEET_PS_TOKEN) with its HMAC
challenge in both directions, done by the server on the connection's own thread (a client that
never answers blocks nobody). A message is a JSON header (:func:`send`, :func:`recv`) followed by
``header["n"]`` raw byte strings. The coordinator never unpickles anything: a round's payloads
are opaque bytes that the trainers pickle and unpickle among themselves (peers authenticated by
the token, as :mod:`multiprocessing` itself trusts).

Operations (``op`` of a request; every reply has ``ok`` and, when false, ``error``):

- ``hello`` {rank, world, attempt}: refused when the attempt is not the coordinator's (a stale
  trainer of an earlier attempt).
- ``round`` {channel, seq, kind, rank, position} + 1 payload: round ``seq`` of ``channel``; the
  reply, once every trainer contributed (or at once when it had completed before: a replay), is
  {replayed, ranks} + one payload per rank of ``ranks``.
- ``ckpt_wait`` {rank, after, position}: a checkpoint member waits (up to
  :data:`POLL_S`) for an epoch newer than ``after``; reply {epoch}.
- ``ckpt_cut`` {rank, epoch, position}: take part in epoch ``epoch``'s cut; reply {taken,
  leader, positions: {rank: position}} once every member of the epoch is in (or gone, or busy in
  another round, or :data:`CUT_WAIT_S` passed).
- ``ckpt_done`` {rank, epoch, outcome}: the epoch's leader reports its snapshot
  (``["ok", info]`` / ``["error", text]``); ``ckpt_result`` {rank, epoch} waits for it.
- ``ckpt_leave`` {rank}: a trainer stops taking part in checkpoints (its training ended).
- ``restart_alone`` {rank, attempt, position}: a Kubernetes trainer pod whose trainer died asks
  whether it may restart it alone (``launcher.schedulers.k8s.ps_recovery``); reply {granted,
  why}: granted when the coordinator greeted that trainer in this attempt (holds its rounds).
"""

from __future__ import annotations

import json
import socket
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

POLL_S = 0.5
"""Longest a ``ckpt_wait`` blocks before answering with the current epoch."""
CUT_WAIT_S = 20.0
"""Longest an epoch's cut waits for a member that neither arrives nor leaves; it then completes
without it (that trainer's last reported position stands for it)."""
CONNECT_TIMEOUT_S = 30.0
"""How long a trainer tries to reach the coordinator."""
BARRIER_CHANNEL = "half-async"
"""The channel of half-async trainers' barriers (every ``barrier_interval`` steps): round ``seq``
is the barrier after the trainer's global step ``(seq + 1) * barrier_interval``, so a trainer
resumed at a data position meets the others at the same rounds; its completed rounds outlive a
restart of every process (:meth:`launcher.recovery.coordinator.Coordinator.reset`)."""


def send(
    conn: Connection, header: dict[str, Any], payloads: list[bytes] | tuple[bytes, ...] = ()
) -> None:
    """One message: the JSON header (with ``n`` = number of payloads), then the payloads."""
    conn.send_bytes(json.dumps({**header, "n": len(payloads)}).encode())
    for p in payloads:
        conn.send_bytes(p)


def recv(conn: Connection) -> tuple[dict[str, Any], list[bytes]]:
    """One message sent by :func:`send`."""
    header = json.loads(conn.recv_bytes().decode())
    if not isinstance(header, dict):
        raise ValueError("a coordination message header must be a JSON object")
    payloads = [conn.recv_bytes() for _ in range(int(header.get("n", 0)))]
    return header, payloads


def authenticate_server_side(conn: Connection, key: bytes) -> None:
    """The server's half of the mutual HMAC handshake (raises AuthenticationError)."""
    deliver_challenge(conn, key)
    answer_challenge(conn, key)


def connect(endpoint: str, key: bytes, timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
    """A connection to the coordinator at ``host:port``, authenticated with ``key``."""
    host, _, port = endpoint.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
    except BaseException:
        conn.close()
        raise
    return conn


__all__ = [
    "BARRIER_CHANNEL",
    "CONNECT_TIMEOUT_S",
    "CUT_WAIT_S",
    "POLL_S",
    "authenticate_server_side",
    "connect",
    "recv",
    "send",
]
