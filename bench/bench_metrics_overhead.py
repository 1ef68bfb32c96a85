"""Overhead of the Prometheus metrics: the same work with metrics on and off, in the same run.

1. **DP step time**: ``bench/dp_step_worker.py --impl fleet`` under fleetrun, 2 ranks, with
   metrics on (default: /metrics endpoints, step/sample hooks, the all-reduce timing comm hook)
   vs ``--no-metrics``; each job's median step time (slowest rank). Ratio on/off, goal <= 1.01.
   ``--small`` uses a small MLP, where per-step costs weigh the most.
2. **PS pull+push throughput**: one ``python -m ps_server`` process with ``--metrics_port``
   (per-RPC counters and latency histograms, scraped table collector) vs without; this process
   pulls and pushes batches of keys through ``PSClient`` (wrapped in the trainer's timing proxy
   when on) and is scraped once a second while on, as Prometheus would. Keys/s ratio on/off,
   goal >= 0.98.

Repetitions alternate the order (on/off, off/on). Usage::

    python bench/bench_metrics_overhead.py [--reps 5] [--steps 30] [--ps_steps 200] [--small]
        [--skip_dp] [--skip_ps] [--json PREFIX]     # PREFIX.dp.json, PREFIX.ps.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from common import REPO, Stats, bench_env, fleetrun_cmd, report, run_checked

from collective.env import find_free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dp_step_worker.py")
PS_BATCH = 4096
PS_DIM = 16


# -- DP ----------------------------------------------------------------------------------------
def dp_run(metrics: bool, steps: int, small: bool, log_dir: str) -> float:
    flag = "--metrics" if metrics else "--no-metrics"
    size = ["--width", "128", "--depth", "2", "--in_features", "64"] if small else []
    cmd = fleetrun_cmd(flag, "--nproc_per_node", "2", "--log_dir", log_dir, WORKER, "--impl",
                       "fleet", "--steps", str(steps), *size)
    out = run_checked(cmd).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("{") and '"impl"' in ln)
    return float(json.loads(line)["step_time_s_median"])


def bench_dp(reps: int, steps: int, small: bool) -> tuple[Stats, Stats]:
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for on in (True, False) if rep % 2 == 0 else (False, True):
                times[on].append(dp_run(on, steps, small, tmp))
    return Stats.of(times[True]), Stats.of(times[False])


def bench_hooks(n: int = 20000) -> tuple[Stats, Stats]:
    """Seconds per training step spent in the trainer hooks (forward count, step end,
    fleet.report with a tensor loss), metrics on vs off, in this process: the part of the DP
    overhead that does not drown in the step-time noise of a loaded machine."""
    import torch

    from fleet import telemetry

    batch, loss = (torch.zeros(64, 8),), torch.tensor(0.5)

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            telemetry.on_forward(batch)
            telemetry.on_step()
            telemetry.report(loss=loss)
        return (time.perf_counter() - t0) / n

    on, off = [], []
    for _ in range(5):
        off.append(run())
        telemetry.start(0)
        on.append(run())
        telemetry.stop()
    return Stats.of(on), Stats.of(off)


# -- PS ----------------------------------------------------------------------------------------
def start_server(metrics_port: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "ps_server", "--port", "0", "--log_level", "WARNING"]
    if metrics_port:
        cmd += ["--metrics_port", str(metrics_port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=bench_env(), cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "serving on" not in line:
        proc.kill()
        raise RuntimeError(f"ps_server did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[-1]


def scraper(endpoint: str, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=2) as r:
                r.read()
        except OSError:
            pass


def ps_run(metrics: bool, steps: int, batches: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Keys/s of ``steps`` pull+push steps against a fresh server."""
    from fleet import telemetry
    from ps_server import PSClient

    mport = find_free_port() if metrics else 0
    proc, ep = start_server(mport)
    stop = threading.Event()
    try:
        client: object = PSClient([ep])
        client.create_table("bench", dim=PS_DIM)  # type: ignore[attr-defined]
        for keys, grads in batches[:5]:  # warm up: rows exist, channels are hot
            client.pull_sparse("bench", keys)  # type: ignore[attr-defined]
            client.push_sparse("bench", keys, grads)  # type: ignore[attr-defined]
        if metrics:
            telemetry.start(0)
            client = telemetry._TimedClient(client)
            threading.Thread(target=scraper, args=(f"127.0.0.1:{mport}", stop), daemon=True).start()
        t0 = time.perf_counter()
        for i in range(steps):
            keys, grads = batches[i % len(batches)]
            client.pull_sparse("bench", keys)  # type: ignore[attr-defined]
            client.push_sparse("bench", keys, grads)  # type: ignore[attr-defined]
        rate = steps * PS_BATCH / (time.perf_counter() - t0)
        client.close()  # type: ignore[attr-defined]
        return rate
    finally:
        stop.set()
        telemetry.stop()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_ps(reps: int, steps: int) -> tuple[Stats, Stats]:
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 200_000, PS_BATCH, dtype=np.int64),
                rng.standard_normal((PS_BATCH, PS_DIM), dtype=np.float32) * 0.01) for _ in range(16)]
    rates: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(reps):
        for on in (True, False) if rep % 2 == 0 else (False, True):
            rates[on].append(ps_run(on, steps, batches))
    return Stats.of(rates[True]), Stats.of(rates[False])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="timed DP steps per job")
    ap.add_argument("--ps_steps", type=int, default=200, help="pull+push steps per PS run")
    ap.add_argument("--small", action="store_true", help="DP: a small MLP (per-step costs weigh more)")
    ap.add_argument("--skip_dp", action="store_true")
    ap.add_argument("--skip_ps", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    out: dict[str, str] = {}
    if not args.skip_dp:
        on, off = bench_hooks()
        print(f"trainer hooks per step (in-process): on {on.fmt('us', 1e6)}, off {off.fmt('us', 1e6)}")
        on, off = bench_dp(args.reps, args.steps, args.small)
        out["dp"] = f"{args.json}.dp.json" if args.json else ""
        report("Metrics overhead, DP: metrics on (fleetrun) vs off (peer)",
               [("median step time per job, 2 ranks" + (" (small MLP)" if args.small else ""),
                 on, off, "on/off time")], goal="<= 1.01", json_path=out["dp"] or None)
    if not args.skip_ps:
        on, off = bench_ps(args.reps, args.ps_steps)
        out["ps"] = f"{args.json}.ps.json" if args.json else ""
        report("Metrics overhead, PS: metrics on (fleetrun) vs off (peer)",
               [(f"pull+push keys/s ({PS_BATCH} keys x dim {PS_DIM}, 1 server)", on, off,
                 "on/off throughput")], goal=">= 0.98", json_path=out["ps"] or None,
               unit="keys/s")


if __name__ == "__main__":
    main()
