"""Overhead of the Prometheus metrics: the same work with metrics on and off, in the same run.

1. **DP step time**: ``bench/dp_step_worker.py --impl fleet`` under fleetrun, 2 ranks, with
   metrics on (default: /metrics endpoints, step/sample hooks, the all-reduce timing comm hook)
   vs ``--no-metrics``; each job's median step time (slowest rank). Ratio on/off, goal <= 1.01.
   ``--small`` uses a small MLP, where per-step costs weigh the most.
2. **PS pull+push throughput**, an interleaved A/B for low noise: two ``python -m ps_server``
   processes run the whole time, one with ``--metrics_port`` (per-RPC counters and latency
   histograms, scraped table collector) scraped once a second as Prometheus would, one without.
   After a warm-up of both, ``--ps_rounds`` rounds each drive one ``--ps_block``-step block of
   pull+push (4096 keys x dim 16) through a plain ``PSClient`` against each server, the order
   alternating by round; the client code is the same for both (trainer-side hooks are part 1's).
   Printed: keys/s per block, median [min .. max] of each, the ratio of medians, and the paired
   statistic, the median of the per-round on/off ratios. Goal >= 0.98. Also, in this process,
   the cost of one ``record_request`` call against the servicer's handling time of one request,
   and the expected on/off ratio from those costs and the measured scrape time; and per block
   the CPU time of the server process (its CPU clock, all threads) and of this client per key,
   which a loaded machine does not blur the way it blurs wall time.

DP repetitions alternate the order (on/off, off/on). Usage::

    python bench/bench_metrics_overhead.py [--reps 5] [--steps 30] [--small]
        [--ps_rounds 31] [--ps_block 50] [--skip_dp] [--skip_ps] [--json PREFIX]
        # PREFIX.dp.json, PREFIX.ps.json
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
from dataclasses import asdict, dataclass, field
from typing import Any

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
    cmd = fleetrun_cmd(
        flag,
        "--nproc_per_node",
        "2",
        "--log_dir",
        log_dir,
        WORKER,
        "--impl",
        "fleet",
        "--steps",
        str(steps),
        *size,
    )
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
# Both servers run for the whole measurement and are driven alternately in short blocks by the
# same client code, so slow drifts of the machine (other processes, thermal, page cache) hit both
# sides alike and pair up round by round; the idle server costs both sides the same.
Batches = list[tuple[np.ndarray, np.ndarray]]


def make_batches(num: int = 16, seed: int = 0) -> Batches:
    """``num`` (keys, grads) batches of PS_BATCH keys out of 200k, dim PS_DIM."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(0, 200_000, PS_BATCH, dtype=np.int64),
            rng.standard_normal((PS_BATCH, PS_DIM), dtype=np.float32) * 0.01,
        )
        for _ in range(num)
    ]


def start_server(metrics_port: int) -> tuple[subprocess.Popen, str]:
    """A ``python -m ps_server`` process (with ``--metrics_port`` when non-zero); its endpoint."""
    cmd = [sys.executable, "-m", "ps_server", "--port", "0", "--log_level", "WARNING"]
    if metrics_port:
        cmd += ["--metrics_port", str(metrics_port)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=bench_env(), cwd=REPO
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "serving on" not in line:
        stop_server(proc)
        raise RuntimeError(
            f"ps_server did not start (exit {proc.returncode}): {line!r}; run "
            f"{' '.join(cmd)} by hand to see why"
        )
    return proc, line.strip().rsplit(" ", 1)[-1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, SIGKILL after 10 s; reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scraper(endpoint: str, stop: threading.Event, seconds: list[float]) -> None:
    """GET http://ENDPOINT/metrics once a second, as Prometheus would; wall time per scrape."""
    while not stop.wait(1.0):
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as r:
                r.read()
            seconds.append(time.perf_counter() - t0)
        except OSError:
            pass


def cpu_seconds(pid: int) -> float:
    """CPU time (all threads, ns resolution) of process ``pid``: its CPUCLOCK_SCHED process clock
    (``clock_getcpuclockid``, which Python does not expose: ``(~pid << 3) | 2`` on Linux)."""
    return time.clock_gettime((~pid << 3) | 2)


@dataclass(frozen=True)
class Block:
    """One timed block: keys/s of wall time, server and client CPU seconds per key."""

    rate: float
    server_cpu: float
    client_cpu: float


def ps_block(client: Any, pid: int, batches: Batches, steps: int, start: int) -> Block:
    """``steps`` pull+push steps against the server of process ``pid`` (the trainer's loop, no
    trainer-side hooks)."""
    s0, c0, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
    for i in range(start, start + steps):
        keys, grads = batches[i % len(batches)]
        client.pull_sparse("bench", keys)
        client.push_sparse("bench", keys, grads)
    wall, n = time.perf_counter() - t0, steps * PS_BATCH
    return Block(n / wall, (cpu_seconds(pid) - s0) / n, (time.process_time() - c0) / n)


@dataclass
class PSResult:
    """The blocks on each server, by round, and the scrape wall times."""

    on: list[Block] = field(default_factory=list)
    off: list[Block] = field(default_factory=list)
    scrape_s: list[float] = field(default_factory=list)

    def stats(self, on: bool, what: str) -> Stats:
        """Stats of ``what`` (a Block field) over the blocks of one side."""
        return Stats.of([getattr(b, what) for b in (self.on if on else self.off)])

    def paired(self, what: str) -> Stats:
        """Stats of the per-round on/off ratios of ``what``."""
        return Stats.of([getattr(a, what) / getattr(b, what) for a, b in zip(self.on, self.off)])


def bench_ps(rounds: int, block: int, warm: int = 48) -> PSResult:
    """Interleaved A/B: one server with metrics (scraped every second), one without, both up the
    whole time; ``rounds`` rounds of one ``block``-step block on each, order alternating."""
    from ps_server import PSClient

    batches = make_batches()
    mport = find_free_port()
    servers = {True: start_server(mport), False: start_server(0)}
    clients: dict[bool, Any] = {}
    result, stop = PSResult(), threading.Event()
    try:
        for on, (_proc, ep) in servers.items():
            clients[on] = PSClient([ep])
            clients[on].create_table("bench", dim=PS_DIM)
        for on in (True, False):  # warm up: every row exists, channels and caches are hot
            ps_block(clients[on], servers[on][0].pid, batches, warm, 0)
        threading.Thread(
            target=scraper, args=(f"127.0.0.1:{mport}", stop, result.scrape_s), daemon=True
        ).start()
        for r in range(rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                blk = ps_block(clients[on], servers[on][0].pid, batches, block, r * block)
                (result.on if on else result.off).append(blk)
    finally:
        stop.set()
        for c in clients.values():
            c.close()
        for proc, _ep in servers.values():
            stop_server(proc)
    return result


def bench_record_cost(n: int = 20000, requests: int = 100) -> dict[str, Stats]:
    """In this process: the cost of one ``telemetry.record_request`` call, and the servicer's
    handling time of one PullSparse / PushSparse (4096 keys) with metrics off and on, without
    gRPC; 5 repetitions each. The expected overhead is the difference over a request's time."""
    from ps_server import telemetry
    from ps_server.client import DEFAULT_INITIALIZER, DEFAULT_OPTIMIZER
    from ps_server.config import SparseTableConfig, config_to_dict
    from ps_server.rpc.proto import ps_pb2
    from ps_server.rpc.service import ServerState, create_table
    from ps_server.rpc.servicer import ParameterServerServicer

    state = ServerState()
    servicer = ParameterServerServicer(state)
    config = SparseTableConfig("bench", PS_DIM, DEFAULT_OPTIMIZER, DEFAULT_INITIALIZER)
    create_table(state, ps_pb2.CreateTableRequest(config_json=json.dumps(config_to_dict(config))))
    reqs = [
        (
            ps_pb2.PullSparseRequest(table="bench", keys=k.tobytes()),
            ps_pb2.PushSparseRequest(
                table="bench", keys=k.tobytes(), grads=g.tobytes(), mode=ps_pb2.PUSH_MODE_APPLY
            ),
        )
        for k, g in make_batches()
    ]

    def handle() -> float:  # seconds per request (half a pull+push step)
        t0 = time.perf_counter()
        for i in range(requests):
            pull, push = reqs[i % len(reqs)]
            servicer.PullSparse(pull, None)
            servicer.PushSparse(push, None)
        return (time.perf_counter() - t0) / (2 * requests)

    def record() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            telemetry.record_request("PullSparse", "bench", "OK", 0.001, PS_BATCH)
        return (time.perf_counter() - t0) / n

    handle()  # rows exist
    rec, on, off = [], [], []
    for _ in range(5):
        off.append(handle())
        telemetry.start(0)
        try:
            on.append(handle())
            rec.append(record())
        finally:
            telemetry.stop()
    return {"record": Stats.of(rec), "handle_on": Stats.of(on), "handle_off": Stats.of(off)}


def report_ps(res: PSResult, block: int, cost: dict[str, Stats], json_path: str | None) -> None:
    """Print (and dump) the A/B result with the paired ratios and the expected overhead."""
    on, off, paired = res.stats(True, "rate"), res.stats(False, "rate"), res.paired("rate")
    per_req = PS_BATCH / off.median / 2  # seconds per request end to end (metrics off)
    scrape = Stats.of(res.scrape_s) if res.scrape_s else None
    # on adds one record_request per request and one scrape (server time) per second
    added = cost["record"].median / per_req + (scrape.median if scrape else 0.0) / 1.0
    expected = 1.0 / (1.0 + added)
    print(
        f"PS per request (in-process, no gRPC, {PS_BATCH} keys x dim {PS_DIM}): "
        f"record_request {cost['record'].fmt('us', 1e6, 2)}; handling off "
        f"{cost['handle_off'].fmt('us', 1e6, 0)}, on {cost['handle_on'].fmt('us', 1e6, 0)}"
    )
    print(
        f"PS end to end: {per_req * 1e6:.0f} us per request (off); /metrics scrape wall "
        + (scrape.fmt("ms", 1e3, 1) if scrape else "n/a")
        + " once a second"
    )
    print(f"expected on/off throughput from these costs: {expected:.4f}")
    label = (
        f"pull+push keys/s per {block}-step block ({PS_BATCH} keys x dim {PS_DIM}, "
        f"2 servers up, {len(res.on)} rounds)"
    )
    cpu = {
        side: {w: res.stats(side, w) for w in ("server_cpu", "client_cpu")}
        for side in (True, False)
    }
    extra = {
        "paired_ratio": asdict(paired),
        "per_round_ratios": [a.rate / b.rate for a, b in zip(res.on, res.off)],
        "server_cpu_us_per_1k_keys": {
            "on": asdict(cpu[True]["server_cpu"]),
            "off": asdict(cpu[False]["server_cpu"]),
            "paired_on_off": asdict(res.paired("server_cpu")),
        },
        "client_cpu_us_per_1k_keys": {
            "on": asdict(cpu[True]["client_cpu"]),
            "off": asdict(cpu[False]["client_cpu"]),
        },
        "record_request_us": cost["record"].median * 1e6,
        "handle_off_us": cost["handle_off"].median * 1e6,
        "handle_on_us": cost["handle_on"].median * 1e6,
        "request_end_to_end_us": per_req * 1e6,
        "scrape_ms": scrape.median * 1e3 if scrape else None,
        "expected_ratio": expected,
        "rounds": len(res.on),
        "block_steps": block,
    }
    report(
        "Metrics overhead, PS: metrics on (fleetrun) vs off (peer), interleaved A/B",
        [(label, on, off, "on/off throughput")],
        goal=">= 0.98",
        extra=extra,
        json_path=json_path,
        unit="keys/s",
    )
    print(
        f"  paired: median of per-round on/off ratios = {paired.median:.3f} "
        f"[{paired.min:.3f} .. {paired.max:.3f}]   goal: >= 0.98"
    )
    for who in ("server", "client"):
        a, b = cpu[True][f"{who}_cpu"], cpu[False][f"{who}_cpu"]
        line = (
            f"  {who} CPU per 1k keys: on {a.fmt('us', 1e9, 1)}, off {b.fmt('us', 1e9, 1)}, "
            f"on/off {a.median / b.median:.3f}"
        )
        if who == "server":
            p = res.paired("server_cpu")
            line += f", paired {p.median:.3f} [{p.min:.3f} .. {p.max:.3f}]"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="timed DP steps per job")
    ap.add_argument("--ps_rounds", type=int, default=31, help="PS A/B rounds (>= 9)")
    ap.add_argument("--ps_block", type=int, default=50, help="pull+push steps per PS block")
    ap.add_argument(
        "--small", action="store_true", help="DP: a small MLP (per-step costs weigh more)"
    )
    ap.add_argument("--skip_dp", action="store_true")
    ap.add_argument("--skip_ps", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    out: dict[str, str] = {}
    if not args.skip_dp:
        on, off = bench_hooks()
        print(
            f"trainer hooks per step (in-process): on {on.fmt('us', 1e6)}, off {off.fmt('us', 1e6)}"
        )
        on, off = bench_dp(args.reps, args.steps, args.small)
        out["dp"] = f"{args.json}.dp.json" if args.json else ""
        report(
            "Metrics overhead, DP: metrics on (fleetrun) vs off (peer)",
            [
                (
                    "median step time per job, 2 ranks" + (" (small MLP)" if args.small else ""),
                    on,
                    off,
                    "on/off time",
                )
            ],
            goal="<= 1.01",
            json_path=out["dp"] or None,
        )
    if not args.skip_ps:
        if args.ps_rounds < 9 or args.ps_block < 1:
            ap.error(
                f"--ps_rounds must be >= 9 (got {args.ps_rounds}) and --ps_block >= 1 "
                f"(got {args.ps_block})"
            )
        cost = bench_record_cost()
        res = bench_ps(args.ps_rounds, args.ps_block)
        report_ps(res, args.ps_block, cost, f"{args.json}.ps.json" if args.json else None)


if __name__ == "__main__":
    main()
