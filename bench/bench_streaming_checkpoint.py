"""What fleetrun's automatic checkpoints cost the day/pass loop: the same stream
trained by ``examples/ctr/online.py`` (``fleet.train_days``) with and without
``--ps_checkpoint_dir``, 1 server + 1 trainer, async, jobs alternating.

With checkpoints the loop cuts one job checkpoint at the start and after every save (each pass's
delta, each day's base): a full copy of the servers' tables, committed before the donefile record
(:mod:`fleet.streaming`). The table gives, per side, the median [min .. max] over every pass of
every run (n = passes x reps) of the whole-pass examples/s (validation + training + delta save +
the cut, as ``PassResult.pass_seconds`` measures it) and of the training examples/s
(``train_from_dataset`` alone: the cuts are outside it), the job's wall time per run (process
start and the day-end base and cut included), the ratios (with / without), and the progressive
AUC of the last pass (the cuts change no number the model sees).

Usage: ``python bench/bench_streaming_checkpoint.py [--reps 5] [--days 2] [--passes 3] [--lines 25000]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import REPO, Stats, bench_env, fleetrun_cmd, machine_info

from examples.ctr.gen_slot_files import SlotFiles, write_day_pass_files

ONLINE = os.path.join(REPO, "examples", "ctr", "online.py")
DAY0 = 20261120


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="jobs per side (alternating)")
    p.add_argument("--days", type=int, default=2)
    p.add_argument("--passes", type=int, default=3, help="passes per day")
    p.add_argument("--files", type=int, default=2, help="files per pass")
    p.add_argument("--lines", type=int, default=25000, help="examples per file")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--json", default="", help="write the results here too")
    return p.parse_args()


def run_job(
    work: str, data: str, days: list[str], checkpoints: bool, timeout: float
) -> tuple[list[dict[str, Any]], float]:
    """One fleetrun job: its per-pass records and its wall time."""
    out = os.path.join(work, "passes.jsonl")
    extra = (
        ["--ps_checkpoint_dir", os.path.join(work, "ckpt"), "--ps_checkpoint_keep", "2"]
        if checkpoints
        else []
    )
    cmd = fleetrun_cmd(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--log_dir",
        os.path.join(work, "log"),
        *extra,
        ONLINE,
        "--data_root",
        data,
        "--output_dir",
        "model",
        "--days",
        ",".join(days),
        "--batch_size",
        "512",
        "--mode",
        "async",
        "--shrink_unseen_days",
        "30",
        "--json",
        out,
    )
    t0 = time.perf_counter()
    r = subprocess.run(
        cmd,
        cwd=work,
        env={**bench_env(), "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"job failed ({r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    with open(out, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()], wall


def main() -> None:
    args = parse_args()
    days = [str(DAY0 + d) for d in range(args.days)]
    tmp = tempfile.mkdtemp(prefix="bench_streaming_ckpt_")
    try:
        data = os.path.join(tmp, "data")
        write_day_pass_files(data, SlotFiles(args.files, args.lines), days, args.passes)
        runs: dict[str, list[tuple[list[dict[str, Any]], float]]] = {"with": [], "without": []}
        load = []
        for rep in range(args.reps):
            for side in ("without", "with") if rep % 2 == 0 else ("with", "without"):
                work = os.path.join(tmp, f"{side}-{rep}")
                os.makedirs(work)
                load.append(round(os.getloadavg()[0], 1))
                runs[side].append(run_job(work, data, days, side == "with", args.timeout))
                print(
                    f"[bench_streaming_checkpoint] {side} checkpoints, run {rep}: "
                    f"{runs[side][-1][1]:.1f} s",
                    flush=True,
                )
                shutil.rmtree(work, ignore_errors=True)
        report(args, runs, load)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(
    args: argparse.Namespace,
    runs: dict[str, list[tuple[list[dict[str, Any]], float]]],
    load: list[float],
) -> None:
    stats: dict[str, dict[str, Any]] = {}
    for side, jobs in runs.items():
        passes = [p for records, _ in jobs for p in records]
        stats[side] = {
            "pass": Stats.of([p["pass_examples_per_s"] for p in passes]),
            "train": Stats.of([p["train_examples_per_s"] for p in passes]),
            "wall": Stats.of([wall for _, wall in jobs]),
            "pass_s": Stats.of([p["pass_s"] for p in passes]),
            "last_auc": [round(records[-1]["progressive_auc"], 4) for records, _ in jobs],
        }
    info = machine_info()
    print(
        f"== fleet.train_days with / without fleetrun's automatic checkpoints ==  ({info['date']}, "
        f"{info['cpus']} CPUs, 1 server + 1 trainer, async, {args.days} days x {args.passes} passes "
        f"x {args.files * args.lines} examples, {args.reps} run(s) per side)"
    )
    for key, label, unit, digits in (
        ("pass", "whole-pass examples/s (validation + training + delta + cut)", "ex/s", 0),
        ("train", "training examples/s (train_from_dataset)", "ex/s", 0),
        ("wall", "job wall time", "s", 1),
    ):
        w, wo = stats["with"][key], stats["without"][key]
        print(
            f"{label}\n  with     : {w.fmt(unit, digits=digits)}\n  without  : {wo.fmt(unit, digits=digits)}\n"
            f"  ratio    = {w.median / wo.median:.3f} (with / without)"
        )
    added = stats["with"]["pass_s"].median - stats["without"]["pass_s"].median
    print(
        f"seconds per pass: with {stats['with']['pass_s'].fmt('s', digits=2)}, without "
        f"{stats['without']['pass_s'].fmt('s', digits=2)}; the cut adds ~{added:.2f} s per pass "
        "(a full copy of the tables, whatever the pass's length)"
    )
    print(
        f"progressive AUC of the last pass: with {stats['with']['last_auc']}, "
        f"without {stats['without']['last_auc']}"
    )
    print(f"load average at the start of each job: {load}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "runs": runs, "load": load}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
