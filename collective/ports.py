"""Picking free TCP ports for the processes a launcher starts, and keeping picks apart.

:func:`find_free_port` is re-exported by :mod:`collective.env`, where the launcher's callers
have always found it. Standard library only.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time


def _ephemeral_range_start() -> int:
    """First port of the kernel's ephemeral range (outgoing connections take ports from it)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORT_CLAIM_S = 300.0
"""How long a port handed out by :func:`find_free_port` stays claimed on this machine: other
fleetrun processes (another job, another agent) skip it meanwhile, however late the process it
was meant for binds it."""


def _claim_dir() -> str | None:
    path = os.path.join(tempfile.gettempdir(), f"fleetrun-ports-{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path


def _claim(claims: str | None, port: int) -> bool:
    """Claim ``port`` for :data:`PORT_CLAIM_S` seconds: False while another claim on it is fresh.
    Without a claim directory every port is claimable (the bind check alone)."""
    if claims is None:
        return True
    path = os.path.join(claims, str(port))
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        pass
    except OSError:
        return True
    try:
        if time.time() - os.stat(path).st_mtime < PORT_CLAIM_S:
            return False
        os.utime(path)  # a stale claim: take it over
    except OSError:
        return False
    return True


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago.

    Picked at random from the 10000 ports below the kernel's ephemeral range where one is free
    (at most 64 tries), else by binding port 0: a port of the ephemeral range can be taken by any
    outgoing connection on the machine before the process it is meant for binds it (seen on a
    busy machine: a PS trainer binding its gloo store after ~15 s of imports found its port in
    use). A picked port is also claimed for :data:`PORT_CLAIM_S` seconds in a per-user directory
    under the system's temp dir, so no other pick on this machine — in this process or another
    fleetrun — hands it out again before its process has bound it (two jobs' launchers picking
    the same free port a moment apart was seen as "Address already in use" seconds later).
    System randomness, so seeded ``random`` in scripts cannot make processes pick alike."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    top = _ephemeral_range_start()
    low = max(1024, top - 10000)
    pick = random.SystemRandom()
    claims = _claim_dir()
    for _ in range(64 if top - low >= 1000 else 0):
        port = pick.randrange(low, top)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if _claim(claims, port):
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


__all__ = ["PORT_CLAIM_S", "find_free_port"]
