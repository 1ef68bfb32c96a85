"""Run registered benchmarks one after another and write one result file per benchmark.

Each benchmark's script runs as a subprocess (``python bench/bench_x.py ARGS --json TMP``) under
a time limit; its JSON is turned into figures (:mod:`bench.extract`) and claims
(:mod:`bench.registry`), and written with the date, the machine, the commit and the exact
command to ``bench/results/<name>.json`` (full runs) or ``bench/results/<name>.quick.json``
(``--quick``). A benchmark that fails, times out or lacks an optional requirement is recorded as
such and the others still run; a skipped or failed run never replaces an earlier ``ok`` result
of the same mode. The script's output goes to ``bench/results/logs/`` (not committed).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.registry import REQUIREMENTS, Benchmark, Claim

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SCHEMA_VERSION = 1


def result_path(results_dir: Path, name: str, quick: bool) -> Path:
    """Where a benchmark's result of a mode lives."""
    return Path(results_dir) / f"{name}{'.quick' if quick else ''}.json"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, Any]:
    """What the numbers were measured on (load averages are added around the run)."""
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
    }


def git_commit() -> dict[str, Any]:
    """The commit the tree is at and whether tracked files differ from it."""

    def git(*args: str) -> str:
        r = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False
        )
        return r.stdout.strip() if r.returncode == 0 else ""

    commit = git("rev-parse", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "dirty": dirty}


def missing_requirements(bench: Benchmark) -> list[str]:
    """The requirements of ``bench`` this machine lacks, in words."""
    return [REQUIREMENTS[r] for r in bench.requires if not has_requirement(r)]


def has_requirement(name: str) -> bool:
    """Whether an optional requirement (see :data:`bench.registry.REQUIREMENTS`) is here."""
    if name == "paddle":
        path = os.environ.get("FLEET_BENCH_PADDLE_PYTHON") or str(
            REPO / "bench" / ".venv-paddle" / "bin" / "python"
        )
        return os.access(path, os.X_OK)
    if name == "paddle26":
        return os.access(REPO / "bench" / ".venv-paddle26" / "bin" / "python", os.X_OK)
    if name == "ray":
        return importlib.util.find_spec("ray") is not None
    if name == "etcd":
        return shutil.which("etcd") is not None or os.access("/usr/bin/etcd", os.X_OK)
    if name == "cuda":
        import torch

        return bool(torch.cuda.is_available())
    raise ValueError(f"unknown requirement {name!r}; known: {', '.join(REQUIREMENTS)}")


def command(bench: Benchmark, quick: bool) -> list[str]:
    """The script's command line without ``--json`` (as a reader would type it)."""
    return ["python", bench.script, *bench.args(quick)]


def _judge(claim: Claim, fig: dict[str, Any] | None, quick: bool) -> dict[str, Any]:
    ours = fig["ours"]["median"] if fig and fig.get("ours") else None
    peer = fig["peer"]["median"] if fig and fig.get("peer") else None
    ratio = fig.get("ratio") if fig else None
    met: bool | None = None
    if fig and claim.goals and not (quick and claim.needs_full):
        held = [g.holds(ours, peer, ratio) for g in claim.goals]
        met = None if None in held else all(held)
    return {
        "claim": claim.id,
        "label": claim.label if not (fig and claim.each) else f"{claim.label}: {fig['label']}",
        "figure": fig["label"] if fig else None,
        "unit": fig["unit"] if fig else None,
        "ours": fig["ours"] if fig else None,
        "peer": fig["peer"] if fig else None,
        "peer_name": claim.peer,
        "ratio": ratio,
        "better": claim.better,
        "goal": claim.goal_description(),
        "met": met,
        "judged": bool(claim.goals) and not (quick and claim.needs_full),
    }


def claims_of(bench: Benchmark, figures: list[dict[str, Any]], quick: bool) -> list[dict[str, Any]]:
    """Each claim of ``bench`` against the figures (a claim without a figure: figure None)."""
    import re

    out = []
    for claim in bench.claims:
        pattern = re.compile(claim.figure)
        matched = [f for f in figures if pattern.search(f["label"])]
        if not claim.each:
            matched = matched[:1]
        for fig in matched or [None]:
            out.append(_judge(claim, fig, quick))
    return out


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_one(
    bench: Benchmark, quick: bool, results_dir: Path = RESULTS, timeout: float | None = None
) -> dict[str, Any]:
    """Run ``bench`` once, write its result file (unless that would replace an ok result with
    a skip or a failure) and return the result."""
    results_dir = Path(results_dir)
    logs = results_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    mode = "quick" if quick else "full"
    limit = timeout or (bench.timeout_quick if quick else bench.timeout_full)
    cmd = command(bench, quick)
    result: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "benchmark": bench.name,
        "title": bench.title,
        "area": bench.area,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "command": shlex.join(cmd),
        **git_commit(),
        "machine": machine(),
        "status": "ok",
        "reason": None,
        "wall_s": None,
        "figures": [],
        "claims": [],
        "raw": None,
    }
    if bench.quick_note and quick:
        result["note"] = bench.quick_note
    missing = missing_requirements(bench)
    if missing:
        result["status"], result["reason"] = "skipped", "needs " + "; ".join(missing)
        result["claims"] = claims_of(bench, [], quick)
        return _write(result, results_dir, bench.name, quick)
    log_path = logs / f"{bench.name}.{mode}.log"
    with tempfile.TemporaryDirectory(prefix=f"bench-{bench.name}-") as tmp:
        json_arg = os.path.join(tmp, "out.json")
        argv = [sys.executable, str(REPO / bench.script), *bench.args(quick), "--json", json_arg]
        result["machine"]["load_before"] = list(os.getloadavg())
        t0 = time.monotonic()
        with open(log_path, "w", encoding="utf-8") as log:
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(
                argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        result["wall_s"] = round(time.monotonic() - t0, 1)
        result["machine"]["load_after"] = list(os.getloadavg())
        raw_path = Path(json_arg + bench.json_suffix)
        raw = json.loads(raw_path.read_text()) if raw_path.exists() else None
    log_rel = log_path.relative_to(REPO) if log_path.is_relative_to(REPO) else log_path
    if rc is None:
        result["status"] = "failed"
        result["reason"] = f"timed out after {limit:.0f} s (log: {log_rel})"
    elif rc != 0:
        result["status"] = "failed"
        result["reason"] = f"exit {rc} (log: {log_rel}): " + _tail(log_path, 3)
    elif raw is None:
        result["status"] = "failed"
        result["reason"] = f"the script wrote no JSON (log: {log_rel})"
    if raw is not None and rc == 0 and raw.get("skipped"):  # the script found it cannot measure
        result["status"], result["reason"] = "skipped", str(raw["skipped"])
    if raw is not None:
        result["raw"] = raw
        try:
            result["figures"] = bench.extract(raw)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
            result["status"] = "failed"
            result["reason"] = f"its JSON did not have the expected fields: {err!r}"
    result["claims"] = claims_of(bench, result["figures"], quick)
    return _write(result, results_dir, bench.name, quick)


def _write(result: dict[str, Any], results_dir: Path, name: str, quick: bool) -> dict[str, Any]:
    path = result_path(results_dir, name, quick)
    if result["status"] != "ok" and path.exists():
        try:
            if json.loads(path.read_text()).get("status") == "ok":
                result["kept"] = f"{path.name} keeps its earlier ok result"
                return result
        except (OSError, json.JSONDecodeError):
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    result["written"] = str(path)
    return result


def refresh(results_dir: Path = RESULTS) -> list[str]:
    """Recompute the figures and claims of every result file from the script JSON it keeps
    (``raw``), after an extractor or a claim changed; nothing is measured again. Returns the
    files rewritten."""
    from bench.registry import BY_NAME

    done = []
    for path in sorted(Path(results_dir).glob("*.json")):
        result = json.loads(path.read_text())
        bench = BY_NAME.get(result.get("benchmark", ""))
        if bench is None or result.get("raw") is None:
            continue
        quick = result.get("mode") == "quick"
        result["figures"] = bench.extract(result["raw"])
        result["claims"] = claims_of(bench, result["figures"], quick)
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        done.append(path.name)
    return done


def summary_table(results: Sequence[dict[str, Any]]) -> str:
    """One line per benchmark: status, wall time, claims met / judged."""
    lines = [f"{'benchmark':22s} {'status':8s} {'wall':>7s}  claims met/judged  note"]
    for r in results:
        judged = [c for c in r["claims"] if c["met"] is not None]
        met = sum(1 for c in judged if c["met"])
        wall = f"{r['wall_s']:.0f} s" if r.get("wall_s") is not None else "-"
        note = r.get("reason") or ""
        if r.get("kept"):
            note = f"{note} ({r['kept']})".strip()
        lines.append(
            f"{r['benchmark']:22s} {r['status']:8s} {wall:>7s}  {met:>3d}/{len(judged):<3d}"
            f"             {note.splitlines()[0] if note else ''}"
        )
    return "\n".join(lines)


def run_many(
    benches: Sequence[Benchmark],
    quick: bool,
    results_dir: Path = RESULTS,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    """Run ``benches`` one after another, printing progress and the summary table."""
    results = []
    t0 = time.monotonic()
    for i, bench in enumerate(benches, 1):
        print(f"[{i}/{len(benches)}] {bench.name}: {shlex.join(command(bench, quick))}", flush=True)
        r = run_one(bench, quick, results_dir, timeout)
        print(
            f"    {r['status']}"
            + (f" in {r['wall_s']:.0f} s" if r.get("wall_s") is not None else "")
            + (f": {r['reason'].splitlines()[0]}" if r.get("reason") else ""),
            flush=True,
        )
        results.append(r)
    print()
    print(summary_table(results))
    print(f"\ntotal {time.monotonic() - t0:.0f} s; results in {results_dir}")
    return results
