"""Parameter-server training from files side by side with PaddlePaddle 2.6.2's own parameter
server (goal: >= 1.3x in examples/s in each epoch, at equal or better AUC): the same MultiSlot
files, the same model, 1 server + 1 trainer, async, ``thread_num`` = 2 on both sides.

Three jobs per round, in an order that rotates from round to round:

* **Paddle:** ``python -m paddle.distributed.launch --server_num 1 --trainer_num 1
  bench/ps_files_paddle_worker.py`` under ``bench/.venv-paddle26`` (``bench/setup_paddle26_venv.sh``;
  the 3.x wheels have no PS core): ``exe.train_from_dataset(program, dataset, thread=2)`` per
  epoch over Paddle's ``InMemoryDataset(thread_num=2)``;
* **ours, train_from_dataset:** ``fleetrun --server_num 1 --worker_num 1
  bench/ps_files_worker.py --variant tfd``: ``fleet.train_from_dataset(model, opt, ds,
  torch.nn.CrossEntropyLoss(), label="click", print_period=100)`` per epoch over
  ``fleet.InMemoryDataset`` (``thread_num=2``), default settings (nothing tuned by hand): the
  dataset's ``thread_num`` gives it two hogwild training threads, as Paddle's ``thread=2``;
* **ours, the guide's loop:** the same job with ``--variant loop``: ``for batch in ds: ...
  loss.backward(); opt.step(); opt.zero_grad()``, on one thread.

Data: ``--files`` x ``--lines`` MultiSlot lines (``1 <click> 1 <id> x 26``), written once per run
into a temp dir from :mod:`examples.ctr.data` (seed 0; Zipf(1.15) ids over 100k ranks per
slot; the click drawn from a hidden per-id weight of the 1000 most frequent ranks of each slot,
no dense feature). Model on both sides: one sparse table of dim 8 (Adagrad lr 0.05 on the
server, the sparse rule of ``bench_ps_paddle.py``), the 26 rows sum-pooled per slot and
concatenated (208), MLP 64-32-2 (Adam lr 1e-3 on the server), softmax cross-entropy, batch 512.

Timed on both sides, inside the trainer: each epoch's training call alone (Paddle's
``train_from_dataset``, ours' ``train_from_dataset`` or the loop, each with its AUC
bookkeeping); the job's start, the load into memory and the stop are not in it. Epoch 1 creates
every row on the server, epoch 2 finds them. AUC per epoch: the class-1 softmax probability's
4096-bucket histogram AUC over that epoch (Paddle: ``paddle.static.auc``'s statistics, zeroed
between epochs; ours: ``TrainStats.local_auc`` / a ``fleet.metrics.AucState`` per epoch).

The table gives, per epoch and side, the median [min .. max] over ``--rounds`` rounds, the
ratio of medians ours / Paddle and the per-round ratios. Without ``bench/.venv-paddle26`` the
Paddle column is skipped with how to make it. A job that fails is reported with its error and the
run goes on; its figures are left out.

Usage: ``python bench/bench_ps_files.py [--quick] [--rounds 5] [--files 4] [--lines 100000]
[--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_ps_paddle import _kill_group, _read_jsonl
from common import REPO, Stats, bench_env, fleetrun_cmd, machine_info

from examples.ctr.data import CTRDataConfig, bayes_auc, generate

PADDLE_PYTHON = os.path.join(REPO, "bench", ".venv-paddle26", "bin", "python")
PADDLE_WORKER = os.path.join(REPO, "bench", "ps_files_paddle_worker.py")
OUR_WORKER = os.path.join(REPO, "bench", "ps_files_worker.py")
SIDES = ("paddle", "tfd", "loop")
NAMES = {
    "paddle": "Paddle 2.6.2 train_from_dataset",
    "tfd": "ours, fleet.train_from_dataset",
    "loop": "ours, the guide's loop",
}
# the click depends on the ids only (the files hold no dense feature)
DATA = CTRDataConfig(dense_weight_scale=0.0, seed=0)
_CHUNK = 65536


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 files x 10k lines (development)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the three jobs")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--lines", type=int, default=100_000, help="examples per file")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="thread_num on both sides")
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--json", default="", help="write the results here too")
    p.add_argument("--keep_work", action="store_true", help="keep the data and the jobs' logs")
    args = p.parse_args(argv)
    if args.quick:
        args.lines = min(args.lines, 10_000)
    return args


def write_files(out_dir: str, files: int, lines: int) -> list[str]:
    """``files`` MultiSlot files of ``lines`` examples each (click + 26 one-id slots)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for k in range(files):
        path = os.path.join(out_dir, f"part-{k:05d}")
        with open(path, "w", encoding="utf-8") as f:
            for lo in range(0, lines, _CHUNK):
                b = generate(DATA, min(_CHUNK, lines - lo), k * lines + lo)
                f.writelines(
                    f"1 {int(y)} 1 " + " 1 ".join(map(str, ids)) + "\n"
                    for y, ids in zip(b.labels.tolist(), b.sparse_ids.tolist(), strict=True)
                )
        paths.append(path)
    return paths


def run_paddle(work: str, files: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One Paddle job; its per-epoch records. Stopped once the trainer wrote ``done``."""
    out = os.path.join(work, "epochs.jsonl")
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
        os.path.join(work, "log"),
        PADDLE_WORKER,
        "--files",
        ",".join(files),
        "--out",
        out,
        "--epochs",
        str(args.epochs),
        "--threads",
        str(args.threads),
    ]
    with open(os.path.join(work, "launch.log"), "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + args.timeout
    try:
        while time.monotonic() < deadline:
            records = _read_jsonl(out)
            if records and records[-1].get("done"):
                return records[:-1]
            if proc.poll() is not None:
                raise RuntimeError(
                    f"Paddle's job exited {proc.returncode} before its last epoch; "
                    f"see {work}/log/workerlog.0"
                )
            time.sleep(0.5)
        raise RuntimeError(f"Paddle's job did not finish in {args.timeout:.0f} s; see {work}/log")
    finally:
        _kill_group(proc)


def run_ours(
    work: str, files: list[str], args: argparse.Namespace, variant: str
) -> list[dict[str, Any]]:
    """One fleetrun job; its per-epoch records."""
    out = os.path.join(work, "epochs.jsonl")
    cmd = fleetrun_cmd(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--log_dir",
        os.path.join(work, "log"),
        OUR_WORKER,
        "--files",
        ",".join(files),
        "--out",
        out,
        "--variant",
        variant,
        "--epochs",
        str(args.epochs),
        "--threads",
        str(args.threads),
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
        text, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise RuntimeError(f"fleetrun's job did not finish in {args.timeout:.0f} s") from None
    records = _read_jsonl(out)
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        raise RuntimeError(f"the trainer failed: {errors[0]}")
    if proc.returncode != 0:
        raise RuntimeError(f"fleetrun's job failed ({proc.returncode}):\n{text[-3000:]}")
    return records


def run_side(side: str, work: str, files: list[str], args: argparse.Namespace):
    if side == "paddle":
        return run_paddle(work, files, args)
    return run_ours(work, files, args, side)


def summarize(runs: dict[str, list[list[dict]]], epochs: int) -> dict[str, Any]:
    """Per side and epoch: Stats of examples/s, the AUCs; per variant and epoch: per-round
    ratios (rounds where both jobs ran)."""
    out: dict[str, Any] = {}
    for side, side_runs in runs.items():
        done = [r for r in side_runs if r]
        out[side] = {
            str(e): {
                "examples_per_s": asdict(Stats.of([r[e - 1]["examples_per_s"] for r in done]))
                if done
                else None,
                "auc": [round(r[e - 1]["auc"], 5) for r in done],
            }
            for e in range(1, epochs + 1)
        }
    paddle = runs.get("paddle", [])
    for side in ("tfd", "loop"):
        for e in range(1, epochs + 1):
            out[side][str(e)]["round_ratios"] = [
                round(o[e - 1]["examples_per_s"] / p[e - 1]["examples_per_s"], 3)
                for o, p in zip(runs[side], paddle, strict=False)
                if o and p
            ]
    return out


def print_table(summary: dict[str, Any], epochs: int, have_paddle: bool) -> None:
    for e in range(1, epochs + 1):
        what = "creates the rows" if e == 1 else "rows exist"
        print(f"epoch {e} ({what}): examples/s, median [min .. max]; AUC per round")
        for side in SIDES:
            s = summary.get(side, {}).get(str(e))
            if not s or s["examples_per_s"] is None:
                print(f"  {NAMES[side]:34s}: not measured")
                continue
            st = Stats(**s["examples_per_s"])
            line = f"  {NAMES[side]:34s}: {st.fmt('ex/s', digits=0)}  AUC {s['auc']}"
            if side != "paddle" and have_paddle and summary["paddle"][str(e)]["examples_per_s"]:
                ratio = st.median / summary["paddle"][str(e)]["examples_per_s"]["median"]
                line += f"\n    ratio ours/Paddle = {ratio:.2f} (per round {s['round_ratios']})"
                line += "   goal >= 1.3"
            print(line)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    have_paddle = os.access(PADDLE_PYTHON, os.X_OK)
    if not have_paddle:
        print(
            f"[bench_ps_files] Paddle column skipped: no {PADDLE_PYTHON}; run "
            "bench/setup_paddle26_venv.sh (PaddlePaddle 2.6.2 CPU, ~150 MB download) to measure "
            "Paddle's parameter server",
            flush=True,
        )
    tmp = tempfile.mkdtemp(prefix="bench_ps_files_")
    try:
        t0 = time.perf_counter()
        files = write_files(os.path.join(tmp, "data"), args.files, args.lines)
        print(
            f"[bench_ps_files] {args.files} x {args.lines} lines written in "
            f"{time.perf_counter() - t0:.0f} s; Bayes AUC of the data "
            f"{bayes_auc(DATA, min(50_000, args.files * args.lines)):.4f}",
            flush=True,
        )
        run_all(args, tmp, files, have_paddle)
    finally:
        if not args.keep_work:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"[bench_ps_files] kept {tmp}")


def run_all(args: argparse.Namespace, tmp: str, files: list[str], have_paddle: bool) -> None:
    sides = [s for s in SIDES if have_paddle or s != "paddle"]
    runs: dict[str, list[list[dict]]] = {s: [] for s in sides}
    failures: list[dict[str, Any]] = []
    load: list[float] = []
    job_s: dict[str, list[float]] = {s: [] for s in sides}
    start = time.perf_counter()
    for rnd in range(args.rounds):
        k = rnd % len(sides)
        for side in sides[k:] + sides[:k]:
            work = os.path.join(tmp, f"{side}-{rnd}")
            os.makedirs(work)
            load.append(os.getloadavg()[0])
            t0 = time.perf_counter()
            try:
                records = run_side(side, work, files, args)
                if len(records) != args.epochs:
                    raise RuntimeError(f"{len(records)} epoch records, expected {args.epochs}")
            except RuntimeError as err:
                records = []
                failures.append({"side": side, "round": rnd, "error": str(err)[:2000]})
                print(f"[bench_ps_files] {NAMES[side]} failed: {err}", flush=True)
            runs[side].append(records)
            job_s[side].append(time.perf_counter() - t0)
            eps = ", ".join(f"{r['examples_per_s']:.0f}" for r in records)
            print(
                f"[bench_ps_files] round {rnd} {side}: {job_s[side][-1]:.0f} s, examples/s per "
                f"epoch [{eps}], AUC {[round(r['auc'], 4) for r in records]}, load "
                f"{os.getloadavg()[0]:.1f}",
                flush=True,
            )
    summary = summarize(runs, args.epochs) if any(runs.values()) else {}
    info = machine_info()
    print(
        f"== PS training from files: fleetrun vs PaddlePaddle 2.6.2 PS ==  ({info['date']}, "
        f"{info['cpus']} CPUs, {args.files} x {args.lines} examples, {args.epochs} epochs, "
        f"thread_num {args.threads}, {args.rounds} rounds, {time.perf_counter() - start:.0f} s)"
    )
    if summary:
        print_table(summary, args.epochs, have_paddle)
    print(f"load average at the start of each job: {[round(u, 1) for u in load]}")
    print(
        f"job wall seconds (median): { {s: round(statistics.median(v)) for s, v in job_s.items()} }"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "machine": info,
                    "setup": {
                        "files": args.files,
                        "lines": args.lines,
                        "epochs": args.epochs,
                        "threads": args.threads,
                        "rounds": args.rounds,
                        "batch_size": 512,
                    },
                    "paddle_skipped": not have_paddle,
                    "runs": runs,
                    "summary": summary,
                    "failures": failures,
                    "load": load,
                    "job_s": job_s,
                    "wall_s": time.perf_counter() - start,
                },
                f,
                indent=2,
                default=str,
            )


if __name__ == "__main__":
    main()
