"""DP step time: fleet.distributed_model under fleetrun vs plain DDP under torchrun.

Same worker script (``bench/dp_step_worker.py``), model, data and optimizer; 2 ranks on CPU/gloo
(NCCL on GPUs). Each repetition launches one job per launcher (order alternates) and takes that
job's median step time (slowest rank); the table shows median [min .. max] over repetitions and
the ratio fleet/ddp (goal <= 1.02).

Usage: ``python bench/bench_dp_step.py [--reps 5] [--steps 30] [--nproc 2] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Stats, fleetrun_cmd, report, run_checked, torchrun_cmd

from collective.env import find_free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dp_step_worker.py")


def one_run(impl: str, nproc: int, steps: int, log_dir: str) -> float:
    args = ["--impl", impl, "--steps", str(steps)]
    if impl == "fleet":
        cmd = fleetrun_cmd("--nproc_per_node", str(nproc), "--log_dir", log_dir, WORKER, *args)
    else:
        cmd = torchrun_cmd(
            "--nproc_per_node", str(nproc), "--master_port", str(find_free_port()), WORKER, *args
        )
    out = run_checked(cmd).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("{") and '"impl"' in ln)
    return float(json.loads(line)["step_time_s_median"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    times: dict[str, list[float]] = {"fleet": [], "ddp": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for impl in ("fleet", "ddp") if rep % 2 == 0 else ("ddp", "fleet"):
                times[impl].append(one_run(impl, args.nproc, args.steps, tmp))
    report(
        f"DP step time, {args.nproc} ranks: fleet.distributed_model under fleetrun vs DDP under torchrun",
        [
            (
                "median step time per job",
                Stats.of(times["fleet"]),
                Stats.of(times["ddp"]),
                "fleet/ddp time",
            )
        ],
        goal="<= 1.02",
        json_path=args.json,
    )


if __name__ == "__main__":
    main()
