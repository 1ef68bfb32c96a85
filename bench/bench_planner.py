"""The auto-planner against measurement: plan a model at world 4 (gloo, this machine), then run
every valid configuration (or, when there are many, every distinct dp x mp x pp x sharding stage
at its best predicted micro-batching, the top 3 predictions and micro-batching variants) as
trial jobs, and compare.

Per model (``examples.planner.gpt`` at global batch 32, ``examples.planner.mlp`` at 256, their
default sizes):

* planning seconds: ``fleetrun plan --nproc_per_node 4 --backend gloo --model .. --sample ..
  --global_batch_size G --json PLAN.json --recalibrate`` end to end, calibration included, with
  an empty planner cache (goal <= 60 s);
* every selected candidate: ``fleetrun --nproc_per_node 4 --backend gloo --strategy S.yaml -m
  fleet.planner.trial --steps N --warmup W`` (``--rounds`` passes over the list, the order
  reversed every pass, so load that comes and goes hits all configurations alike); measured step
  time = median of the pooled steps (each the slowest rank's), with min/max;
* the planner's top pick's measured time / the fastest measured (goal <= 1.10); then
  ``fleetrun plan --verify 3`` on the cached calibration (three trial jobs) and its pick's time in
  the sweep / the fastest (goal <= 1.03; the best measured of the top 3 in the sweep is printed
  next to it); Spearman's
  rank correlation of predicted vs measured step time (goal >= 0.8); predicted peak memory of
  the fullest rank vs the measured one, relative error per configuration (goal within 15 %).

Usage: ``python bench/bench_planner.py [--models gpt,mlp] [--rounds 2] [--steps 5] [--warmup 2]
[--max_configs 24] [--min_configs 12] [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import yaml
from common import REPO, Stats, bench_env, fleetrun_cmd, machine_info

from fleet.planner.types import Candidate, Estimate, ModelSpec, Plan

WORLD = 4
MODELS = {
    "gpt": ("examples.planner.gpt:model", "examples.planner.gpt:sample", 32),
    "mlp": ("examples.planner.mlp:model", "examples.planner.mlp:sample", 256),
}
QUICK_ENV = {
    "PLAN_GPT_HIDDEN": "32",
    "PLAN_GPT_LAYERS": "4",
    "PLAN_GPT_SEQ": "16",
    "PLAN_GPT_VOCAB": "64",
    "PLAN_MLP_WIDTH": "64",
    "PLAN_MLP_BLOCKS": "4",
}
QUICK_BATCH = {"gpt": 16, "mlp": 64}
GOALS = {"top_pick": 1.10, "verify3": 1.03, "spearman": 0.8, "memory": 0.15, "plan_s": 60.0}


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = bench_env()  # drops FLEET* variables: the cache directory is set after it
    env.update(extra)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    import subprocess

    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
        return 124, f"timed out after {timeout:.0f} s\n{out or ''}", time.perf_counter() - t0
    return r.returncode, r.stdout + r.stderr, time.perf_counter() - t0


def plan_model(name: str, args: argparse.Namespace, work: str, env: dict[str, str]) -> dict:
    """``fleetrun plan`` of one model with an empty cache: the plan and the seconds it took."""
    model, sample, batch = MODELS[name]
    out = os.path.join(work, f"{name}.plan.json")
    cmd = fleetrun_cmd(
        "plan", "--nproc_per_node", str(WORLD), "--backend", "gloo",
        "--model", model, "--sample", sample, "--global_batch_size", str(batch),
        "--json", out, "--recalibrate", "--log_dir", os.path.join(work, f"{name}.plan.log"),
    )  # fmt: skip
    rc, text, secs = _run(cmd, env, timeout=600)
    print(f"[{name}] fleetrun plan: rc {rc}, {secs:.1f} s", flush=True)
    if rc != 0:
        raise RuntimeError(f"fleetrun plan of {name} failed ({rc}):\n{text[-4000:]}")
    print("\n".join("    " + ln for ln in text.splitlines()[-40:]), flush=True)
    with open(out, encoding="utf-8") as f:
        plan = Plan.from_dict(json.load(f))
    m = re.search(r"calibration: .*?\(([\d.]+) s of measuring", text)
    return {"plan": plan, "seconds": secs, "calibration_s": float(m.group(1)) if m else None}


def verify_model(name: str, work: str, env: dict[str, str]) -> dict[str, Any]:
    """``fleetrun plan --verify 3`` of one model on the calibration the first plan cached: the
    pick after measuring the top 3, and the seconds it took."""
    model, sample, batch = MODELS[name]
    out = os.path.join(work, f"{name}.verify.json")
    cmd = fleetrun_cmd(
        "plan", "--nproc_per_node", str(WORLD), "--backend", "gloo",
        "--model", model, "--sample", sample, "--global_batch_size", str(batch),
        "--verify", "3", "--json", out, "--log_dir", os.path.join(work, f"{name}.verify.log"),
    )  # fmt: skip
    rc, text, secs = _run(cmd, env, timeout=900)
    print(f"[{name}] fleetrun plan --verify 3: rc {rc}, {secs:.1f} s", flush=True)
    if rc != 0:
        raise RuntimeError(f"fleetrun plan --verify 3 of {name} failed ({rc}):\n{text[-4000:]}")
    print("\n".join("    " + ln for ln in text.splitlines()[-24:]), flush=True)
    with open(out, encoding="utf-8") as f:
        plan = Plan.from_dict(json.load(f))
    return {"pick": plan.chosen.candidate.key, "measured": plan.measured, "seconds": secs}


def _group(c: Candidate) -> tuple[int, int, int, int, int]:
    return (c.dp, c.mp, c.pp, c.sharding, c.stage)


def select(plan: Plan, max_configs: int, min_configs: int) -> list[Estimate]:
    """Every ranked candidate when there are at most ``max_configs``; else the best predicted
    of every distinct (dp, mp, pp, sharding, stage), the top 3 predictions, then micro-batching
    and recompute variants of the best groups until ``min_configs``."""
    ranked = list(plan.ranked)
    if len(ranked) <= max_configs:
        return ranked
    chosen: list[Estimate] = []
    seen: set[str] = set()

    def take(e: Estimate) -> None:
        if e.candidate.key not in seen and len(chosen) < max_configs:
            seen.add(e.candidate.key)
            chosen.append(e)

    for e in ranked[:3]:
        take(e)
    groups: dict[tuple[int, ...], list[Estimate]] = {}
    for e in ranked:  # ranked is fastest-predicted first
        groups.setdefault(_group(e.candidate), []).append(e)
    for members in groups.values():
        take(members[0])
    depth = 1
    while len(chosen) < min_configs and any(len(m) > depth for m in groups.values()):
        for members in groups.values():
            if len(members) > depth and len(chosen) < min_configs:
                take(members[depth])
        depth += 1
    return sorted(chosen, key=lambda e: (e.step_s, e.candidate.key))


def _strategy(c: Candidate, base: dict[str, Any]) -> dict[str, Any]:
    try:
        from fleet.planner.auto import strategy_dict
    except ImportError:  # the auto module is optional for the bench
        out = c.strategy_dict(base)
        out.pop("tensor_parallel", None)
        return out
    return strategy_dict(c, base)


def trial(
    name: str, est: Estimate, plan: Plan, args: argparse.Namespace, work: str, env: dict, rnd: int
) -> dict[str, Any]:
    """One trial job of one candidate; its result JSON, or ``{"error": ...}``."""
    c = est.candidate
    d = os.path.join(work, name, f"{c.key}.r{rnd}")
    os.makedirs(d, exist_ok=True)
    strategy = os.path.join(d, "strategy.yaml")
    with open(strategy, "w", encoding="utf-8") as f:
        yaml.safe_dump(_strategy(c, plan.base_strategy), f, sort_keys=False)
    out = os.path.join(d, "result.json")
    cmd = fleetrun_cmd(
        "--nproc_per_node", str(WORLD), "--backend", "gloo", "--log_dir", os.path.join(d, "log"),
        "--strategy", strategy, "-m", "fleet.planner.trial",
        "--spec", os.path.join(work, f"{name}.spec.json"),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", out,
    )  # fmt: skip
    rc, text, secs = _run(cmd, env, timeout=args.trial_timeout)
    if rc != 0 or not os.path.exists(out):
        logs = ""
        for fn in sorted(os.listdir(os.path.join(d, "log"))) if os.path.isdir(d) else []:
            if fn.startswith("workerlog"):
                with open(os.path.join(d, "log", fn), encoding="utf-8", errors="replace") as f:
                    logs += f.read()[-1500:]
        return {"error": f"rc {rc}: {(text + logs)[-2500:]}", "wall_s": secs}
    with open(out, encoding="utf-8") as f:
        res = json.load(f)
    res["wall_s"] = secs
    return res


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


def measure_model(name: str, args: argparse.Namespace, work: str, env: dict) -> dict[str, Any]:
    """Plan one model, run its selected candidates, compute the figures."""
    model, sample, batch = MODELS[name]
    if args.quick:
        batch = QUICK_BATCH[name]
        MODELS[name] = (model, sample, batch)
    planned = plan_model(name, args, work, env)
    plan: Plan = planned["plan"]
    spec = ModelSpec(model=model, sample=sample, global_batch_size=batch, path=(REPO,))
    with open(os.path.join(work, f"{name}.spec.json"), "w", encoding="utf-8") as f:
        json.dump(spec.to_dict(), f)
    chosen = select(plan, args.max_configs, args.min_configs)
    print(
        f"[{name}] {len(plan.ranked)} ranked candidates ({len(plan.too_big)} too big, "
        f"{len(plan.refused)} refused); measuring {len(chosen)}",
        flush=True,
    )
    steps: dict[str, list[float]] = {e.candidate.key: [] for e in chosen}
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for rnd in range(args.rounds):
        order = chosen if rnd % 2 == 0 else list(reversed(chosen))
        for e in order:
            key = e.candidate.key
            if key in errors:
                continue
            res = trial(name, e, plan, args, work, env, rnd)
            if "error" in res:
                errors[key] = res["error"]
                print(f"[{name}] {key}: FAILED {res['error'][-400:]}", flush=True)
                continue
            steps[key] += res["step_s"]
            prev = results.get(key)
            if prev is not None:  # the larger figure of the rounds
                res["peak_bytes"] = [
                    max(a, b) for a, b in zip(prev["peak_bytes"], res["peak_bytes"])
                ]
            results[key] = res
            print(
                f"[{name}] round {rnd + 1}: {key} median {res['median_step_s'] * 1e3:.1f} ms "
                f"(predicted {e.step_s * 1e3:.1f} ms), job {res['wall_s']:.0f} s",
                flush=True,
            )
    rows = []
    for e in chosen:
        key = e.candidate.key
        if key not in results:
            continue
        meas_mem = max(results[key]["peak_bytes"])
        rows.append(
            {
                "key": key,
                "predicted_s": e.step_s,
                "measured": Stats.of(steps[key]).__dict__,
                "predicted_bytes": e.memory_bytes,
                "measured_bytes": meas_mem,
                "memory_error": (e.memory_bytes - meas_mem) / meas_mem if meas_mem else None,
                "dominant": e.dominant,
                "parts": e.parts,
                "memory_parts_predicted": e.memory_parts,
                "memory_parts_measured": results[key]["memory_parts"],
            }
        )
    out: dict[str, Any] = {
        "model": model,
        "global_batch_size": batch,
        "ranked": len(plan.ranked),
        "too_big": len(plan.too_big),
        "refused": len(plan.refused),
        "plan_s": planned["seconds"],
        "calibration_s": planned["calibration_s"],
        "configs": rows,
        "errors": errors,
        "top_pick": plan.ranked[0].candidate.key if plan.ranked else None,
    }
    if len(rows) >= 2:
        meas = {r["key"]: r["measured"]["median"] for r in rows}
        fastest = min(meas.values())
        top = plan.ranked[0].candidate.key
        top3 = [e.candidate.key for e in plan.ranked[:3] if e.candidate.key in meas]
        out["fastest"] = min(meas, key=lambda k: meas[k])
        out["top_pick_ratio"] = meas[top] / fastest if top in meas else None
        out["top3_best_ratio"] = min(meas[k] for k in top3) / fastest if top3 else None
        # the real --verify 3: its pick, timed in the sweep above (the same jobs, same rounds)
        verified = verify_model(name, work, env)
        out["verify3_pick"] = verified["pick"]
        out["verify3_s"] = verified["seconds"]
        pick = verified["pick"]
        out["verify3_ratio"] = (
            meas[pick] / fastest
            if pick in meas
            else verified["measured"].get(pick, float("nan")) / fastest
        )
        out["spearman"] = spearman([r["predicted_s"] for r in rows], list(meas.values()))
        errs = [abs(r["memory_error"]) for r in rows if r["memory_error"] is not None]
        out["memory_error_max"] = max(errs) if errs else None
        out["memory_error_median"] = statistics.median(errs) if errs else None
        out["memory_within_15pct"] = sum(e <= GOALS["memory"] for e in errs)
    print_table(name, out)
    return out


def print_table(name: str, out: dict[str, Any]) -> None:
    rows = sorted(out["configs"], key=lambda r: r["measured"]["median"])
    pred_rank = {
        r["key"]: i + 1 for i, r in enumerate(sorted(rows, key=lambda r: r["predicted_s"]))
    }
    print(f"\n== {name}: {out['model']}, global batch {out['global_batch_size']}, world {WORLD} ==")
    print(
        f"{'configuration':34s} {'pred ms':>8s} {'meas ms [min .. max]':>24s} {'rank p/m':>8s} "
        f"{'pred MiB':>9s} {'meas MiB':>9s} {'mem err':>8s}  dominant"
    )
    for i, r in enumerate(rows):
        m = r["measured"]
        err = r["memory_error"]
        print(
            f"{r['key']:34s} {r['predicted_s'] * 1e3:8.1f} "
            f"{m['median'] * 1e3:8.1f} [{m['min'] * 1e3:6.1f} .. {m['max'] * 1e3:6.1f}] "
            f"{pred_rank[r['key']]:>3d}/{i + 1:<4d} {r['predicted_bytes'] / 2**20:9.2f} "
            f"{r['measured_bytes'] / 2**20:9.2f} {err * 100 if err is not None else math.nan:7.1f}%  "
            f"{r['dominant']}"
        )
    for key, err in out["errors"].items():
        print(f"{key:34s} FAILED: {err.splitlines()[-1] if err else ''}")
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    print(
        f"top pick {out['top_pick']}: measured / fastest ({out.get('fastest')}) = "
        f"{fmt(out.get('top_pick_ratio'), '.3f')} (goal <= {GOALS['top_pick']}); best of the "
        f"top 3 / fastest = {fmt(out.get('top3_best_ratio'), '.3f')}; --verify 3 picks "
        f"{out.get('verify3_pick')}: / fastest = {fmt(out.get('verify3_ratio'), '.3f')} "
        f"(goal <= {GOALS['verify3']})"
    )
    print(
        f"Spearman(predicted, measured) = {fmt(out.get('spearman'), '.3f')} over "
        f"{len(out['configs'])} configurations (goal >= {GOALS['spearman']}); memory error: "
        f"median {fmt(out.get('memory_error_median'), '.1%')}, worst "
        f"{fmt(out.get('memory_error_max'), '.1%')}, {out.get('memory_within_15pct')} of "
        f"{len(out['configs'])} within 15 %; planning {out['plan_s']:.1f} s (calibration "
        f"{fmt(out['calibration_s'], '.1f')} s; goal <= {GOALS['plan_s']:.0f} s)",
        flush=True,
    )


def _single(v: float) -> dict[str, float]:
    return {"median": v, "min": v, "max": v, "n": 1}


def figures(models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The result rows (bench.extract.report_rows' format): one per model and figure."""
    rows: list[dict[str, Any]] = []

    def add(label: str, ours: dict[str, float] | None, unit: str, kind: str = "") -> None:
        if ours is not None:
            rows.append(
                {"label": label, "ours": ours, "peer": None, "ratio": None, "ratio_kind": kind,
                 "unit": unit}
            )  # fmt: skip

    for name, m in models.items():
        if m.get("top_pick_ratio") is not None:
            add(
                f"top pick: measured / fastest measured (x), {name}",
                _single(m["top_pick_ratio"]),
                "x",
            )
        if m.get("verify3_ratio") is not None:
            add(
                f"verify 3: its pick / fastest measured (x), {name}",
                _single(m["verify3_ratio"]),
                "x",
            )
        if m.get("spearman") is not None and not math.isnan(m["spearman"]):
            add(f"Spearman predicted vs measured step time, {name}", _single(m["spearman"]), "")
        if m.get("memory_error_max") is not None:
            add(f"peak memory: worst relative error, {name}", _single(m["memory_error_max"]), "")
        add(f"planning time (s, calibration included), {name}", _single(m["plan_s"]), "s")
    return rows


def write_json(result: dict[str, Any], json_path: str | None) -> None:
    """The result in :func:`common.report`'s format (``rows`` of figures, a peer of None: the
    figures are ratios and limits, not a comparison with another implementation), plus the
    per-model details."""
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the configurations")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per trial job")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max_configs", type=int, default=24)
    ap.add_argument("--min_configs", type=int, default=12)
    ap.add_argument("--trial_timeout", type=float, default=300.0)
    ap.add_argument("--quick", action="store_true", help="tiny models, smaller batches")
    ap.add_argument("--json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    models: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_planner-") as work:
        env = _env(QUICK_ENV if args.quick else {})
        for name in args.models.split(","):
            # an empty planner cache per model: planning includes its calibration
            env["FLEETRUN_CACHE_DIR"] = os.path.join(work, f"{name}.cache")
            try:
                models[name] = measure_model(name, args, work, env)
            except RuntimeError as exc:
                print(f"[{name}] {exc}", flush=True)
                models[name] = {"error": str(exc)[-3000:], "plan_s": math.nan, "configs": []}
    info = machine_info()
    result = {
        "title": f"Auto-planner vs measurement, world {WORLD} gloo CPU",
        "machine": info,
        "unit": "",  # mixed figures: each label names its unit
        "goal": (
            f"top pick <= {GOALS['top_pick']}x the fastest, verify 3 <= {GOALS['verify3']}x, "
            f"Spearman >= {GOALS['spearman']}, memory within 15 %, planning <= 60 s"
        ),
        "rows": figures({k: v for k, v in models.items() if "error" not in v}),
        "models": models,
        "args": vars(args),
        "wall_s": time.perf_counter() - t0,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    load = ", ".join(f"{a:.1f}->{b:.1f}" for a, b in zip(load_before, os.getloadavg()))
    print(
        f"\nmachine: {info['cpus']} CPUs shared with other jobs (timings are noisy); load "
        f"average 1/5/15 min before->after: {load}; {result['wall_s']:.0f} s in all"
    )
    write_json(result, json_path=args.json)
    if any("error" in m for m in models.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
