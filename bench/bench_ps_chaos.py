"""Chaos goal of PS recovery: a 2-server, 2-trainer CTR stream keeps going while its
processes are SIGKILLed, and ends where an undisturbed run of the same data ends.

Three fleetrun jobs of ``examples/ctr/train_ps.py`` (async, InMemoryDataset over slot files,
``--ps_checkpoint_dir``, ``--ps_checkpoint_interval``), each in its own directory:

1. **undisturbed** — the peer: the final test AUC to match, and the stream's length;
2. **servers** — a random server SIGKILLed every ``--period`` seconds *of training* (counted
   from the moment the previous recovery's trainers stepped again, so the job always progresses;
   no kill in the last 15% of the steps);
3. **trainers** — the same with a random trainer.

Measured per kill: recovery time (kill → trainer 0's first step of the next attempt, from its
progress file; async server kills restart that server alone in the same attempt: kill → trainer
0's first step after the new server is up, from its progress file's time, at most ~1 s late;
async trainer kills restart that trainer alone from its data position: kill → the restarted
trainer's first step, ``first_step_unix`` of its progress file),
steps redone (from the job's recovery lines), for the trainer runs how long the *other* trainer
did not step (restart-all: until its first step of the next attempt; in place: its longest
stretch without a step between the kill and the restarted trainer's first step), and each
trainer's longest stretch without a step that spans a kill (``trainer_longest_gap_s``) and over
the whole run (``trainer_longest_gap_any_s``, also measured on the undisturbed run: the
baseline), both at the progress files' ~1 s resolution. Per run: final AUC minus the undisturbed one, wall time,
recoveries, orphans (any process whose command line names the run's directory, after fleetrun
exited), and files left outside the job's directories (``/dev/shm`` entries that appeared; the
run's own directory holds only ``log/``, ``ckpt/`` and the result file). Medians with min/max.

With ``--cache_rows N`` every job's tables are SSD tables keeping N rows per table per server in
memory (fleetrun ``--ps_ssd_dir`` in the job's directory).

Run: ``.venv/bin/python bench/bench_ps_chaos.py [--lines 150000] [--json out.json]``
(~15 minutes on 2 cores). Exit status 1 when a run did not complete or left orphans.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def gen_data(out: Path, lines: int) -> None:
    subprocess.run(
        [
            sys.executable,
            "examples/ctr/gen_slot_files.py",
            "--out_dir",
            str(out),
            "--num_files",
            "2",
            "--lines_per_file",
            str(lines),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def orphans(marker: str) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid():
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def summary(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {
        "n": len(values),
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def in_place(state: dict[str, Any], n: int) -> bool:
    """Whether recovery ``n`` of the job restarted the dead process alone."""
    lines = state.get("recoveries", [])
    return len(lines) >= n and "in place" in lines[n - 1]


def watch_steps(log: Path, advances: dict[int, list[tuple[float, int]]]) -> None:
    """Append (time, step) whenever a trainer's progress file shows a new step (the files are
    written at most once a second: ~1 s resolution)."""
    for rank, seen in advances.items():
        p = read_json(log / f"ps_progress.{rank}.json") or {}
        if isinstance(p.get("step"), int) and (not seen or p["step"] != seen[-1][1]):
            seen.append((float(p.get("unix", time.time())), p["step"]))


def longest_gap(seen: list[tuple[float, int]], kills: list[dict[str, Any]]) -> float | None:
    """Longest time between two step advances of one trainer that spans a kill."""
    gaps = [
        b[0] - a[0] for a, b in zip(seen, seen[1:]) if any(a[0] <= k["unix"] <= b[0] for k in kills)
    ]
    return round(max(gaps), 3) if gaps else None


def gap_within(seen: list[tuple[float, int]], lo: float, hi: float) -> float | None:
    """Longest time between two step advances of one trainer overlapping [lo, hi]."""
    gaps = [b[0] - a[0] for a, b in zip(seen, seen[1:]) if a[0] <= hi and b[0] >= lo]
    return round(max(gaps), 3) if gaps else None


def run_job(root: Path, data: Path, args: argparse.Namespace, victim: str | None) -> dict[str, Any]:
    """One fleetrun; ``victim``: None, "server" or "trainer"."""
    root.mkdir(parents=True)
    log, ckpt, result = root / "log", root / "ckpt", root / "result.json"
    shm_before = shm_entries()
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "--server_num",
        "2",
        "--worker_num",
        "2",
        "--log_dir",
        str(log),
        "--ps_checkpoint_dir",
        str(ckpt),
        "--ps_checkpoint_interval",
        str(args.interval),
        "--ps_checkpoint_keep",
        "2",
        "--max_restarts",
        "100",
        "--tee",
        "none",
        "--grace_period",
        "2",
        "--warm_start",
        args.warm_start,
        *(["--ps_ssd_dir", str(root / "ssd")] if args.cache_rows else []),
        str(REPO / "examples/ctr/train_ps.py"),
        "--data_dir",
        str(data),
        "--test",
        str(args.test),
        "--batch_size",
        str(args.batch_size),
        "--mode",
        args.mode,
        "--json",
        str(result),
        *(["--storage", "ssd", "--cache_rows", str(args.cache_rows)] if args.cache_rows else []),
    ]
    local_batch = args.batch_size // 2
    total_steps = args.lines // local_batch
    rng = random.Random(args.seed)
    kills: list[dict[str, Any]] = []
    advances: dict[int, list[tuple[float, int]]] = {0: [], 1: []}
    t0 = time.time()
    with open(root / "stderr.txt", "w") as err, open(root / "stdout.txt", "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=str(root),
            stdout=out,
            stderr=err,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            attempt, resumed_at = 0, None
            while proc.poll() is None:
                time.sleep(0.1)
                watch_steps(log, advances)
                if victim is None:
                    continue
                p0 = read_json(log / "ps_progress.0.json") or {}
                state = read_json(log / "job_state.json") or {}
                if (
                    kills
                    and "recovery_s" not in kills[-1]
                    and args.in_place
                    and kills[-1]["role"] == "trainer"
                ):
                    # restarted alone (async): same attempt; recovered at its first step
                    k = kills[-1]
                    pk = read_json(log / f"ps_progress.{k['rank']}.json") or {}
                    first = pk.get("first_step_unix")
                    if (
                        (pk.get("resumed") or {}).get("alone")
                        and first
                        and float(first) > k["unix"]
                    ):
                        k["recovery_s"] = round(float(first) - k["unix"], 3)
                        k["in_place"], resumed_at = True, float(first)
                    if int(state.get("attempt", attempt)) <= attempt:
                        continue
                    attempt = int(state["attempt"])  # fleetrun restarted every process instead
                if (
                    kills
                    and "recovery_s" not in kills[-1]
                    and args.in_place
                    and kills[-1]["role"] == "server"
                ):
                    # restarted alone (async/GEO): same attempt; recovered when trainer 0 steps
                    # again after the new server is up (its progress file's time, <= 1 s late)
                    k = kills[-1]
                    if not in_place(state, len(kills)):
                        continue
                    up = [
                        p
                        for p in state.get("processes", [])
                        if p["role"] == k["role"]
                        and p["rank"] == k["rank"]
                        and p["state"] == "up"
                        and p["pid"] != k["pid"]
                    ]
                    if "up_step" not in k and up:
                        k["up_step"] = int(p0.get("step", 0))
                    elif "up_step" in k and int(p0.get("step", 0)) > k["up_step"]:
                        k["recovery_s"] = round(float(p0["unix"]) - k["unix"], 3)
                        k["in_place"] = True
                        resumed_at = float(p0["unix"])
                    continue
                if p0.get("attempt") != attempt or not p0.get("first_step_unix"):
                    continue
                if resumed_at is None:
                    resumed_at = float(p0["first_step_unix"])
                    if kills:
                        kills[-1]["recovery_s"] = round(resumed_at - kills[-1]["unix"], 3)
                        other = read_json(log / f"ps_progress.{1 - kills[-1]['rank']}.json") or {}
                        if victim == "trainer" and other.get("first_step_unix"):
                            kills[-1]["other_trainer_gap_s"] = round(
                                float(other["first_step_unix"]) - kills[-1]["last_step_unix"], 3
                            )
                if (
                    time.time() - resumed_at < args.period
                    or int(p0.get("step", 0)) > 0.85 * total_steps
                ):
                    continue
                if state.get("attempt") != attempt:
                    continue
                role = "server" if victim == "server" else "trainer"
                alive = [
                    p
                    for p in state.get("processes", [])
                    if p["role"] == role and p["state"] == "up"
                ]
                if not alive:
                    continue
                target = rng.choice(alive)
                p_other = read_json(log / f"ps_progress.{1 - target['rank']}.json") or {}
                os.kill(int(target["pid"]), signal.SIGKILL)
                kills.append(
                    {
                        "role": role,
                        "rank": target["rank"],
                        "unix": time.time(),
                        "pid": target["pid"],
                        "step": p0.get("step"),
                        "last_step_unix": float(p_other.get("unix", time.time())),
                    }
                )
                print(
                    f"  [{root.name}] killed {role} {target['rank']} at step ~{p0.get('step')} "
                    f"({time.time() - t0:.0f} s)",
                    flush=True,
                )
                attempt, resumed_at = attempt + (0 if args.in_place else 1), None
            rc = proc.wait(timeout=args.timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    wall = time.time() - t0
    time.sleep(2)
    left = orphans(str(root))
    state = read_json(log / "job_state.json") or {}
    redone = []
    for line in state.get("recoveries", []):
        if "steps redone" in line and "~" in line.rsplit(";", 1)[-1]:
            redone.append(int(line.rsplit("~", 1)[-1].split()[0]))
    for k in kills:  # in place: the other trainer's longest stretch without a step meanwhile
        if k.get("in_place") and k["role"] == "trainer":
            k["other_trainer_gap_s"] = gap_within(
                advances[1 - k["rank"]], k["unix"], k["unix"] + k["recovery_s"]
            )
    res = read_json(result) or {}
    outside = sorted(shm_entries() - shm_before)
    extra_files = sorted(
        p.name
        for p in root.iterdir()
        if p.name not in {"log", "ckpt", "result.json", "stderr.txt", "stdout.txt"}
    )
    return {
        "victim": victim,
        "rc": rc,
        "wall_s": round(wall, 1),
        "test_auc": res.get("test_auc"),
        "train_seconds_last_attempt": res.get("train_seconds"),
        "kills": kills,
        "recovery_s": summary([k["recovery_s"] for k in kills if "recovery_s" in k]),
        "other_trainer_gap_s": summary(
            [k["other_trainer_gap_s"] for k in kills if k.get("other_trainer_gap_s") is not None]
        ),
        "steps_redone": summary([float(r) for r in redone]),
        "in_place": sum(1 for k in kills if k.get("in_place")),
        "trainer_longest_gap_s": {r: longest_gap(a, kills) for r, a in advances.items()}
        if kills
        else {},
        "trainer_longest_gap_any_s": {
            r: gap_within(a, 0.0, float("inf")) for r, a in advances.items()
        },
        "recoveries": len(state.get("recoveries", [])),
        "orphans": left,
        "new_shm_entries": outside,
        "files_outside_job_dirs": extra_files,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--lines", type=int, default=150_000, help="examples per trainer (one file each)"
    )
    p.add_argument("--batch_size", type=int, default=64, help="global batch")
    p.add_argument("--mode", default="async", choices=["async", "sync"])
    p.add_argument("--interval", type=float, default=5.0, help="--ps_checkpoint_interval")
    p.add_argument("--period", type=float, default=30.0, help="seconds of training between kills")
    p.add_argument("--test", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--runs", default="undisturbed,server,trainer")
    p.add_argument(
        "--warm_start",
        default="off",
        choices=["on", "off"],
        help="fleetrun's --warm_start (restarted processes forked from the warm process)",
    )
    p.add_argument(
        "--cache_rows",
        type=int,
        default=0,
        help="SSD tables keeping this many rows per table per server in memory (0: memory tables)",
    )
    p.add_argument("--json", default="")
    args = p.parse_args()
    args.in_place = args.mode == "async"  # fleetrun restarts a dead server or trainer alone
    with tempfile.TemporaryDirectory(prefix="bench_ps_chaos_") as tmp:
        data = Path(tmp) / "data"
        gen_data(data, args.lines)
        results = {}
        for name in args.runs.split(","):
            victim = None if name == "undisturbed" else name
            print(f"run {name} ...", flush=True)
            results[name] = run_job(Path(tmp) / name, data, args, victim)
            print(json.dumps({k: v for k, v in results[name].items() if k != "kills"}), flush=True)
    base = (results.get("undisturbed") or {}).get("test_auc")
    for r in results.values():
        if base is not None and r.get("test_auc") is not None:
            r["auc_minus_undisturbed"] = round(r["test_auc"] - base, 5)
    out = {"args": vars(args), "uptime": os.popen("uptime").read().strip(), "results": results}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    bad = [n for n, r in results.items() if r["rc"] != 0 or r["orphans"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
