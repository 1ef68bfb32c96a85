"""Warm starts: fleetrun with ``--warm_start on`` vs fleetrun starting workers afresh vs torchrun,
measured alternately in the same run (``bench/warm_job.py`` is the job).

1. launch-to-exit of a trivial 2-rank gloo barrier job (goal: warm ≤ 0.4× torchrun), also
   under a CPU hog (one busy loop per core, started before and killed after each launch);
2. a restart: rank 1 dies after its first barrier, fleetrun restarts the job
   (``--max_restarts 1``); the time from the death to the restarted rank 1 being back through
   init and a barrier, warm vs fresh (torchrun 2.13's own restart of a gloo job fails here: its
   restarted workers time out connecting, with a static or a c10d rendezvous);
3. memory: the PSS (``/proc/PID/smaps_rollup``) of 4 idle workers, forked (the warm process
   counted, once it has done its later imports) vs fresh (goal: ≤ 0.7×): the job's first workers
   after ``import torch`` (the goal's measure) and after building an optimizer, and workers
   restarted once the warm process imported everything (attempt 0 waits for that, then fails).

Usage: ``python bench/bench_warm_start.py [--reps 5] [--json PATH]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Stats, bench_env, fleetrun_cmd, report, torchrun_cmd

from collective.env import find_free_port

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_job.py")
KINDS = ("warm", "fresh", "torchrun")


def _cmd(kind: str, log_dir: str, nproc: int, *job_args: str, restarts: int = 0) -> list[str]:
    if kind == "torchrun":
        return torchrun_cmd(
            "--nproc_per_node", str(nproc), "--master_port", str(find_free_port()),
            "--max-restarts", str(restarts), JOB, *job_args,
        )  # fmt: skip
    return fleetrun_cmd(
        "--nproc_per_node", str(nproc), "--log_dir", log_dir, "--tee", "none", "--no_metrics",
        "--warm_start", "on" if kind == "warm" else "off", "--max_restarts", str(restarts),
        JOB, *job_args,
    )  # fmt: skip


def _run(cmd: list[str], expect_ok: bool = True) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=bench_env(), timeout=300)
    dt = time.perf_counter() - t0
    if expect_ok and r.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return dt


def launch_to_exit(kind: str, tmp: str) -> float:
    return _run(_cmd(kind, os.path.join(tmp, kind), 2, "--mode", "barrier"))


def restart_cost(kind: str, tmp: str) -> float:
    stamp = tempfile.mkdtemp(dir=tmp)
    _run(_cmd(kind, os.path.join(tmp, kind), 2, "--mode", "restart", "--stamp", stamp, restarts=1))
    with open(os.path.join(stamp, "died")) as f:
        died = float(f.read())
    with open(os.path.join(stamp, "back")) as f:
        return float(f.read()) - died


def _pss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss for {pid}")


def _zygote_pss(agent: int, workers: list[int]) -> int:
    """PSS of the agent's warm process (a forked worker shows the same command line)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == agent and b"collective.zygote" in cmd and int(pid) not in workers:
            total += _pss_kb(int(pid))
    return total


def _wait_imported(log_dir: str, deadline: float, also: tuple[str, ...] = ()) -> None:
    """Until the warm process logged its last import (and the files ``also`` exist)."""
    log = os.path.join(log_dir, "warmlog.0")
    while time.monotonic() < deadline:
        if all(os.path.exists(f) for f in also) and os.path.exists(log):
            with open(log) as f:
                text = f.read()
                if "imported ps_server.client" in text or "ps_server.client\n" in text:
                    return  # imported later, or before the first fork (crowded node)
        time.sleep(0.1)
    raise RuntimeError("the warm process did not finish its imports")


def _release_when_imported(stamp: str, log_dir: str, nproc: int, deadline: float) -> None:
    """Once attempt 0's workers wait and the warm process logged its last import, let them fail."""
    _wait_imported(log_dir, deadline, tuple(os.path.join(stamp, f"wait.{r}") for r in range(nproc)))
    open(os.path.join(stamp, "go"), "w").close()


@contextlib.contextmanager
def cpu_hog(n: int):
    """``n`` busy Python loops at the same priority for the duration."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def memory(
    kind: str, tmp: str, nproc: int = 4, restarted: bool = False, mode: str = "hold"
) -> float:
    """PSS in MiB of ``nproc`` idle workers (plus the warm process for ``warm``, once it has
    done its later imports: its steady state); ``restarted``: of the workers of attempt 1,
    forked after every import; ``mode``: ``hold`` (an optimizer built) or ``idle`` (``import
    torch`` alone)."""
    stamp = tempfile.mkdtemp(dir=tmp)
    log_dir = os.path.join(stamp, "log")  # its own warmlog.0, which the release reads
    extra = ("--fail_first",) if restarted else ()
    cmd = _cmd(
        kind, log_dir, nproc, "--mode", mode, "--stamp", stamp, *extra, restarts=int(restarted)
    )
    p = subprocess.Popen(cmd, env=bench_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        if restarted:
            _release_when_imported(stamp, log_dir, nproc, deadline)
        pids: list[int] = []
        while time.monotonic() < deadline and p.poll() is None:
            files = [os.path.join(stamp, f"pid.{r}") for r in range(nproc)]
            if all(os.path.exists(f) and os.path.getsize(f) for f in files):
                pids = [int(open(f).read()) for f in files]
                break
            time.sleep(0.1)
        if not pids:
            raise RuntimeError(f"{kind}: the workers did not start")
        if kind == "warm":
            _wait_imported(log_dir, deadline)
        time.sleep(1.0)
        kb = sum(_pss_kb(pid) for pid in pids)
        if kind == "warm":
            kb += _zygote_pss(p.pid, pids)
        return kb / 1024
    finally:
        open(os.path.join(stamp, "stop"), "w").close()
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    whats = ("launch", "launch_hog", "restart", "memory_torch", "memory", "memory_restart")
    t: dict[str, dict[str, list[float]]] = {what: {k: [] for k in KINDS} for what in whats}
    hogs = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            launch_to_exit(kind, tmp)  # the page cache
        for rep in range(args.reps):
            order = KINDS if rep % 2 == 0 else tuple(reversed(KINDS))
            for kind in order:
                t["launch"][kind].append(launch_to_exit(kind, tmp))
                if kind != "fresh":
                    with cpu_hog(hogs):
                        t["launch_hog"][kind].append(launch_to_exit(kind, tmp))
                if kind != "torchrun":
                    t["restart"][kind].append(restart_cost(kind, tmp))
                    t["memory_torch"][kind].append(memory(kind, tmp, mode="idle"))
                    t["memory"][kind].append(memory(kind, tmp))
                if kind == "warm":
                    t["memory_restart"][kind].append(memory(kind, tmp, restarted=True))
            print(
                f"rep {rep + 1}: "
                + "  ".join(f"{w}/{k} {v[k][-1]:.2f}" for w, v in t.items() for k in KINDS if v[k]),
                flush=True,
            )
    s = {w: {k: Stats.of(v) for k, v in d.items() if v} for w, d in t.items()}
    report(
        "Warm starts: forked workers vs fresh ones vs torchrun",
        [
            (
                "launch-to-exit, 2-rank gloo barrier job, warm vs torchrun",
                s["launch"]["warm"],
                s["launch"]["torchrun"],
                "warm/torchrun time",
            ),
            (
                f"launch-to-exit under a CPU hog ({hogs} busy loops), warm vs torchrun",
                s["launch_hog"]["warm"],
                s["launch_hog"]["torchrun"],
                "warm/torchrun time",
            ),
            (
                "launch-to-exit, 2-rank gloo barrier job, warm vs fresh",
                s["launch"]["warm"],
                s["launch"]["fresh"],
                "warm/fresh time",
            ),
            (
                "restart: rank death to the restarted rank through init, warm vs fresh",
                s["restart"]["warm"],
                s["restart"]["fresh"],
                "warm/fresh time",
            ),
            (
                "memory: first workers after import torch, PSS of 4 idle workers (MiB), warm (its "
                "warm process counted) vs fresh",
                s["memory_torch"]["warm"],
                s["memory_torch"]["fresh"],
                "warm/fresh PSS",
            ),
            (
                "memory: first workers after building an optimizer, PSS of 4 idle workers (MiB), "
                "warm (its warm process counted) vs fresh",
                s["memory"]["warm"],
                s["memory"]["fresh"],
                "warm/fresh PSS",
            ),
            (
                "memory: restarted workers, PSS of 4 idle workers forked after every import, "
                "optimizer built (MiB), warm (its warm process counted) vs fresh",
                s["memory_restart"]["warm"],
                s["memory"]["fresh"],
                "warm/fresh PSS",
            ),
        ],
        goal="launch <= 0.4x torchrun; memory <= 0.7x fresh",
        json_path=args.json,
    )


if __name__ == "__main__":
    main()
