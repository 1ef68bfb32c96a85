"""One worker process: start it in its own process group, pump its output, stop it.

Why not ``torch.distributed.elastic.multiprocessing``: the launcher must not import torch on the
single-node path (CLI start and launch-to-exit time), and we want pidfd-driven exit detection
(no polling interval between a rank's death and the teardown).

Orphan safety, in layers:
1. each worker leads its own process group, so ``killpg`` reaches everything it forked;
2. ``PR_SET_PDEATHSIG=SIGKILL`` kills a worker if fleetrun itself dies (even by SIGKILL);
3. teardown kills every group, and its stragglers, after the worker exits.

A :class:`~launcher.warm.WarmPool` given to :class:`WorkerProcess` forks Python workers from the
job's warm process instead (the same three layers hold: the forked worker leads its own session,
dies with fleetrun, and is this process's child); anything it cannot serve starts afresh.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from launcher.warm import WarmChild, WarmPool, WarmStartError

_PR_SET_PDEATHSIG = 1


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass  # not Linux: layers 1 and 3 still apply


def signal_name(sig: int) -> str:
    """``SIGKILL`` for 9, or ``signal 42`` for unnamed ones."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


@dataclass(frozen=True)
class ExitInfo:
    """How a worker ended."""

    returncode: int
    """Popen-style: >= 0 exit code, < 0 killed by signal -returncode."""
    time: float
    """Wall-clock time the exit was observed (time.time())."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        """``exit code 3`` or ``signal SIGKILL (9)``."""
        if self.returncode < 0:
            return f"signal {signal_name(-self.returncode)} ({-self.returncode})"
        return f"exit code {self.returncode}"


class ConsoleWriter:
    """Serialises console lines from several pump threads."""

    def __init__(self, stream: BinaryIO | None = None) -> None:
        self._stream = stream or sys.stdout.buffer
        self._lock = threading.Lock()

    def write(self, prefix: bytes, line: bytes) -> None:
        with self._lock:
            try:
                self._stream.write(prefix + line)
                self._stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # console went away; the log file still has everything


class WorkerProcess:
    """A started worker: pid, log file, exit detection and teardown."""

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        log_path: str,
        console: ConsoleWriter | None,
        console_prefix: bytes = b"",
        header: str = "",
        append: bool = False,
        warm: WarmPool | None = None,
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.start_time = time.time()
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        # A new job starts its log afresh; a restart appends below the previous attempt.
        self._log = open(log_path, "ab" if append else "wb", buffering=0)  # noqa: SIM115
        if header:
            self._log.write(header.encode())
        self.proc: subprocess.Popen[bytes] | WarmChild | None = None
        self.warm = False
        if warm is not None and warm.usable(self.argv):
            try:
                self.proc = warm.spawn(self.argv, env, os.getcwd())
                self.warm = True
            except WarmStartError as err:
                warm.fall_back(str(err))
        if self.proc is None:
            self.proc = subprocess.Popen(
                self.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_set_pdeathsig,  # noqa: PLW1509 - only prctl, async-signal-safe
            )
        self.pid = self.proc.pid
        self.exit: ExitInfo | None = None
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self._pidfd = None
        self._pump = threading.Thread(
            target=self._pump_output,
            args=(console, console_prefix),
            daemon=True,
            name=f"pump-{self.pid}",
        )
        self._pump.start()

    @property
    def pidfd(self) -> int | None:
        """A file descriptor that becomes readable when the process exits (Linux >= 5.3)."""
        return self._pidfd

    def _pump_output(self, console: ConsoleWriter | None, prefix: bytes) -> None:
        assert self.proc.stdout is not None
        try:
            for line in iter(self.proc.stdout.readline, b""):
                self._log.write(line)
                if console is not None:
                    console.write(prefix, line)
        except (OSError, ValueError):
            pass
        finally:
            self._log.close()

    def poll(self) -> ExitInfo | None:
        """The exit, once it happened (reaps the process)."""
        if self.exit is None:
            rc = self.proc.poll()
            if rc is not None:
                self.exit = ExitInfo(rc, time.time())
                self._close_pidfd()
        return self.exit

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's whole process group (it leads its own session)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait_output(self, timeout: float) -> None:
        """Wait (bounded) for the output pump to reach EOF, so logs are complete."""
        self._pump.join(timeout)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def wait_any(workers: Sequence[WorkerProcess], timeout: float) -> list[WorkerProcess]:
    """Block up to ``timeout`` s until at least one running worker exits; return those that did.

    Uses pidfds (no polling latency); without them falls back to 50 ms polling. A worker whose
    exit this call is the first to see (it exited after the caller last looked) returns at
    once: blocking on the others would miss it (an all-trainers-done check would wait for the
    servers instead).
    """
    seen = {id(w) for w in workers if w.exit is not None}
    running = [w for w in workers if w.poll() is None]
    done = [w for w in workers if w.exit is not None]
    if not running or any(id(w) not in seen for w in done):
        return done
    fds = {w.pidfd: w for w in running if w.pidfd is not None}
    if len(fds) == len(running):
        with selectors.DefaultSelector() as sel:
            for fd, w in fds.items():
                sel.register(fd, selectors.EVENT_READ, w)
            sel.select(timeout)
    else:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and all(w.poll() is None for w in running):
            time.sleep(0.05)
    return [w for w in workers if w.poll() is not None]


def terminate_all(workers: Sequence[WorkerProcess], grace_s: float) -> None:
    """SIGTERM every worker group, SIGKILL what is left after ``grace_s``, reap all, kill
    stragglers of exited workers' groups, and let the log pumps finish."""
    alive = [w for w in workers if w.poll() is None]
    for w in alive:
        w.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        wait_any(alive, min(0.2, max(deadline - time.monotonic(), 0.0)))
        alive = [w for w in alive if w.poll() is None]
    for w in workers:
        w.signal_group(signal.SIGKILL)  # the worker if still alive, and any stray children
    for w in workers:
        if w.poll() is None:
            w.proc.wait()
            w.poll()
    for w in workers:
        w.wait_output(2.0)
