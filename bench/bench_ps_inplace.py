"""In-place PS server recovery on the local scheduler and on Ray, in the same run.

The same async CTR job (``examples/ctr/train_ps.py``, 2 servers + 2 trainers, automatic
checkpoints) runs once per scheduler, on the same data: ``local`` (the peer: the in-place path
that bench_ps_chaos.py measures) and ``ray`` (fleetrun starts
its own loopback Ray cluster for the job). Every ``--period`` seconds of training a random server
process is SIGKILLed (on Ray: the process its actor runs; the actor sees it exit), ``--kills``
times. Each kill must be recovered **in place** (the job's recovery line says so; the trainers'
pids never change); measured per kill: kill → trainer 0's first step after the new server is up
(its progress file's time, written at most once a second: up to ~1 s late). Per run: wall time,
final test AUC, recoveries, orphans (processes naming the run's directory after fleetrun exited).
Medians with min/max, and the Ray/local ratio of the medians.

Run: ``.venv/bin/python bench/bench_ps_inplace.py [--lines 60000] [--kills 5] [--json out.json]``
(~6 minutes on 2 cores). Exit status 1 when a run failed, a kill was not recovered in place, or
a process was left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from bench_ps_chaos import gen_data, orphans, read_json, summary  # noqa: E402


def run_job(root: Path, data: Path, args: argparse.Namespace, scheduler: str) -> dict[str, Any]:
    """One fleetrun on ``scheduler`` with ``args.kills`` server kills; what it measured."""
    root.mkdir(parents=True)
    log, ckpt, result = root / "log", root / "ckpt", root / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "--scheduler",
        scheduler,
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
        str(args.kills),
        "--tee",
        "none",
        "--grace_period",
        "2",
        str(REPO / "examples/ctr/train_ps.py"),
        "--data_dir",
        str(data),
        "--test",
        str(args.test),
        "--batch_size",
        str(args.batch_size),
        "--mode",
        "async",
        "--json",
        str(result),
    ]
    total_steps = args.lines // (args.batch_size // 2)
    rng = random.Random(args.seed)
    kills: list[dict[str, Any]] = []
    trainer_pids: dict[int, int] = {}
    t0 = time.time()
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    with open(root / "stderr.txt", "w") as err, open(root / "stdout.txt", "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=str(root), stdout=out, stderr=err, start_new_session=True, env=env
        )
        try:
            since: float | None = None  # when training (re)started stepping
            while proc.poll() is None and time.time() - t0 < args.timeout:
                time.sleep(0.1)
                p0 = read_json(log / "ps_progress.0.json") or {}
                state = read_json(log / "job_state.json") or {}
                procs = state.get("processes", [])
                for p in procs:
                    if p["role"] == "trainer" and p["state"] == "up":
                        trainer_pids.setdefault(p["rank"], p["pid"])
                if kills and "recovery_s" not in kills[-1]:
                    k = kills[-1]
                    lines = state.get("recoveries", [])
                    if len(lines) < len(kills):
                        continue
                    k["in_place"] = "in place" in lines[len(kills) - 1]
                    up = [
                        p
                        for p in procs
                        if p["role"] == "server"
                        and p["rank"] == k["rank"]
                        and p["state"] == "up"
                        and p["pid"] != k["pid"]
                    ]
                    if "up_step" not in k and up:
                        k["up_step"] = int(p0.get("step", 0))
                    elif "up_step" in k and int(p0.get("step", 0)) > k["up_step"]:
                        k["recovery_s"] = round(float(p0["unix"]) - k["unix"], 3)
                        since = float(p0["unix"])
                    continue
                if not p0.get("first_step_unix") or not (
                    ckpt.exists() and any(ckpt.glob("ckpt-*/checkpoint.json"))
                ):
                    continue
                since = since or float(p0["first_step_unix"])
                if (
                    len(kills) >= args.kills
                    or time.time() - since < args.period
                    or int(p0.get("step", 0)) > 0.85 * total_steps
                ):
                    continue
                alive = [p for p in procs if p["role"] == "server" and p["state"] == "up"]
                if len(alive) < 2:
                    continue
                target = rng.choice(alive)
                os.kill(int(target["pid"]), signal.SIGKILL)
                kills.append(
                    {
                        "rank": target["rank"],
                        "pid": target["pid"],
                        "unix": time.time(),
                        "step": p0.get("step"),
                    }
                )
                print(
                    f"  [{scheduler}] killed server {target['rank']} at step ~{p0.get('step')} "
                    f"({time.time() - t0:.0f} s)",
                    flush=True,
                )
            rc = proc.wait(timeout=max(1.0, args.timeout - (time.time() - t0)))
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    wall = time.time() - t0
    time.sleep(3)
    state = read_json(log / "job_state.json") or {}
    final_trainers = {
        p["rank"]: p["pid"] for p in state.get("processes", []) if p["role"] == "trainer"
    }
    res = read_json(result) or {}
    return {
        "scheduler": scheduler,
        "rc": rc,
        "wall_s": round(wall, 1),
        "test_auc": res.get("test_auc"),
        "kills": kills,
        "in_place": sum(1 for k in kills if k.get("in_place")),
        "recovery_s": summary([k["recovery_s"] for k in kills if "recovery_s" in k]),
        "recoveries": len(state.get("recoveries", [])),
        "restarts": state.get("restarts"),
        "attempt": state.get("attempt"),
        "trainers_kept_pids": final_trainers == trainer_pids,
        "orphans": orphans(str(root)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=60_000, help="examples per trainer (one file each)")
    p.add_argument("--batch_size", type=int, default=32, help="global batch")
    p.add_argument("--interval", type=float, default=3.0, help="--ps_checkpoint_interval")
    p.add_argument("--period", type=float, default=8.0, help="seconds of training between kills")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--test", type=int, default=5_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--schedulers", default="local,ray")
    p.add_argument("--json", default="")
    args = p.parse_args()
    uptime = [os.popen("uptime").read().strip()]
    with tempfile.TemporaryDirectory(prefix="bench_ps_inplace_") as tmp:
        data = Path(tmp) / "data"
        gen_data(data, args.lines)
        results = {}
        for name in args.schedulers.split(","):
            print(f"run {name} ...", flush=True)
            results[name] = run_job(Path(tmp) / name, data, args, name)
            uptime.append(os.popen("uptime").read().strip())
            print(json.dumps({k: v for k, v in results[name].items() if k != "kills"}), flush=True)
    med = {n: r["recovery_s"]["median"] for n, r in results.items()}
    ratio = round(med["ray"] / med["local"], 3) if med.get("ray") and med.get("local") else None
    out = {"args": vars(args), "uptime": uptime, "ray_over_local_median": ratio, "results": results}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    bad = [
        n
        for n, r in results.items()
        if r["rc"] != 0
        or r["orphans"]
        or r["in_place"] != len(r["kills"])
        or len(r["kills"]) < args.kills
        or not r["trainers_kept_pids"]
    ]
    if bad:
        print(f"not as expected: {bad}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
