"""Test helper: a heterogeneous PS job of real processes (servers, CPU trainers, heter workers)
on 127.0.0.1, each started with the env contract of :class:`collective.env.PSLayout`.

Used by tests/test_heter_*.py; every process runs in its own session and :meth:`HeterJob.kill`
(called by the tests' ``finally``) kills whatever still runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from collective.env import (
    Backend,
    PSLayout,
    find_free_port,
    make_ps_heter_env,
    make_ps_server_env,
    make_ps_trainer_env,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "heter_train.py"


def _endpoints(n: int) -> tuple[str, ...]:
    return tuple(f"127.0.0.1:{find_free_port()}" for _ in range(n))


class HeterJob:
    """``servers`` + ``trainers`` + ``heters`` processes of ``script args`` under ``tmp``."""

    def __init__(
        self,
        tmp: Path,
        args: list[str],
        *,
        servers: int = 1,
        trainers: int = 1,
        heters: int = 1,
        devices: tuple[str, ...] = ("cpu",),
        script: Path = SCRIPT,
        heter_endpoints: tuple[str, ...] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.tmp, self.args, self.script = tmp, args, script
        self.env = dict(env or {})
        (tmp / "log").mkdir(parents=True, exist_ok=True)
        self.layout = PSLayout(
            run_id="heter-test",
            server_endpoints=_endpoints(servers),
            trainer_endpoints=_endpoints(trainers),
            restart_count=0,
            max_restarts=0,
            backend=Backend.GLOO,
            log_dir=str(tmp / "log"),
            error_dir=str(tmp / "log"),
            heter_endpoints=heter_endpoints if heter_endpoints is not None else _endpoints(heters),
            heter_devices=devices,
        )
        self.procs: dict[str, subprocess.Popen] = {}

    def _start(self, name: str, env: dict[str, str]) -> subprocess.Popen:
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PADDLE_", "FLEET_", "TRAINING_ROLE", "POD_IP", "RANK"))
            and k not in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        base.update(env)
        base.update(self.env)
        base["PYTHONPATH"] = str(REPO)
        log = open(self.tmp / "log" / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, str(self.script), *self.args],
            cwd=str(REPO),
            env=base,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start(self, roles: tuple[str, ...] = ("server", "heter", "trainer")) -> HeterJob:
        """Start every process of the given roles."""
        lay = self.layout
        if "server" in roles:
            for i in range(len(lay.server_endpoints)):
                self._start(f"server.{i}", make_ps_server_env(lay, i))
        if "heter" in roles:
            for i in range(len(lay.heter_endpoints)):
                self.start_heter(i)
        if "trainer" in roles:
            n = len(lay.trainer_endpoints)
            for i in range(n):
                self._start(f"trainer.{i}", make_ps_trainer_env(lay, i, i, n))
        return self

    def start_heter(self, index: int) -> subprocess.Popen:
        """Start (or restart, on its endpoint) heter worker ``index``."""
        return self._start(f"heter.{index}", make_ps_heter_env(self.layout, index))

    def log(self, name: str) -> str:
        path = self.tmp / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, names: list[str] | None = None, timeout_s: float = 120.0) -> dict[str, int]:
        """Exit codes of ``names`` (default: every process), waiting up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        out = {}
        for name in names or list(self.procs):
            left = max(deadline - time.monotonic(), 0.1)
            try:
                out[name] = self.procs[name].wait(timeout=left)
            except subprocess.TimeoutExpired:
                logs = "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in self.procs)
                raise AssertionError(f"{name} still runs after {timeout_s}s\n{logs}") from None
        return out

    def wait_for_line(self, name: str, text: str, timeout_s: float = 240.0) -> None:
        """Wait until ``name``'s log contains ``text``."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log(name):
            if time.monotonic() > deadline or self.procs[name].poll() is not None:
                raise AssertionError(f"{name} never printed {text!r}:\n{self.log(name)[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL every process (session) still running."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)[-4000:]}" for n in self.procs)
