"""The Ray actor that runs one trainer or parameter server of a job as a child process.

The actor is a plain class here; :func:`launcher.schedulers.ray.job` wraps it with
``ray.remote(max_concurrency=...)`` at run time (this module does not import ray, so the class is
unit-testable without a cluster). Per attempt and per process one actor, in its placement-group
bundle:

* :meth:`ProcessActor.info` — where it landed (node IP, node id, host name, GPU ids);
* :meth:`ProcessActor.free_port` / :meth:`ProcessActor.free_ports` — free ports on its node
  (rendezvous/endpoints, and the process's ``/metrics``); :meth:`ProcessActor.port_free` —
  whether a given one is (a PS server re-created alone takes its previous port);
* :meth:`ProcessActor.start` — the user's command (``launcher.attempt.worker_argv``: through
  ``collective.bootstrap``, so an uncaught exception lands in the error file) with the env the
  driver built from ``collective.env``; the child runs in its own session with
  ``PR_SET_PDEATHSIG`` (``launcher.process.WorkerProcess``), so it dies with the actor;
* :meth:`ProcessActor.poll` — long poll: the output lines since the last call, and the exit once
  it happened (with the error file's text), which the driver writes to ``log_dir`` and the console;
* :meth:`ProcessActor.stop` — SIGTERM the child's process group, SIGKILL after the grace period.

With warm starts (``warm_start: on``) the first ``start`` also starts the actor's warm process
(:class:`launcher.warm.WarmPool`, killed with the actor) and forks the child from it; a child
restarted in the same actor (a PS server or trainer restarted alone) is forked from it again,
with every import already done.

The driver calls ``poll`` and ``stop`` concurrently: the actor is threaded (``max_concurrency``).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from collective.env import find_free_port
from launcher.process import ConsoleWriter, WorkerProcess, terminate_all
from launcher.warm import WarmPool
from launcher.warm import supported as warm_supported

MAX_CHUNK_BYTES = 1 << 20
"""At most this much output per poll reply (the rest comes with the next poll)."""


@dataclass(frozen=True)
class ActorInfo:
    """Where an actor runs."""

    node_ip: str
    node_id: str
    hostname: str
    gpu_ids: tuple[str, ...]
    pid: int


@dataclass(frozen=True)
class WarmRequest:
    """Fork the actor's child from a warm process (the job's ``warm_start: on``)."""

    log_path: str
    """The warm process's log (``log_dir/warmlog.<role><rank>``)."""
    imports: tuple[str, ...] = ()
    """The job's ``warm_imports``."""


@dataclass(frozen=True)
class PollReply:
    """One long-poll answer: new output, and the exit once the child is gone."""

    output: bytes
    returncode: int | None
    """None while running; Popen-style (< 0 = killed by signal) once exited."""
    exit_desc: str
    exit_time: float
    pid: int
    error_text: str | None
    """Contents of the error file the bootstrap wrote, if any (after the exit)."""


class _Buffer:
    """A ``BinaryIO``-enough sink for :class:`ConsoleWriter`: collects lines, wakes pollers."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        with self.cond:
            self.chunks.append(data)
            self.cond.notify_all()
        return len(data)

    def flush(self) -> None:
        return None

    def take(self) -> bytes:
        out, size = [], 0
        while self.chunks and size < MAX_CHUNK_BYTES:
            chunk = self.chunks.pop(0)
            out.append(chunk)
            size += len(chunk)
        return b"".join(out)


class ProcessActor:
    """Runs one process of the job (see the module docstring)."""

    def __init__(self) -> None:
        self._proc: WorkerProcess | None = None
        self._buf = _Buffer()
        self._error_file: str | None = None
        self._warm: WarmPool | None = None

    def info(self) -> ActorInfo:
        """Node IP / id / host name / GPU ids of this actor."""
        import ray

        ctx = ray.get_runtime_context()
        gpus = tuple(str(g) for g in ctx.get_accelerator_ids().get("GPU", []))
        return ActorInfo(
            ray.util.get_node_ip_address(),
            ctx.get_node_id(),
            socket.gethostname(),
            gpus,
            os.getpid(),
        )

    def free_port(self, host: str) -> int:
        """A TCP port free on ``host`` (this node's address) a moment ago."""
        return find_free_port(host)

    def free_ports(self, host: str, count: int) -> list[int]:
        """``count`` distinct TCP ports free on ``host`` a moment ago (all bound at once, so
        they differ from each other)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        socks = [socket.socket(family, socket.SOCK_STREAM) for _ in range(count)]
        try:
            for sock in socks:
                sock.bind((host, 0))
            return [int(sock.getsockname()[1]) for sock in socks]
        finally:
            for sock in socks:
                sock.close()

    def port_free(self, host: str, port: int, wait_s: float = 0.0) -> bool:
        """Whether ``port`` can be bound on ``host``, trying for up to ``wait_s`` seconds (a
        server restarted alone needs its previous port, which its dead predecessor may hold for
        a moment: the trainers' endpoints do not change)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        deadline = time.monotonic() + wait_s
        while True:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((host, port))
                    return True
                except OSError:
                    if time.monotonic() >= deadline:
                        return False
            time.sleep(0.2)

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        driver_python: str,
        warm: WarmRequest | None = None,
    ) -> int:
        """Start the child; return its pid. ``env`` holds the job's variables (spec env and the
        contract), laid over this actor's own environment. ``warm``: fork it from this actor's
        warm process (started by the first such call; a child restarted in this actor later
        finds every import done)."""
        if argv and argv[0] == driver_python:
            argv = [sys.executable, *argv[1:]]  # this node's interpreter (same venv on one node)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        full_env.update(env)
        self._error_file = env.get("FLEET_ERROR_FILE")
        if self._error_file:
            os.makedirs(os.path.dirname(self._error_file), exist_ok=True)
            if os.path.exists(self._error_file):
                os.remove(self._error_file)
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)  # relative script paths resolve as on the driver's machine
        if warm is not None and self._warm is None and warm_supported()[0]:
            self._warm = WarmPool(full_env, warm.log_path, warm.imports)
        pool = self._warm if warm is not None else None
        self._proc = WorkerProcess(argv, full_env, os.devnull, ConsoleWriter(self._buf), warm=pool)  # type: ignore[arg-type]
        return self._proc.pid

    def poll(self, timeout_s: float) -> PollReply:
        """Output since the last poll, waiting up to ``timeout_s`` for some (or the exit)."""
        proc = self._proc
        assert proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        with self._buf.cond:
            while not self._buf.chunks and proc.poll() is None and time.monotonic() < deadline:
                self._buf.cond.wait(min(0.05, max(deadline - time.monotonic(), 0.0)))
        exit_info = proc.poll()
        if exit_info is not None:
            proc.wait_output(2.0)  # the pump read everything the child wrote
        with self._buf.cond:
            data = self._buf.take()
            more = bool(self._buf.chunks)
        if exit_info is None or more:
            return PollReply(data, None, "", 0.0, proc.pid, None)
        return PollReply(
            data,
            exit_info.returncode,
            exit_info.describe(),
            exit_info.time,
            proc.pid,
            self._read_error_file(),
        )

    def _read_error_file(self) -> str | None:
        if not self._error_file or not os.path.exists(self._error_file):
            return None
        try:
            with open(self._error_file, encoding="utf-8") as f:
                return f.read()
        except OSError:
            return None

    def stop(self, grace_s: float) -> None:
        """SIGTERM the child's group, SIGKILL after ``grace_s``; reap it (idempotent)."""
        if self._proc is not None:
            terminate_all([self._proc], grace_s)
