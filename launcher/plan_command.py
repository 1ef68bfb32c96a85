"""``fleetrun plan``: choose the hybrid configuration of a job, explain it, verify and apply it.

Flow: the job's shape (flags over ``-c job.yaml``) and the model spec -> the calibration (cached
by fingerprint, a file made elsewhere, or a real fleetrun job of the planned shape running
``python -m fleet.planner.calibrate``) -> :func:`fleet.planner.search.plan` -> the ranked table,
optionally ``--verify K`` trial jobs (``python -m fleet.planner.trial`` under each candidate's
strategy) that re-rank by measured time -> the explanation of the pick -> the plan cached where
``DistributedStrategy(auto=True)`` finds it -> ``--apply FILE`` / ``--json FILE``.

The calibration and trial jobs and the ``--apply`` file are :mod:`launcher.plan_jobs`. This
module imports no torch until the model functions are checked (``launcher.cli`` routes here
lazily, so ``fleetrun --help`` stays light).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import click

from collective.errors import ConfigError, FleetError
from fleet.planner import auto
from fleet.planner.types import ModelSpec, Plan
from launcher.plan_jobs import (
    PlanJobError,
    calibrate,
    format_bytes,
    parse_size,
    resolve_shape,
    verify,
    write_apply,
    write_json,
)


def _counts(plan: Plan, verbose: bool) -> list[str]:
    """The refused and too-big configurations (the table's first line counts them): with
    ``--verbose`` each with why, else a hint when there are any."""
    if not verbose:
        if plan.refused or plan.too_big:
            return ["(--verbose lists the refused and the too big configurations)"]
        return []
    lines = [f"  refused {r.what}: {r.why}" for r in plan.refused]
    limit = format_bytes(plan.memory_limit_bytes)
    lines += [
        f"  too big {e.candidate.key}: {format_bytes(e.memory_bytes)} > {limit}"
        for e in plan.too_big
    ]
    return lines


def _opt(*names: str, **kw: Any) -> Any:
    longs = [n for n in names if n.startswith("--")]
    extra = [n.replace("_", "-") for n in longs if "_" in n]
    return click.option(*names, *extra, **kw)


@click.command(name="plan", context_settings={"help_option_names": ["-h", "--help"]})
@_opt(
    "-c",
    "--config",
    "config",
    type=click.Path(dir_okay=False),
    help="Job file (YAML): its sizes, backend and strategy (the base: AMP etc. kept).",
)
@_opt("--nnodes", "nnodes", type=click.IntRange(min=1), help="Nodes of the job (default 1).")
@_opt(
    "--nproc_per_node",
    "nproc_per_node",
    type=click.IntRange(min=1),
    help="Ranks per node (default 1).",
)
@_opt(
    "--backend",
    "backend",
    type=click.Choice(["auto", "gloo", "nccl"]),
    help="Process-group backend (default auto: nccl with GPUs, else gloo).",
)
@_opt(
    "--model",
    "model",
    required=True,
    metavar="MOD:FN",
    help="Function building the model: a layer list, an nn.Module, or (either, loss).",
)
@_opt(
    "--sample",
    "sample",
    required=True,
    metavar="MOD:FN",
    help="Function(batch_size) returning (inputs, labels).",
)
@_opt(
    "--loss",
    "loss",
    metavar="MOD:FN",
    help="Function returning the loss, when the model's has none.",
)
@_opt(
    "--global_batch_size",
    "global_batch_size",
    type=click.IntRange(min=1),
    required=True,
    help="Samples per optimizer step over the whole job.",
)
@_opt(
    "--optimizer",
    "optimizer",
    type=click.Choice(["adamw", "adam", "momentum", "sgd"]),
    default="adamw",
    show_default=True,
    help="The job's optimizer (its state counts in the memory).",
)
@_opt("--lr", "lr", type=float, default=1e-3, show_default=True, help="Learning rate of trials.")
@_opt(
    "--memory_per_device",
    "memory_per_device",
    default="auto",
    show_default=True,
    metavar="SIZE|auto",
    help="Memory budget of one rank (4GB, 512MB); auto: the GPU's, or RAM / ranks per node.",
)
@_opt(
    "--top",
    "top",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Rows of the ranked table.",
)
@_opt(
    "--verify",
    "verify_k",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="K",
    help="Run the top K as trial jobs and re-rank by measured step time.",
)
@_opt(
    "--verify_steps",
    "verify_steps",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help=(
        "Timed steps of each trial job (after 2 warm-up steps); the top K run in two passes, "
        "the second in reverse order, and the median of the pooled steps counts."
    ),
)
@_opt(
    "--apply",
    "apply",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Write the pick as a job file that fleetrun -c FILE runs as is.",
)
@_opt(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Write the whole plan (every candidate, refused ones and why) as JSON.",
)
@_opt("--recalibrate", "recalibrate", is_flag=True, help="Ignore a cached calibration.")
@_opt(
    "--calibration",
    "calibration",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="A calibration JSON made elsewhere (fleetrun ... -m fleet.planner.calibrate).",
)
@_opt(
    "--log_dir",
    "log_dir",
    metavar="DIR",
    help="Logs of the calibration and trial jobs (default a new directory under log/plan).",
)
@_opt("-v", "--verbose", "verbose", is_flag=True, help="List the refused configurations.")
def plan_cmd(**params: Any) -> None:
    """Choose the hybrid configuration (dp x mp x pp x sharding, micro-batches, recompute) of a
    job from a calibrated cost model, explain it, and optionally verify and apply it."""
    try:
        code = run_plan(params)
    except PlanJobError as err:
        click.echo(str(err), err=True)
        raise SystemExit(2 if err.config_error else 1) from None
    except ConfigError as err:
        click.echo(f"fleetrun plan: error: {err}", err=True)
        raise SystemExit(2) from None
    except FleetError as err:
        click.echo(f"fleetrun plan: error: {err}", err=True)
        raise SystemExit(1) from None
    raise SystemExit(code)


def run_plan(params: dict[str, Any]) -> int:
    """The whole command; returns the exit code (errors raise)."""
    start = time.monotonic()
    shape = resolve_shape(
        params["config"], params["nnodes"], params["nproc_per_node"], params["backend"]
    )
    memory_limit = parse_size(params["memory_per_device"])
    spec = ModelSpec(
        model=params["model"],
        sample=params["sample"],
        global_batch_size=params["global_batch_size"],
        loss=params["loss"],
        optimizer=params["optimizer"],
        lr=params["lr"],
        path=(os.getcwd(),),
    )
    check_functions(spec)
    log_dir = params["log_dir"] or _default_log_dir()
    log_dir = os.path.abspath(log_dir)
    os.makedirs(log_dir, exist_ok=True)

    from fleet.planner import cache, search

    fp = cache.fingerprint(
        spec,
        shape.nnodes,
        shape.nproc_per_node,
        shape.backend,
        shape.device,
        auto.amp_level(shape.base_strategy),
    )
    cal, source = calibrate(
        shape, spec, fp, log_dir, memory_limit, params["calibration"], params["recalibrate"]
    )
    click.echo(
        f"calibration: {source} ({cal.seconds:.1f} s of measuring; "
        f"fingerprint {fp[:12]}; logs in {log_dir})"
    )
    try:
        plan = search.plan(cal, spec, shape.base_strategy, memory_limit)
    except search.NothingFitsError as err:
        click.echo(search.format_table(err.plan, top=params["top"]))  # what came closest
        raise
    plan.fingerprint = fp
    plan.base_strategy = dict(shape.base_strategy)
    click.echo(search.format_table(plan, top=params["top"]))
    for line in _counts(plan, params["verbose"]):
        click.echo(line)
    if params["verify_k"] > 0 and plan.ranked:
        verify(plan, shape, spec, params["verify_k"], params["verify_steps"], log_dir)
        click.echo(f"\nverified the top {min(params['verify_k'], len(plan.ranked))} (measured):")
        click.echo(search.format_table(plan, top=params["top"]))
    click.echo("\nwhy " + plan.chosen.candidate.key + ":")
    for sentence in search.explain(plan):
        click.echo("  " + sentence)
    key = auto.plan_key(fp, memory_limit, shape.base_strategy, spec.global_batch_size)
    cache.save_plan(key, plan)
    click.echo(f"plan cached as {key} (DistributedStrategy(auto=True) applies it)")
    if params["json_out"]:
        write_json(params["json_out"], plan.to_dict())
        click.echo(f"plan written to {params['json_out']}")
    if params["apply"]:
        write_apply(params["apply"], plan, shape, spec)
        click.echo(f"job file written to {params['apply']}: fleetrun -c {params['apply']}")
    click.echo(f"planned in {time.monotonic() - start:.1f} s")
    return 0


def check_functions(spec: ModelSpec) -> None:
    """Import the model, sample and loss functions here first: a wrong name is a ConfigError
    before any job starts."""
    from fleet.planner.spec import load_function  # lazy: imports torch and the user's module

    load_function(spec.model, "model", spec.path)
    load_function(spec.sample, "sample", spec.path)
    if spec.loss:
        load_function(spec.loss, "loss", spec.path)


def _default_log_dir() -> str:
    base = os.path.join("log", "plan")
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=base)


__all__ = ["check_functions", "plan_cmd", "run_plan"]
