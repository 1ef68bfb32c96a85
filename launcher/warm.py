"""Warm starts: the agent's side of :mod:`collective.zygote`.

:class:`WarmPool` starts the job's warm process once (``python -u -m collective.zygote``, in its own
session, killed with the agent by ``PR_SET_PDEATHSIG``); it imports torch while the agent goes
on setting the job up, then ``torch._dynamo``, fleet, the PS client and the job's
``warm_imports:`` whenever it is not forking.
:meth:`WarmPool.spawn` asks it for a worker: this process becomes a child subreaper for the
moment of the request, so the forked worker (whose intermediate parent exits at once) is adopted
here, and :class:`WarmChild` waits for it, reads its exit status and its pidfd as
``subprocess.Popen`` would for a worker started afresh. :class:`launcher.process.WorkerProcess`
uses the pool for Python entry points (``python -u -m collective.bootstrap ...``) and starts
everything else as before.

When the warm process cannot serve (it failed to start or import, died, or the platform has no
``fork``/``SCM_RIGHTS``), workers start afresh and the console says so once.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from collective.errors import LaunchError
from collective.zygote import ENV_AREA_BYTES, ENV_AREA_VAR, recv_message, send_message

logger = logging.getLogger(__name__)

DEFAULT_IMPORTS: tuple[str, ...] = ("numpy", "torch", "torch.distributed", "collective")
"""What every warm process imports before it forks the first worker (and, when a node's first
attempt runs more workers than the process may use cores, the later imports too: those workers'
own imports of them would queue for the cores, each paying its own copy in memory)."""
LATER_IMPORTS: tuple[str, ...] = ("torch._dynamo", "fleet", "ps_server.client")
"""What it imports next, while no worker is asked for, before the job's ``warm_imports:``
(``torch._dynamo`` is the second the first construction of any ``torch.optim`` optimizer
costs). A job's first workers are forked without waiting for them; restarts find them in."""
READY_TIMEOUT_S = 120.0
"""How long the first spawn waits for the warm process's imports before starting afresh."""
REQUEST_TIMEOUT_S = 30.0
"""How long one spawn request may take beyond the later import the warm process may be in the
middle of (it answers once that import is done; the import may take the pool's ready timeout:
under load, a ``torch._dynamo`` import took over 30 s, which a fresh worker would pay too)."""
MAX_PENDING_BYTES = 1 << 20
"""Output of a warm process kept while it has no log file (beyond it, dropped)."""
BOOTSTRAP = ("-u", "-m", "collective.bootstrap")
"""The arguments after the interpreter that mark a Python entry point the pool can serve."""

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


class WarmStartError(LaunchError):
    """The warm process cannot start this worker (the caller starts it afresh)."""


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _set_pdeathsig() -> None:  # in the warm process between fork and exec
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Reap ``proc`` as soon as it exits (its pidfd; ``Popen.wait``'s polling back-off kept
    fleetrun waiting up to 15 ms longer at the end of every job)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (OSError, AttributeError):  # already reaped, or no pidfd here
        fd = -1
    try:
        if fd >= 0:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                sel.select(timeout_s)
        proc.wait(timeout=timeout_s if fd < 0 else 1.0)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if fd >= 0:
            os.close(fd)


def supported() -> tuple[bool, str]:
    """Whether this platform can fork workers from a warm process, and why not."""
    if not sys.platform.startswith("linux"):
        return False, f"warm starts need Linux (this is {sys.platform})"
    if not hasattr(os, "fork") or not hasattr(socket, "send_fds"):
        return False, "this Python has no fork or SCM_RIGHTS"
    return True, ""


class WarmChild:
    """The part of ``subprocess.Popen`` :class:`~launcher.process.WorkerProcess` uses, for a
    worker the warm process forked and this process adopted (so it is our child)."""

    def __init__(self, pid: int, stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    def _reaped(self, status: int) -> int:
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        """The Popen-style exit code once it exited (reaps it), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -int(signal.SIGKILL)  # reaped elsewhere: status unknown
                return self.returncode
            if pid:
                return self._reaped(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it exits (``timeout`` as ``Popen.wait``)."""
        if self.returncode is not None:
            return self.returncode
        if timeout is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                self.returncode = -int(signal.SIGKILL)
                return self.returncode
            return self._reaped(status)
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


def node_env(job_env: Mapping[str, str], nproc_here: int) -> dict[str, str]:
    """fleetrun's environment plus the job's ``env:``, for a node running ``nproc_here``
    processes (OMP_NUM_THREADS=1 when several share it, unless set)."""
    env = dict(os.environ)
    env.update(job_env)
    if nproc_here > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: N processes must not each take all cores
    return env


def import_plan(imports: Sequence[str], workers: int) -> tuple[list[str], list[str]]:
    """What a warm process imports before its first fork and what later, for a job's
    ``warm_imports`` and a node whose first attempt runs ``workers`` processes."""
    first = list(DEFAULT_IMPORTS)
    later = [*LATER_IMPORTS, *[m for m in imports if m not in (*DEFAULT_IMPORTS, *LATER_IMPORTS)]]
    if workers > len(os.sched_getaffinity(0)):  # crowded: the first workers' own imports
        return first + later, []  # would queue for the cores; import once, before forking
    return first, later


_EARLY: dict[str, WarmPool] = {}
"""Warm processes started before the job was set up, by log path, until an agent takes one."""
_BEGUN: list[WarmPool] = []
"""The warm process :mod:`launcher.prestart` began before the command line was read."""


def begin(env: dict[str, str], imports: Sequence[str], workers: int) -> WarmPool:
    """Start a warm process before the job is known (its output kept until a log file is
    given); :func:`take_begun` hands it to whoever checks it against the job."""
    pool = WarmPool(env, None, imports, workers=workers)
    _BEGUN.append(pool)
    return pool


def take_begun() -> WarmPool | None:
    """The warm process :func:`begin` started, if any (the caller adopts or closes it)."""
    return _BEGUN.pop() if _BEGUN else None


def keep_early(pool: WarmPool) -> None:
    """Hold ``pool`` (started early, writing to its log file) until :func:`take_early`."""
    _EARLY[os.path.abspath(pool.log_path)] = pool


def take_early(log_path: str) -> WarmPool | None:
    """The warm process kept for ``log_path`` (:func:`keep_early`), if any."""
    return _EARLY.pop(os.path.abspath(log_path), None)


def close_early() -> None:
    """Close the early warm processes no agent took (the launch stopped before its workers)."""
    while _BEGUN:
        _BEGUN.pop().close()
    while _EARLY:
        _EARLY.popitem()[1].close()


class WarmPool:
    """One warm process per job on this node (module docstring)."""

    def __init__(
        self,
        env: dict[str, str],
        log_path: str | None,
        imports: Sequence[str] = (),
        ready_timeout_s: float = READY_TIMEOUT_S,
        workers: int = 1,
    ) -> None:
        self.env = dict(env)
        self.imports, self.later = import_plan(imports, workers)
        self.ready_timeout_s = ready_timeout_s
        self.spawned = 0
        self.fallbacks = 0
        self.ready_info: dict[str, Any] | None = None
        self._down = ""  # why the pool cannot serve ("" while it can)
        self._said = False
        # an abstract socket: nothing on disk to leave behind when the agent is SIGKILLed; the
        # warm process serves only this process (it checks the peer's credentials)
        self.socket_name = f"fleetrun-warm-{os.getpid()}-{secrets.token_hex(8)}"
        self.log_path = ""
        self._log: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._pending = bytearray()  # its output before a log file is given (attach_log)
        self._pump: threading.Thread | None = None
        if log_path is not None:
            self._open_log(log_path)
        argv = [sys.executable, "-u", "-m", "collective.zygote", "--socket", "@" + self.socket_name]
        argv += ["--agent", str(os.getpid())]
        for name in self.imports:
            argv += ["--import", name]
        for name in self.later:
            argv += ["--later", name]
        self.proc = subprocess.Popen(
            argv,
            env={**self.env, ENV_AREA_VAR: "0" * ENV_AREA_BYTES},  # room for a worker's env
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log if self._log is not None else subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_set_pdeathsig,  # noqa: PLW1509 - only prctl, async-signal-safe
        )
        self.started = time.monotonic()
        if self._log is None:
            self._pump = threading.Thread(target=self._pump_output, daemon=True)
            self._pump.start()

    def _open_log(self, log_path: str) -> None:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._log.write(
            f"==== fleetrun: warm process, {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode()
        )

    def _pump_output(self) -> None:
        """The warm process's output, for a pool started before its log file was known."""
        assert self.proc.stderr is not None
        while chunk := self.proc.stderr.read1(65536):
            with self._lock:
                if self._log is not None:
                    self._log.write(chunk)
                elif len(self._pending) < MAX_PENDING_BYTES:
                    self._pending += chunk

    def attach_log(self, log_path: str) -> None:
        """Give a pool started without a log file its ``log_path`` (what it wrote so far first)."""
        with self._lock:
            if self._log is None:
                self._open_log(log_path)
                assert self._log is not None
                self._log.write(b"(started before fleetrun read its command line)\n")
                self._log.write(bytes(self._pending))
                self._pending.clear()

    def serves(self, env: dict[str, str], imports: Sequence[str], workers: int) -> bool:
        """Whether this pool is the one ``WarmPool(env, ..., imports, workers=workers)`` would
        start: the same environment and the same imports in the same order."""
        return self.env == env and (self.imports, self.later) == import_plan(imports, workers)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def usable(self, argv: Sequence[str]) -> bool:
        """Whether ``argv`` is a Python entry point the warm process can run (the interpreter
        the warm process runs, through collective.bootstrap)."""
        return (
            not self._down
            and len(argv) > len(BOOTSTRAP) + 1
            and argv[0] == sys.executable
            and tuple(argv[1 : 1 + len(BOOTSTRAP)]) == BOOTSTRAP
        )

    def _wait_ready(self) -> None:
        if self.ready_info is not None:
            if self.proc.poll() is not None:
                self._down = f"the warm process (pid {self.pid}) exited with {self.proc.returncode}"
                raise WarmStartError(self._down)
            return
        assert self.proc.stdout is not None
        deadline = self.started + self.ready_timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(max(0.0, deadline - time.monotonic())):
                self._down = f"the warm process was not ready after {self.ready_timeout_s:.0f} s"
                raise WarmStartError(self._down)
        line = self.proc.stdout.readline()
        try:
            info = json.loads(line)
        except ValueError:
            info = None
        if not isinstance(info, dict) or not info.get("ready"):
            self.proc.poll()
            self._down = (
                f"the warm process failed to start (exit {self.proc.returncode}); "
                f"see {self.log_path}"
            )
            raise WarmStartError(self._down)
        self.ready_info = info
        loaded = ", ".join(info.get("loaded") or [])
        self._note(f"ready in {info.get('seconds', 0):.2f} s; imported {loaded}\n")
        for name, why in (info.get("failed") or {}).items():
            logger.warning("fleetrun: warm start: could not preload %s (%s)", name, why)

    def _note(self, text: str) -> None:
        with self._lock:
            if self._log is not None:
                self._log.write(text.encode())
            else:
                self._pending += text.encode()

    def spawn(self, argv: Sequence[str], env: dict[str, str], cwd: str) -> WarmChild:
        """Fork a worker running ``argv`` (a :meth:`usable` one) with ``env`` in ``cwd``."""
        self._wait_ready()
        r, w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(REQUEST_TIMEOUT_S + self.ready_timeout_s)
                s.connect("\0" + self.socket_name)
                request = {"argv": list(argv[1 + len(BOOTSTRAP) :]), "env": env, "cwd": cwd}
                # adopt what the warm process forks while it answers (its intermediate exits)
                _prctl(_PR_SET_CHILD_SUBREAPER, 1)
                try:
                    send_message(s, request, [w])
                    reply, fds = recv_message(s)
                finally:
                    _prctl(_PR_SET_CHILD_SUBREAPER, 0)
                for fd in fds:
                    os.close(fd)
        except (OSError, ValueError) as err:
            os.close(r)
            self.proc.poll()
            if self.proc.returncode is not None:
                self._down = f"the warm process exited with {self.proc.returncode}"
            raise WarmStartError(f"the warm process did not answer: {err}") from None
        finally:
            os.close(w)
        if not isinstance(reply.get("pid"), int):
            os.close(r)
            raise WarmStartError(f"the warm process refused: {reply.get('error', reply)}")
        self.spawned += 1
        return WarmChild(int(reply["pid"]), os.fdopen(r, "rb"))

    def fall_back(self, why: str) -> None:
        """Note a worker started afresh; the console hears of it once per job."""
        self.fallbacks += 1
        if not self._said:
            self._said = True
            logger.warning("fleetrun: warm start unavailable, starting workers afresh: %s", why)

    def close(self, wait: bool = True) -> None:
        """Stop the warm process (workers it forked are not touched; its abstract socket goes
        with it). ``wait=False``, at the end of a job: send it SIGKILL and go on without
        waiting the ~20 ms the kernel takes to free its memory (this process's own exit
        overlaps it; nothing of it can run again)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if wait:
            _wait_exit(self.proc, 10.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._pump is not None and wait:
            self._pump.join(timeout=10)
        with self._lock:
            if self.proc.stderr is not None and wait:
                self.proc.stderr.close()
            if self._log is not None:
                self._log.close()
                self._log = None
                self._pending = bytearray()  # what a pump still reads goes nowhere


__all__ = [
    "BOOTSTRAP",
    "begin",
    "close_early",
    "import_plan",
    "keep_early",
    "node_env",
    "take_begun",
    "take_early",
    "DEFAULT_IMPORTS",
    "LATER_IMPORTS",
    "READY_TIMEOUT_S",
    "WarmChild",
    "WarmPool",
    "WarmStartError",
    "supported",
]
