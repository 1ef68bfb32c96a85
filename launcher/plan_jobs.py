"""The jobs ``fleetrun plan`` runs: the job's shape (flags over ``-c job.yaml``), the calibration
job (``python -m fleet.planner.calibrate`` under fleetrun, or the cache, or a given file), the
``--verify`` trial jobs (``python -m fleet.planner.trial`` under each candidate's strategy) and the
``--apply`` job file.

They are ordinary fleetrun launches in subprocesses, so they take the same path as a training
job; their failures come back as the job's root-cause summary under one line saying what the
planner was doing. No torch is imported here.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Any

import click
import yaml

from collective.errors import ConfigError, LaunchError
from fleet.planner import auto
from fleet.planner.types import Calibration, ModelSpec, Plan
from launcher.spec import detect_gpu_count, load_yaml

TRIAL_WARMUP = 2
"""Steps each ``--verify`` trial runs before the timed ones."""
VERIFY_ROUNDS = 2
"""Passes over the verified candidates (the second in reverse order); their steps pool."""
APPLY_STEPS = 20
"""Steps the job written by ``--apply`` (without ``-c``) trains."""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SUMMARY_HEAD = re.compile(r"^=+ fleetrun: job .* FAILED =+$")
_CONFIG_ERROR = re.compile(r"\b\w*(ConfigError|PlannerError|PlannerModelError)\b")


class PlanJobError(LaunchError):
    """A calibration or trial job failed; the message holds the planner's context line and the
    job's root-cause summary."""

    def __init__(self, message: str, config_error: bool = False) -> None:
        super().__init__(message)
        self.config_error = config_error
        """True when the job's root cause is a ConfigError (a bad model function, say)."""


def parse_size(text: str, flag: str = "--memory_per_device") -> int | None:
    """``4GB``, ``512MB``, ``1KB``, ``1048576`` -> bytes (binary units); ``auto`` -> None."""
    if text.strip().lower() == "auto":
        return None
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(
            f"{text!r} is not a size; write e.g. 4GB, 512MB, 1KB or auto", key=flag.lstrip("-")
        )
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ConfigError(f"must be > 0, got {text!r}", key=flag.lstrip("-"))
    return value


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass(frozen=True)
class JobShape:
    """The planned job: its sizes, backend and base strategy (from ``-c`` and the flags)."""

    nnodes: int
    nproc_per_node: int
    backend: str
    """``gloo`` or ``nccl`` (``auto`` resolved)."""
    base_strategy: dict[str, Any]
    """The job file's ``strategy:`` (a file it names is read), ``auto`` keys dropped."""
    job_data: dict[str, Any] | None
    """The job file as read, when ``-c`` was given."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def device(self) -> str:
        return auto.device_kind(self.backend)


def resolve_shape(
    config: str | None, nnodes: int | None, nproc_per_node: int | None, backend: str | None
) -> JobShape:
    """Flags over the job file over the defaults (1 node, 1 process, backend auto)."""
    data = load_yaml(config) if config else None
    sizes = dict((data or {}).get("sizes") or {})
    nn = nnodes if nnodes is not None else int(sizes.get("nnodes", 1))
    npn = nproc_per_node if nproc_per_node is not None else int(sizes.get("nproc_per_node", 1))
    if nn < 1 or npn < 1:
        raise ConfigError(f"nnodes and nproc_per_node must be >= 1, got {nn} and {npn}")
    b = backend or str((data or {}).get("backend") or "auto")
    if b == "auto":
        b = "nccl" if detect_gpu_count() > 0 else "gloo"
    if b not in ("gloo", "nccl"):
        raise ConfigError(f"expected auto, gloo or nccl, got {b!r}", key="backend")
    raw = (data or {}).get("strategy")
    if isinstance(raw, str):
        path = (
            raw if os.path.isabs(raw) or not config else os.path.join(os.path.dirname(config), raw)
        )
        path = path if os.path.exists(path) else raw
        try:
            with open(path, encoding="utf-8") as f:
                raw = yaml.safe_load(f) or {}
        except OSError as err:
            raise ConfigError(
                f"cannot read the job's strategy file {raw!r}: {err}", key="strategy"
            ) from None
        if isinstance(raw, dict) and set(raw) == {"strategy"}:
            raw = raw["strategy"] or {}
    base = {k: v for k, v in dict(raw or {}).items() if k not in ("auto", "auto_configs")}
    auto.check_base_strategy(base)
    return JobShape(nn, npn, b, base, data)


def _job_env(shape: JobShape) -> dict[str, str]:
    """The environment of the planner's jobs: ours, without a surrounding job's contract, plus
    the job file's ``env:`` (what its trainers would see)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "PADDLE_"))}
    extra = (shape.job_data or {}).get("env") or {}
    if isinstance(extra, dict):
        env.update({str(k): str(v) for k, v in extra.items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_job(
    shape: JobShape, log_dir: str, entry: list[str], what: str, strategy_file: str | None = None
) -> None:
    """Run ``fleetrun ... -m ENTRY`` of the planned shape on this node, output kept in
    ``log_dir``; PlanJobError with ``what`` and the job's root-cause summary when it fails."""
    cmd = [sys.executable, "-m", "launcher", "--nnodes", "1"]
    cmd += ["--nproc_per_node", str(shape.nproc_per_node), "--backend", shape.backend]
    cmd += ["--log_dir", log_dir, "--tee", "none", "--no-metrics"]
    # the ranks fork from one warm process that imported torch (docs/launching/warm-starts.md): a
    # calibration or trial job of 4 ranks on 2 cores starts about 3.5 s sooner
    cmd += ["--warm_start", "on"]
    cmd += ["--job_name", os.path.basename(log_dir)]
    if strategy_file:
        cmd += ["--strategy", strategy_file]
    cmd += ["-m", *entry]
    os.makedirs(log_dir, exist_ok=True)
    out_path = os.path.join(log_dir, "fleetrun.out")
    with open(out_path, "w", encoding="utf-8") as out:
        proc = subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=_job_env(shape), check=False, text=True
        )
    if proc.returncode == 0:
        return
    with open(out_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    root = job_root_cause(text)
    raise PlanJobError(
        f"fleetrun plan: the {what} failed (exit {proc.returncode}; its logs are in {log_dir}):\n"
        f"{root}",
        config_error=bool(_CONFIG_ERROR.search(_root_error_line(root))),
    )


def job_root_cause(output: str, tail: int = 30) -> str:
    """The failure summary fleetrun printed (launcher/summary.py), else the output's tail."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if _SUMMARY_HEAD.match(line.strip()):
            end = next(
                (j for j in range(i + 1, len(lines)) if set(lines[j].strip()) == {"="}),
                len(lines) - 1,
            )
            return "\n".join(lines[i : end + 1])
    return "\n".join(lines[-tail:])


def _root_error_line(summary: str) -> str:
    for line in summary.splitlines():
        if line.strip().startswith("error    :"):
            return line
    return summary


def calibrate(
    shape: JobShape,
    spec: ModelSpec,
    fingerprint: str,
    log_dir: str,
    memory_limit: int | None,
    calibration_file: str | None,
    recalibrate: bool,
) -> tuple[Calibration, str]:
    """The calibration and where it came from (``file``, ``cached``, ``measured``)."""
    from fleet.planner import cache

    if calibration_file:
        try:
            with open(calibration_file, encoding="utf-8") as f:
                cal = Calibration.from_dict(json.load(f))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(
                f"cannot read the calibration {calibration_file!r}: {err}", key="calibration"
            ) from None
        if cal.cluster.world_size != shape.world_size:
            raise ConfigError(
                f"the calibration {calibration_file!r} was measured on {cal.cluster.nnodes} "
                f"node(s) x {cal.cluster.nproc_per_node} but the plan is for {shape.nnodes} x "
                f"{shape.nproc_per_node}; calibrate the planned shape",
                key="calibration",
            )
        return cal, f"from {calibration_file}"
    if not recalibrate:
        cached = cache.load_calibration(fingerprint)
        if cached is not None:
            return cached, "cached"
    spec_path = os.path.join(log_dir, "spec.json")
    cal_path = os.path.join(log_dir, "calibration.json")
    write_json(spec_path, spec.to_dict())
    if shape.nnodes > 1:
        raise ConfigError(
            f"planning {shape.nnodes} nodes needs a calibration measured on them: copy "
            f"{spec_path} to the cluster and on every node run `fleetrun --nnodes {shape.nnodes} "
            f"--nproc_per_node {shape.nproc_per_node} --master_addr HOST --node_rank R "
            "-m fleet.planner.calibrate --spec spec.json --out calibration.json`, then plan "
            "here with --calibration calibration.json",
            key="nnodes",
        )
    base_path = os.path.join(log_dir, "base_strategy.json")
    write_json(base_path, shape.base_strategy)
    entry = ["fleet.planner.calibrate", "--spec", spec_path, "--out", cal_path]
    entry += ["--base_strategy", base_path]
    if memory_limit is not None:
        entry += ["--memory_per_device", str(memory_limit)]
    run_job(shape, os.path.join(log_dir, "calibrate"), entry, "calibration job")
    with open(cal_path, encoding="utf-8") as f:
        cal = Calibration.from_dict(json.load(f))
    cal = replace(cal, fingerprint=fingerprint)
    cache.save_calibration(cal)
    return cal, "measured"


def verify(
    plan: Plan, shape: JobShape, spec: ModelSpec, k: int, steps: int, log_dir: str
) -> dict[str, dict[str, Any]]:
    """Run the top ``k`` candidates as trial jobs; put their median step seconds into
    ``plan.measured`` and re-rank: the measured first, led by the predicted pick unless another
    was measured faster beyond the trials' spread (:func:`clearly_faster`), then fastest first;
    return the results."""
    if shape.nnodes > 1:
        raise ConfigError(
            "--verify runs trial jobs on this node only; plan without it, then run the job "
            "written by --apply on the cluster",
            key="verify",
        )
    spec_path = os.path.join(log_dir, "spec.json")
    write_json(spec_path, spec.to_dict())
    results: dict[str, dict[str, Any]] = {}
    steps_of: dict[str, list[float]] = {}
    top = list(enumerate(plan.ranked[:k]))
    # VERIFY_ROUNDS passes, every other one in reverse order: load that comes and goes while
    # the trials run hits every candidate alike; a candidate's figure is the median of its
    # pooled steps
    for rnd in range(VERIFY_ROUNDS if len(top) > 1 else 1):
        for i, est in top if rnd % 2 == 0 else reversed(top):
            key = est.candidate.key
            trial_dir = os.path.join(log_dir, f"trial{i}-{key}")
            os.makedirs(trial_dir, exist_ok=True)
            strategy_path = os.path.join(trial_dir, "strategy.yaml")
            with open(strategy_path, "w", encoding="utf-8") as f:
                yaml.safe_dump(
                    auto.strategy_dict(est.candidate, plan.base_strategy), f, sort_keys=False
                )
            out = os.path.join(trial_dir, "result.json")
            entry = ["fleet.planner.trial", "--spec", spec_path, "--steps", str(steps)]
            entry += ["--warmup", str(TRIAL_WARMUP), "--out", out]
            run_job(shape, trial_dir, entry, f"trial job of {key}", strategy_file=strategy_path)
            with open(out, encoding="utf-8") as f:
                res = json.load(f)
            prev = results.get(key)
            if prev is not None:  # the larger peak of the rounds
                res["peak_bytes"] = [
                    max(a, b) for a, b in zip(prev["peak_bytes"], res["peak_bytes"])
                ]
                write_json(out, res)
            results[key] = res
            steps_of.setdefault(key, []).extend(float(x) for x in res["step_s"])
            plan.measured[key] = statistics.median(steps_of[key])
            peak = max(res.get("peak_bytes") or [0])
            click.echo(
                f"verify {i + 1}/{len(top)} {key}: measured "
                f"{plan.measured[key] * 1e3:.2f} ms/step, peak {format_bytes(peak)} "
                f"(predicted {est.step_s * 1e3:.2f} ms, {format_bytes(est.memory_bytes)})"
            )
    # the predicted pick stays unless a candidate's steps are faster beyond the trials' spread:
    # a few steps on a busy machine cannot order candidates a few percent apart
    first = top[0][1].candidate.key
    pick = first
    for e in sorted(
        (e for e in plan.ranked if e.candidate.key in plan.measured),
        key=lambda e: plan.measured[e.candidate.key],
    ):
        if e.candidate.key == first:
            break
        if clearly_faster(steps_of[e.candidate.key], steps_of[first]):
            pick = e.candidate.key
            break
    measured = sorted(
        (e for e in plan.ranked if e.candidate.key in plan.measured),
        key=lambda e: (e.candidate.key != pick, plan.measured[e.candidate.key]),
    )
    plan.ranked = measured + [e for e in plan.ranked if e.candidate.key not in plan.measured]
    return results


def clearly_faster(a: list[float], b: list[float], z: float = 1.645) -> bool:
    """Whether step times ``a`` are shorter than ``b`` beyond their spread: a one-sided
    Mann-Whitney U test (normal approximation, 5 % by default); with fewer than 3 steps on a
    side, the medians decide."""
    n, m = len(a), len(b)
    if n < 3 or m < 3:
        return statistics.median(a) < statistics.median(b)
    u = sum(1.0 if x < y else 0.5 if x == y else 0.0 for x in a for y in b)
    sd = (n * m * (n + m + 1) / 12.0) ** 0.5
    return (u - n * m / 2.0) / sd > z


def write_apply(path: str, plan: Plan, shape: JobShape, spec: ModelSpec) -> None:
    """A job file ``fleetrun -c path`` runs as is: the ``-c`` job with the chosen strategy, or a
    job training the planned model (``python -m fleet.planner.trial``) under it."""
    strategy = auto.strategy_dict(plan.chosen.candidate, plan.base_strategy)
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if shape.job_data is not None:
        data = dict(shape.job_data)
        data["strategy"] = strategy
        sizes = dict(data.get("sizes") or {})
        sizes.update(nnodes=shape.nnodes, nproc_per_node=shape.nproc_per_node)
        data["sizes"] = sizes
        data["backend"] = shape.backend
    else:
        stem = os.path.splitext(path)[0]
        spec_path = stem + ".spec.json"
        write_json(spec_path, spec.to_dict())
        data = {
            "name": "planned",
            "entrypoint": {
                "module": "fleet.planner.trial",
                "args": [
                    "--spec",
                    spec_path,
                    "--steps",
                    str(APPLY_STEPS),
                    "--warmup",
                    str(TRIAL_WARMUP),
                    "--out",
                    stem + ".result.json",
                ],
            },
            "mode": "collective",
            "sizes": {"nnodes": shape.nnodes, "nproc_per_node": shape.nproc_per_node},
            "backend": shape.backend,
            "log_dir": os.path.join(os.path.dirname(path), "log", os.path.basename(stem)),
            "strategy": strategy,
        }
    header = (
        f"# written by fleetrun plan: {plan.chosen.candidate.key} for world "
        f"{plan.world_size}, global batch {plan.global_batch_size}\n"
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(header)
        yaml.safe_dump(data, f, sort_keys=False)


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` (its directory made)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)


__all__ = [
    "APPLY_STEPS",
    "TRIAL_WARMUP",
    "VERIFY_ROUNDS",
    "JobShape",
    "PlanJobError",
    "calibrate",
    "format_bytes",
    "job_root_cause",
    "parse_size",
    "resolve_shape",
    "run_job",
    "verify",
    "write_apply",
    "write_json",
]
