"""Launcher overheads, fleetrun vs torchrun, measured alternately in the same run.

1. launch-to-exit of a trivial 2-rank gloo barrier job (goal: fleetrun/torchrun <= 1.10);
2. time from a rank's death (it writes time.time() then exits 1, the other rank waits in a
   barrier) to the launcher's exit (goal: <= 2 s and no slower than torchrun).

torchrun runs with a static rendezvous on an explicit free port (its fastest single-node set-up).
Usage: ``python bench/bench_launch.py [--reps 7] [--json PATH]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Stats, bench_env, fleetrun_cmd, report, torchrun_cmd

from collective.env import find_free_port

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "barrier_job.py")


def _cmd(which: str, log_dir: str, *job_args: str) -> list[str]:
    if which == "fleetrun":
        return fleetrun_cmd(
            "--nproc_per_node", "2", "--log_dir", log_dir, "--tee", "none", JOB, *job_args
        )
    return torchrun_cmd(
        "--nproc_per_node", "2", "--master_port", str(find_free_port()), JOB, *job_args
    )


def launch_to_exit(which: str, log_dir: str) -> float:
    import subprocess

    t0 = time.perf_counter()
    r = subprocess.run(
        _cmd(which, log_dir),
        capture_output=True,
        text=True,
        env=bench_env(),
        timeout=300,
        check=False,
    )
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{which} failed:\n{r.stderr[-3000:]}")
    return dt


def death_to_exit(which: str, log_dir: str) -> float:
    import subprocess

    stamp = os.path.join(log_dir, f"{which}.stamp")
    r = subprocess.run(
        _cmd(which, log_dir, "--die_rank", "1", "--stamp", stamp),
        capture_output=True,
        text=True,
        env=bench_env(),
        timeout=300,
        check=False,
    )
    end = time.time()
    if r.returncode == 0:
        raise RuntimeError(f"{which} exited 0 although a rank died")
    with open(stamp) as f:
        return end - float(f.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    times: dict[str, dict[str, list[float]]] = {
        "launch": {"fleetrun": [], "torchrun": []},
        "death": {"fleetrun": [], "torchrun": []},
    }
    with tempfile.TemporaryDirectory() as tmp:
        launch_to_exit("fleetrun", tmp), launch_to_exit("torchrun", tmp)  # warm the page cache
        for rep in range(args.reps):
            order = ("fleetrun", "torchrun") if rep % 2 == 0 else ("torchrun", "fleetrun")
            for which in order:
                times["launch"][which].append(launch_to_exit(which, tmp))
                times["death"][which].append(death_to_exit(which, tmp))
    report(
        "fleetrun vs torchrun: launcher overheads",
        [
            (
                "launch-to-exit, 2-rank gloo barrier job",
                Stats.of(times["launch"]["fleetrun"]),
                Stats.of(times["launch"]["torchrun"]),
                "fleetrun/torchrun time",
            ),
            (
                "rank death to launcher exit",
                Stats.of(times["death"]["fleetrun"]),
                Stats.of(times["death"]["torchrun"]),
                "fleetrun/torchrun time",
            ),
        ],
        goal="launch <= 1.10; death-to-exit <= 2 s and <= torchrun",
        json_path=args.json,
    )


if __name__ == "__main__":
    main()
