"""Test helpers for the gRPC parameter server: in-process servers on 127.0.0.1 (port 0), a
client to them, and ``python -m ps_server`` subprocesses. Imported by tests/test_ps_grpc*.py and
tests/test_ps_client*.py (they put tests/scripts on sys.path)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def cluster(
    num_servers: int = 1, client_kw: dict[str, Any] | None = None, **server_kw: Any
) -> Iterator[tuple[list[Any], Any]]:
    """``num_servers`` PSServers in this process and a PSClient to them; all stopped after."""
    from ps_server import PSClient, PSServer

    servers = [
        PSServer(server_index=i, num_servers=num_servers, grace_s=1.0, **server_kw)
        for i in range(num_servers)
    ]
    try:
        ports = [s.start() for s in servers]
        client = PSClient([f"127.0.0.1:{p}" for p in ports], **(client_kw or {"timeout_s": 20}))
        try:
            yield servers, client
        finally:
            client.close()
    finally:
        for s in servers:
            s.stop(grace_s=0.5)


def start_server_process(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 30.0
) -> tuple[subprocess.Popen, str]:
    """Start ``python -m ps_server ARGS`` and return it with the endpoint it prints."""
    full_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PADDLE_", "FLEET_", "TRAINING_ROLE", "POD_IP"))
    }
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "ps_server", *args],
        cwd=str(REPO),
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the first line, or '' if it exited
    if "serving on" not in line:
        stop_process(proc)
        _, err = proc.communicate(timeout=timeout_s)
        raise AssertionError(f"ps_server did not start (exit {proc.returncode}): {line!r}\n{err}")
    return proc, line.strip().rsplit(" ", 1)[-1]


def wait_exit(proc: subprocess.Popen, timeout_s: float = 20.0) -> int:
    """``proc``'s exit code once it exits; if it still runs after ``timeout_s``, its threads'
    stacks (SIGUSR1, which ``python -m ps_server`` answers with them) and its stderr go into the
    AssertionError, and the process is killed."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        stop_process(proc)
        _, err = proc.communicate(timeout=10)
        raise AssertionError(
            f"ps_server still ran {timeout_s:.0f}s after it was asked to stop; its stderr and "
            f"threads:\n{err[-12000:]}"
        ) from None


def stop_process(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s whole session if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
