"""Bus bandwidth of ``collective.all_reduce`` against ``torch.distributed.all_reduce``, same run.

Two ranks on this machine (started with ``collective.spawn``), gloo, float32 tensors of 4 MiB and
64 MiB. For every size the two functions are timed alternately in the same processes, call by
call (the order flips every call, so drift, warm-up and load from other processes cancel); a
repetition is several such pairs started after a barrier, each implementation's time per call is
its mean over the repetition, and the slowest rank's time counts. Prints min / median / max bus
bandwidth of both, the ratio of medians ours/torch and the median of the per-repetition ratios
(goal >= 0.97: the API must add no measurable overhead), plus machine info.

Bus bandwidth of all_reduce (as nccl-tests define it): ``2 * (n - 1) / n * bytes / time``.

Usage: ``python bench/bench_allreduce.py [--reps 15] [--sizes-mib 4 64] [--json PATH]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

import collective as dist

logger = logging.getLogger(__name__)

WORLD_SIZE = 2
TARGET_MEASURE_S = 1.6
"""Aim for this much time per repetition, both implementations together (iterations are chosen
from a warm-up)."""


def _time_interleaved(t: torch.Tensor, iters: int, ours_first: bool) -> dict[str, float]:
    """Seconds per call of ours and torch's, over ``iters`` alternating pairs of calls.

    Each call is timed on its own and the two implementations alternate call by call (the pair
    order flips every call), so load from other processes on the machine hits both alike.
    """
    fns = [("ours", _ours), ("torch", _torch)]
    if not ours_first:
        fns.reverse()
    total = {"ours": 0.0, "torch": 0.0}
    clock = time.perf_counter
    tdist.barrier()
    for i in range(iters):
        for name, fn in fns if i % 2 == 0 else fns[::-1]:
            start = clock()
            fn(t)
            total[name] += clock() - start
    return {k: v / iters for k, v in total.items()}


def _ours(t: torch.Tensor) -> None:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)


def _torch(t: torch.Tensor) -> None:
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM)


def bench_worker(sizes_mib: list[int], reps: int, result_path: str) -> None:
    """One rank: warm up, pick iterations per size, then time ours/torch alternately."""
    env = dist.init_parallel_env(backend="gloo", timeout_s=300)
    results: dict[str, Any] = {}
    for mib in sizes_mib:
        nbytes = mib * 1024 * 1024
        # zeros stay zeros under SUM: no overflow to inf, no denormals
        t = torch.zeros(nbytes // 4, dtype=torch.float32)
        for fn in (_ours, _torch, _ours, _torch):
            fn(t)
        probe = torch.tensor([max(_time_interleaved(t, 2, True).values())])
        tdist.all_reduce(probe, op=tdist.ReduceOp.MAX)
        # both implementations run ``iters`` times per repetition: 2 * iters calls in total
        iters = max(2, min(200, round(TARGET_MEASURE_S / 2 / max(probe.item(), 1e-6))))
        times: dict[str, list[float]] = {"ours": [], "torch": []}
        for rep in range(reps):
            for name, sec in _time_interleaved(t, iters, rep % 2 == 0).items():
                times[name].append(sec)
        gathered: list[Any] = []
        dist.all_gather_object(gathered, times)
        # the slowest rank's time is the collective's time
        slowest = {
            k: [max(per_rank[k][i] for per_rank in gathered) for i in range(reps)] for k in times
        }
        results[str(mib)] = {"bytes": nbytes, "iters": iters, "seconds": slowest}
    if env.rank == 0:
        Path(result_path).write_text(json.dumps(results))
    dist.destroy_process_group()


def bus_bandwidth_gbs(nbytes: int, seconds: float, world: int = WORLD_SIZE) -> float:
    """All-reduce bus bandwidth in GB/s (1e9 bytes/s)."""
    return 2 * (world - 1) / world * nbytes / seconds / 1e9


def machine_info() -> dict[str, Any]:
    """What the numbers depend on."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": "gloo",
        "world_size": WORLD_SIZE,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
    }


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """min/median/max bus bandwidth per implementation and the ours/torch ratios, per size."""
    out: dict[str, Any] = {}
    for mib, r in raw.items():
        bw = {k: [bus_bandwidth_gbs(r["bytes"], s) for s in v] for k, v in r["seconds"].items()}
        stats = {
            k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in bw.items()
        }
        paired = [o / t for o, t in zip(bw["ours"], bw["torch"])]
        out[mib] = {
            "bytes": r["bytes"],
            "iters_per_rep": r["iters"],
            "reps": len(paired),
            "busbw_gbs": stats,
            "busbw_gbs_all": bw,
            "ratio_of_medians": stats["ours"]["median"] / stats["torch"]["median"],
            "median_paired_ratio": statistics.median(paired),
        }
    return out


def print_report(info: dict[str, Any], summary: dict[str, Any]) -> None:
    """The table a reader compares."""
    print("all_reduce bus bandwidth, collective.all_reduce vs torch.distributed.all_reduce")
    print(
        f"machine: {info['cpu_count']} CPUs ({info['cpu_model'] or 'unknown model'}), "
        f"torch {info['torch']}, python {info['python']}, {info['backend']}, "
        f"{info['world_size']} ranks, OMP_NUM_THREADS={info['omp_num_threads']}"
    )
    print(
        f"{'size':>7} {'impl':>6} {'min GB/s':>9} {'median':>9} {'max':>9}   {'reps x iters':>12}"
    )
    for mib, s in summary.items():
        for impl in ("ours", "torch"):
            st = s["busbw_gbs"][impl]
            print(
                f"{mib + ' MiB':>7} {impl:>6} {st['min']:9.3f} {st['median']:9.3f} "
                f"{st['max']:9.3f}   {s['reps']:>5} x {s['iters_per_rep']:<5}"
            )
        print(
            f"{mib + ' MiB':>7} ratio ours/torch: {s['ratio_of_medians']:.3f} (of medians), "
            f"{s['median_paired_ratio']:.3f} (median of paired repetitions); goal >= 0.97"
        )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the report, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="repetitions per size (>= 5)")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error(f"--reps {args.reps}: need at least 5 repetitions for a median")
    logging.basicConfig(level=logging.WARNING)
    info = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-allreduce-") as tmp:
        result_path = os.path.join(tmp, "raw.json")
        start = time.monotonic()
        dist.spawn(
            bench_worker,
            args=(args.sizes_mib, args.reps, result_path),
            nprocs=WORLD_SIZE,
            backend="gloo",
            log_dir=tmp,
        )
        raw = json.loads(Path(result_path).read_text())
    summary = summarize(raw)
    info["wall_s"] = round(time.monotonic() - start, 1)
    print_report(info, summary)
    print(f"total {info['wall_s']} s")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "results": summary}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
