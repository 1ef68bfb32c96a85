"""Shared test helpers: start real worker processes with the env contract, bounded in time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from collective.env import Backend, NodeLayout, find_free_port, make_worker_env

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass
class WorkerResult:
    """Outcome of one worker process started by :func:`run_workers`."""

    rank: int
    returncode: int
    output: str


def base_env() -> dict[str, str]:
    """The test process's env without any inherited contract variables, threads pinned to 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "PADDLE_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def gen_slot_files(out: Path, num_files: int = 2, lines: int = 1500, *extra: str) -> Path:
    """The CTR example's slot files (examples/ctr/gen_slot_files.py) in ``out``; ``extra``: more
    flags (``--days``, ``--format``...). The generator's stderr is in the AssertionError if it
    fails."""
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "ctr" / "gen_slot_files.py"),
            "--out_dir",
            str(out),
            "--num_files",
            str(num_files),
            "--lines_per_file",
            str(lines),
            *extra,
        ],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"examples/ctr/gen_slot_files.py failed: {r.stderr[-3000:]}"
    return out


def run_workers(
    script: str | Path,
    nprocs: int,
    args: list[str] | None = None,
    timeout: float = 120.0,
    tmp_path: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> list[WorkerResult]:
    """Start ``nprocs`` Python processes of ``script`` on 127.0.0.1 with the full env contract
    (as fleetrun would give them) and wait for all, killing every one on timeout."""
    log_dir = str(tmp_path or REPO / "log")
    endpoints = tuple(f"127.0.0.1:{find_free_port()}" for _ in range(nprocs))
    layout = NodeLayout(
        run_id="test",
        num_nodes=1,
        nproc_per_node=nprocs,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=find_free_port(),
        trainer_endpoints=endpoints,
        node_ip="127.0.0.1",
        restart_count=0,
        max_restarts=0,
        backend=Backend.GLOO,
        log_dir=log_dir,
        error_dir=os.path.join(log_dir, "errors"),
    )
    procs = []
    for local_rank in range(nprocs):
        env = base_env()
        env.update(make_worker_env(layout, local_rank))
        env.update(extra_env or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *(args or [])],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    results = []
    try:
        for rank, p in enumerate(procs):
            out, _ = p.communicate(timeout=timeout)
            results.append(WorkerResult(rank, p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return results


def assert_all_ok(results: list[WorkerResult]) -> None:
    """Fail with every failing rank's output."""
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output}" for r in bad)


def fleetrun_cmd(*args: str) -> list[str]:
    """The fleetrun command line (as ``python -m launcher`` of this interpreter)."""
    return [sys.executable, "-m", "launcher", *args]


def start_fleetrun(
    *args: str, cwd: str | Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start fleetrun in its own session (so a test can signal it like a terminal would)."""
    full_env = base_env()
    full_env.update(env or {})
    return subprocess.Popen(
        fleetrun_cmd(*args),
        cwd=str(cwd or REPO),
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_fleetrun(
    *args: str,
    timeout: float = 120.0,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run fleetrun to the end (killing its whole session on timeout)."""
    p = start_fleetrun(*args, cwd=cwd, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(
            f"fleetrun timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err}"
        ) from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def warm_processes_of(mark: bytes) -> list[int]:
    """Pids of the warm processes (``collective.zygote``) whose command line holds ``mark``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"collective.zygote" in cmd and mark in cmd:
            found.append(int(pid))
    return found


def live_pids(pids: list[int]) -> list[int]:
    """The pids among ``pids`` that still run (zombies count as gone)."""
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait up to ``timeout`` for ``pids`` to end; return those still alive."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        alive = live_pids(pids)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def wait_for(fn: Any, timeout: float, what: str) -> Any:
    """Call ``fn`` every 0.3 s until it returns something truthy (OSError, ValueError and
    KeyError count as not yet); AssertionError naming ``what`` and the last value after
    ``timeout`` seconds."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@pytest.fixture(scope="session")
def chromium_paths() -> dict[str, str]:
    """Run scripts/chromium.sh (apt-get installs chromium + chromium-driver when missing)."""
    try:
        r = subprocess.run(
            ["bash", str(REPO / "scripts" / "chromium.sh")],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.skip("scripts/chromium.sh did not finish installing chromium in 600 s")
    if r.returncode != 0:
        pytest.skip(
            f"no headless Chromium: scripts/chromium.sh exit {r.returncode}: {r.stderr.strip()[-500:]}"
        )
    return dict(line.split("=", 1) for line in r.stdout.split() if "=" in line)
