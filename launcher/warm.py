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
import time
from collections.abc import Sequence
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


class WarmPool:
    """One warm process per job on this node (module docstring)."""

    def __init__(
        self,
        env: dict[str, str],
        log_path: str,
        imports: Sequence[str] = (),
        ready_timeout_s: float = READY_TIMEOUT_S,
        workers: int = 1,
    ) -> None:
        self.env = dict(env)
        self.imports = list(DEFAULT_IMPORTS)
        self.later = [
            *LATER_IMPORTS,
            *[m for m in imports if m not in (*DEFAULT_IMPORTS, *LATER_IMPORTS)],
        ]
        if workers > len(os.sched_getaffinity(0)):  # crowded: the first workers' own imports
            self.imports += self.later  # would queue for the cores; import once, before forking
            self.later = []
        self.ready_timeout_s = ready_timeout_s
        self.spawned = 0
        self.fallbacks = 0
        self.ready_info: dict[str, Any] | None = None
        self._down = ""  # why the pool cannot serve ("" while it can)
        self._said = False
        # an abstract socket: nothing on disk to leave behind when the agent is SIGKILLed; the
        # warm process serves only this process (it checks the peer's credentials)
        self.socket_name = f"fleetrun-warm-{os.getpid()}-{secrets.token_hex(8)}"
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._log.write(
            f"==== fleetrun: warm process, {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode()
        )
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
            stderr=self._log,
            start_new_session=True,
            preexec_fn=_set_pdeathsig,  # noqa: PLW1509 - only prctl, async-signal-safe
        )
        self.started = time.monotonic()

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
        self._log.write(f"ready in {info.get('seconds', 0):.2f} s; imported {loaded}\n".encode())
        for name, why in (info.get("failed") or {}).items():
            logger.warning("fleetrun: warm start: could not preload %s (%s)", name, why)

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

    def close(self) -> None:
        """Stop the warm process (workers it forked are not touched; its abstract socket goes
        with it)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


__all__ = [
    "BOOTSTRAP",
    "DEFAULT_IMPORTS",
    "LATER_IMPORTS",
    "READY_TIMEOUT_S",
    "WarmChild",
    "WarmPool",
    "WarmStartError",
    "supported",
]
