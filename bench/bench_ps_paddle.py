"""Online day/pass training side by side with PaddlePaddle 2.6.2's own parameter server
(goal: >= 1.3x): the same stream of slot files, the same model, 1 server + 1 trainer, async.

* **fleetrun:** ``fleetrun --server_num 1 --worker_num 1 examples/ctr/online.py`` —
  ``fleet.train_days`` over ``fleet.data`` InMemoryDatasets, the next batch's rows prefetched
  during each step (``--prefetch 1``, the example's default);
* **Paddle:** ``python -m paddle.distributed.launch --server_num 1 --trainer_num 1
  bench/bench_ps_paddle_worker.py`` under ``bench/.venv-paddle26`` (``bench/setup_paddle26_venv.sh``;
  the 3.x wheels have no PS core) — ``exe.train_from_dataset`` over Paddle's InMemoryDataset.

Model on both sides: 26 one-id slots, one sparse table of dim 8 (Adagrad lr 0.05 on the server,
64 shards), sum-pooled, concatenated with the 13 dense values, MLP 64-32-1 (Adam lr 1e-3 on the
server), batch 512, one reader thread. Per pass on both sides: load the pass into memory (timed
apart: parsing excluded), progressive AUC (the model on the pass before training on it), one
training pass, a delta save (mode 1); per day a base save (mode 0) and a shrink. The stream is
``--days`` x ``--passes`` passes of ``--files`` x ``--lines`` examples
(``examples/ctr/gen_slot_files.py``), written once.

Each job reports every pass; the table gives, per side, the median [min .. max] over the passes of
every run (``--reps`` runs per side, alternating; n = passes x reps) of the training examples/s
(``train_from_dataset`` alone) and of the whole pass (validation + training + delta save; with
checkpoints on, fleetrun's cut after the delta and Paddle's donefile line are in it too), the
ratio of medians (fleetrun / Paddle; goal >= 1.3) and the progressive AUC of the last pass of
each day (goal: fleetrun's >= Paddle's). Paddle 2.6.2's ``stop_worker`` does not return here; the
bench stops its job once the trainer has written its last pass and base.

``--checkpoints on`` (the default; the goal is measured with checkpoints on in both) means,
on each side, everything a job writes so that it can recover:

* **fleetrun:** the job runs under fleetrun's automatic checkpoints (``--ps_checkpoint_dir
  WORK/ckpt --ps_checkpoint_keep 2``): ``fleet.train_days`` cuts a full job checkpoint (every
  server's tables, the trainer's stream position) at the start and after every delta and base,
  committed before the pass's donefile record — in addition to the delta per pass, the base per
  day and the donefile it writes in both settings;
* **Paddle 2.6.2** has no automatic parameter-server checkpoint: an online Paddle job recovers
  from its own saves (``fleet.load_model`` of the last base, then the deltas after it, found
  through a donefile). It saves the delta per pass (mode 1) and the base per day (mode 0) in both
  settings (they are the stream's saves); with ``on`` it also appends a donefile line after each
  save (``day  pass  path  kind``, as Paddle's ``FleetUtil.write_model_donefile``), so what a
  restarted Paddle job needs is complete.

``--checkpoints off``: fleetrun without ``--ps_checkpoint_dir``; Paddle without the donefile.

Without ``bench/.venv-paddle26`` it prints how to make it and exits 0.
Usage: ``python bench/bench_ps_paddle.py [--reps 1] [--days 2] [--passes 3] [--lines 25000]
[--checkpoints on|off]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import REPO, Stats, bench_env, fleetrun_cmd, machine_info

from examples.ctr.gen_slot_files import SlotFiles, write_day_pass_files

PADDLE_PYTHON = os.path.join(REPO, "bench", ".venv-paddle26", "bin", "python")
PADDLE_WORKER = os.path.join(REPO, "bench", "bench_ps_paddle_worker.py")
ONLINE = os.path.join(REPO, "examples", "ctr", "online.py")
DAY0 = 20261120


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=1, help="jobs per side (alternating)")
    p.add_argument("--days", type=int, default=2)
    p.add_argument("--passes", type=int, default=3, help="passes per day")
    p.add_argument("--files", type=int, default=2, help="files per pass")
    p.add_argument("--lines", type=int, default=25000, help="examples per file")
    p.add_argument(
        "--data_dir", default="", help="reuse/keep the stream here (default: a temp dir)"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--json", default="", help="write the results here too")
    p.add_argument("--keep_work", action="store_true", help="keep the runs' models and logs")
    p.add_argument(
        "--checkpoints",
        choices=["on", "off"],
        default="on",
        help="on: fleetrun's automatic checkpoints (--ps_checkpoint_dir) and Paddle's "
        "donefile beside both sides' delta/base saves (module docstring)",
    )
    return p.parse_args()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its process group and every descendant: Paddle's launcher starts its
    server and trainer in sessions of their own, so the group alone leaves them running."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)
    proc.wait(timeout=30)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_paddle(
    work: str, data: str, days: list[str], timeout: float, checkpoints: bool
) -> list[dict[str, Any]]:
    """One Paddle job; its per-pass records. Stopped once the trainer wrote ``done``."""
    out = os.path.join(work, "paddle.jsonl")
    env = bench_env()
    env.update(
        PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python", GLOG_minloglevel="2", PYTHONPATH=REPO
    )
    cmd = [
        PADDLE_PYTHON,
        "-m",
        "paddle.distributed.launch",
        "--server_num",
        "1",
        "--trainer_num",
        "1",
        "--log_dir",
        os.path.join(work, "paddle-log"),
        PADDLE_WORKER,
        "--data_root",
        data,
        "--days",
        ",".join(days),
        "--output_dir",
        os.path.join(work, "paddle-model"),
        "--out",
        out,
        "--donefile",
        "1" if checkpoints else "0",
    ]
    with open(os.path.join(work, "paddle-launch.log"), "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            records = _read_jsonl(out)
            if records and records[-1].get("done"):
                return records[:-1]
            if proc.poll() is not None:
                raise RuntimeError(
                    f"Paddle's job exited {proc.returncode} before its last pass; "
                    f"see {work}/paddle-log/workerlog.0"
                )
            time.sleep(1.0)
        raise RuntimeError(f"Paddle's job did not finish in {timeout:.0f} s; see {work}/paddle-log")
    finally:
        _kill_group(proc)


def run_ours(
    work: str, data: str, days: list[str], timeout: float, checkpoints: bool
) -> list[dict[str, Any]]:
    """One fleetrun job; its per-pass records."""
    out = os.path.join(work, "ours.jsonl")
    auto = (
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
        os.path.join(work, "ours-log"),
        *auto,
        ONLINE,
        "--data_root",
        data,
        "--output_dir",
        "ours-model",
        "--days",
        ",".join(days),
        "--batch_size",
        "512",
        "--embedding_dim",
        "8",
        "--hidden",
        "64,32",
        "--mode",
        "async",
        "--reader_threads",
        "1",
        "--shrink_unseen_days",
        "30",
        "--json",
        out,
    )
    proc = subprocess.Popen(
        cmd,
        cwd=work,
        env={**bench_env(), "PYTHONPATH": REPO},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise RuntimeError(f"fleetrun's job did not finish in {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"fleetrun's job failed ({proc.returncode}):\n{text[-4000:]}")
    if checkpoints and not os.path.isdir(os.path.join(work, "ckpt")):
        raise RuntimeError(f"fleetrun's job wrote no automatic checkpoint under {work}/ckpt")
    return _read_jsonl(out)


def summarize(runs: list[list[dict[str, Any]]], days: list[str]) -> dict[str, Any]:
    passes = [r for run in runs for r in run]
    last = {d: [[r for r in run if r["day"] == d][-1] for run in runs] for d in days}  # per run
    return {
        "train": Stats.of([r["train_examples_per_s"] for r in passes]),
        "pass": Stats.of([r["pass_examples_per_s"] for r in passes]),
        "last_pass_auc": {d: [round(r["progressive_auc"], 4) for r in last[d]] for d in days},
        "progressive_auc": [round(r["progressive_auc"], 4) for r in passes],
        "train_auc": [round(r["train_auc"], 4) for r in passes],
    }


def main() -> None:
    args = parse_args()
    if not os.access(PADDLE_PYTHON, os.X_OK):
        print(
            f"[bench_ps_paddle] skipped: no {PADDLE_PYTHON}; run bench/setup_paddle26_venv.sh "
            "(PaddlePaddle 2.6.2 CPU, ~150 MB download) to measure Paddle's parameter server"
        )
        return
    days = [str(DAY0 + d) for d in range(args.days)]
    keep = args.data_dir
    tmp = tempfile.mkdtemp(prefix="bench_ps_paddle_")
    data = keep or os.path.join(tmp, "data")
    spec = SlotFiles(args.files, args.lines)
    marker = os.path.join(data, "stream.json")
    want = {"spec": [args.files, args.lines], "days": days, "passes": args.passes}
    if not (os.path.exists(marker) and json.load(open(marker)) == want):
        write_day_pass_files(data, spec, days, args.passes)
        with open(marker, "w") as f:
            json.dump(want, f)
    try:
        run_all(args, tmp, data, days)
    finally:
        if not args.keep_work:  # the runs' models and logs (~1 GB per run at the defaults)
            shutil.rmtree(tmp, ignore_errors=True)


def run_all(args: argparse.Namespace, tmp: str, data: str, days: list[str]) -> None:
    checkpoints = args.checkpoints == "on"
    ours_runs, paddle_runs = [], []
    uptime = []
    for rep in range(args.reps):
        for side in ("paddle", "ours") if rep % 2 == 0 else ("ours", "paddle"):
            work = os.path.join(tmp, f"{side}-{rep}")
            os.makedirs(work)
            uptime.append(os.getloadavg()[0])
            t0 = time.perf_counter()
            if side == "ours":
                ours_runs.append(run_ours(work, data, days, args.timeout, checkpoints))
            else:
                paddle_runs.append(run_paddle(work, data, days, args.timeout, checkpoints))
            print(
                f"[bench_ps_paddle] {side} run {rep}: {time.perf_counter() - t0:.0f} s, "
                f"load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    ours, paddle = summarize(ours_runs, days), summarize(paddle_runs, days)
    info = machine_info()
    print(
        f"== online day/pass stream: fleetrun vs PaddlePaddle 2.6.2 PS ==  ({info['date']}, "
        f"{info['cpus']} CPUs, {args.days} days x {args.passes} passes x "
        f"{args.files * args.lines} examples, {args.reps} run(s) per side, checkpoints "
        f"{args.checkpoints})"
    )
    for key, label in (
        ("train", "training examples/s (train_from_dataset)"),
        (
            "pass",
            "whole-pass examples/s (validation + training + delta save"
            + (" + cut)" if checkpoints else ")"),
        ),
    ):
        ratio = ours[key].median / paddle[key].median
        print(
            f"{label}\n  fleetrun : {ours[key].fmt('ex/s', digits=0)}\n"
            f"  paddle   : {paddle[key].fmt('ex/s', digits=0)}\n  ratio    = {ratio:.2f}   goal >= 1.3"
        )
    print(
        f"progressive AUC, last pass of each day: fleetrun {ours['last_pass_auc']}, "
        f"paddle {paddle['last_pass_auc']}"
    )
    print(
        f"progressive AUC per pass: fleetrun {ours['progressive_auc']}\n"
        f"                          paddle   {paddle['progressive_auc']}"
    )
    print(
        f"train AUC per pass:       fleetrun {ours['train_auc']}\n"
        f"                          paddle   {paddle['train_auc']}"
    )
    print(f"load average at the start of each run: {[round(u, 1) for u in uptime]}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "machine": info,
                    "checkpoints": args.checkpoints,
                    "ours": ours_runs,
                    "paddle": paddle_runs,
                    "load": uptime,
                },
                f,
                indent=2,
                default=str,
            )


if __name__ == "__main__":
    main()
