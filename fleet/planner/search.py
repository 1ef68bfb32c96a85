"""The planner's search: every valid hybrid configuration of the world, estimated by
:mod:`fleet.planner.cost`, ranked, printed and explained. Plain Python (no torch).

* :func:`enumerate_candidates`: every ``(dp, mp, pp, sharding)`` whose product is the world
  size, the sharding stage (1, 2, 3 when ``sharding > 1``), every split ``b x m`` of each data
  replica's share of the global batch, recompute on/off (layer lists only) and the pipeline
  schedule; the rest refused with reasons (:class:`~fleet.planner.types.Refusal`): an mp the
  model could not be built at, mp > 1 without tensor-parallel layers, pp > 1 for a plain
  ``nn.Module`` or more stages than repeated blocks, a batch that does not divide over the data
  replicas, and what :func:`fleet.strategy.check_composition` refuses of the strategy a
  candidate would run (:meth:`Candidate.strategy_dict` over the base strategy: a pipeline
  micro-batches through ``accumulate_steps``, no pipeline through gradient merge).
* :func:`plan`: estimate them all, keep those within the memory limit, rank by predicted step
  time (ties: less memory first); :class:`PlannerError` subclasses for the inputs no
  configuration can serve.
* :func:`format_table` and :func:`explain`: the ranked table and one sentence per knob.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from collective.errors import ConfigError
from fleet.planner.cost import CostModelError, estimate, stage_bounds
from fleet.planner.types import Calibration, Candidate, Estimate, ModelSpec, Plan, Refusal
from fleet.strategy import DistributedStrategy, check_composition

SCHEDULES = ("1F1B", "FThenB")
"""The pipeline schedules fleet runs (:class:`fleet.strategy.configs.PipelineSchedule`)."""

MiB = 2**20
GiB = 2**30


class PlannerError(ConfigError):
    """The planner cannot serve these inputs; the message says what is short and the fix."""


class NoFactorisationError(PlannerError):
    """No dp x mp x pp x sharding of the world size is valid for this model."""


class NoMicroBatchingError(PlannerError):
    """The global batch divides over the data replicas of no valid factorisation."""


class NothingFitsError(PlannerError):
    """Every valid configuration needs more memory than a device has.

    ``plan`` holds the estimates (all in ``too_big``), for a table of what came closest."""

    def __init__(self, message: str, plan: Plan) -> None:
        super().__init__(message, key="memory_per_device")
        self.plan = plan


# ---- enumeration ----------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorisations(world: int) -> list[tuple[int, int, int, int]]:
    """Every ``(dp, mp, pp, sharding)`` of positive integers whose product is ``world``."""
    out = []
    for mp in _divisors(world):
        for pp in _divisors(world // mp):
            rest = world // (mp * pp)
            for sh in _divisors(rest):
                out.append((rest // sh, mp, pp, sh))
    return out


def degrees_label(dp: int, mp: int, pp: int, sharding: int) -> str:
    """``dp2.mp1.pp2.sh1``: the name of a factorisation in refusals."""
    return f"dp{dp}.mp{mp}.pp{pp}.sh{sharding}"


def _structural_refusal(cal: Calibration, mp: int, pp: int) -> str | None:
    """Why the model cannot run at this mp / pp (None: it can)."""
    model = cal.model
    if mp > 1:
        if mp not in model.mp_degrees:
            return (
                f"the model was not calibrated at mp={mp} (calibrated: "
                f"{sorted(model.mp_degrees)}); recalibrate"
            )
        if model.mp_degrees[mp]:
            return f"the model does not build at mp={mp}: {model.mp_degrees[mp]}"
        if not any(layer.tp_param_bytes for layer in model.layers):
            return (
                f"mp {mp} would only replicate the model: it has no tensor-parallel "
                "parameters (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)"
            )
        missing = [layer.name for layer in model.layers if mp not in layer.fwd_s]
        if missing:
            return f"calibration has no layer timings at mp={mp} ({missing[0]}); recalibrate"
    if pp > 1:
        if not model.layer_list:
            return (
                f"pp {pp} needs the model as a layer list (LayerDesc entries or "
                "nn.Sequential) to cut into stages; this model is a plain nn.Module"
            )
        try:
            stage_bounds(model, pp)
        except ValueError as exc:
            return f"pp {pp}: {exc}"
    return None


@dataclass
class _Enumeration:
    candidates: list[Candidate] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    structural: list[Refusal] = field(default_factory=list)
    batch: list[Refusal] = field(default_factory=list)
    replicas_tried: set[int] = field(default_factory=set)
    composition: list[Refusal] = field(default_factory=list)


def _composition_check(strategy: dict[str, Any]) -> str | None:
    """What fleet.strategy refuses of ``strategy`` (None: it runs)."""
    try:
        check_composition(DistributedStrategy.from_dict(strategy))
    except (ConfigError, NotImplementedError) as exc:
        return str(exc)
    return None


def _enumerate(
    cal: Calibration,
    spec: ModelSpec,
    base_strategy: dict[str, Any],
    schedules: tuple[str, ...],
) -> _Enumeration:
    out = _Enumeration()
    world, G = cal.cluster.world_size, spec.global_batch_size
    checked: dict[tuple[Any, ...], str | None] = {}
    for dp, mp, pp, sh in factorisations(world):
        label = degrees_label(dp, mp, pp, sh)
        why = _structural_refusal(cal, mp, pp)
        if why is not None:
            out.structural.append(Refusal(label, why))
            continue
        r = dp * sh
        out.replicas_tried.add(r)
        if G % r:
            out.batch.append(
                Refusal(
                    label,
                    f"global batch {G} does not divide into {r} data replicas "
                    f"(dp {dp} x sharding {sh})",
                )
            )
            continue
        local = G // r
        for stage in (1, 2, 3) if sh > 1 else (0,):
            for b in _divisors(local):
                for rc in (False, True) if cal.model.layer_list else (False,):
                    for sched in schedules if pp > 1 else ("1F1B",):
                        c = Candidate(dp, mp, pp, sh, stage, b, local // b, rc, sched)
                        shape = (dp, mp, pp, sh, stage, pp == 1 and local // b > 1, rc, sched)
                        if shape not in checked:
                            checked[shape] = _composition_check(c.strategy_dict(base_strategy))
                        if checked[shape] is not None:
                            out.composition.append(Refusal(c.key, str(checked[shape])))
                        else:
                            out.candidates.append(c)
    out.refusals = out.structural + out.batch + out.composition
    return out


def enumerate_candidates(
    cal: Calibration,
    spec: ModelSpec,
    base_strategy: dict[str, Any],
    schedules: tuple[str, ...] = ("1F1B",),
) -> tuple[list[Candidate], list[Refusal]]:
    """Every valid candidate for the world of ``cal``, and the refused configurations with
    why. ``schedules``: the pipeline schedules to offer (:data:`SCHEDULES`; 1F1B alone by
    default: FThenB has the same bubble and keeps more micro-batches in flight)."""
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad:
        raise PlannerError(f"unknown pipeline schedule(s) {bad}; use {SCHEDULES}", key="schedule")
    e = _enumerate(cal, spec, base_strategy or {}, tuple(schedules))
    return e.candidates, e.refusals


# ---- the plan -------------------------------------------------------------------------------


def _nearest_batches(G: int, replicas: set[int], count: int = 3) -> list[int]:
    near: set[int] = set()
    for r in replicas:
        below, above = (G // r) * r, -(-G // r) * r
        near.update(x for x in (below, above) if x > 0)
    return sorted(near, key=lambda x: (abs(x - G), x))[:count]


def _per_factorisation(refusals: list[Refusal]) -> list[Refusal]:
    """The refusals grouped by degrees (``dp2.mp1.pp2.sh1``), each distinct reason once."""
    out: dict[str, list[str]] = {}
    for r in refusals:
        label = ".".join(r.what.split(".")[:4])
        if r.why not in out.setdefault(label, []):
            out[label].append(r.why)
    return [Refusal(label, " / ".join(whys)) for label, whys in out.items()]


def _reasons(refusals: list[Refusal]) -> str:
    return "; ".join(f"{r.what}: {r.why}" for r in refusals)


def plan(
    cal: Calibration,
    spec: ModelSpec,
    base_strategy: dict[str, Any],
    memory_limit_bytes: int | None = None,
    schedules: tuple[str, ...] = ("1F1B",),
) -> Plan:
    """Rank every valid candidate by predicted step time among those whose fullest rank fits
    ``memory_limit_bytes`` (default: the calibrated memory per device).

    Raises :class:`NoFactorisationError`, :class:`NoMicroBatchingError` or
    :class:`NothingFitsError` (all :class:`PlannerError`, a ConfigError)."""
    base = dict(base_strategy or {})
    limit = int(memory_limit_bytes or cal.cluster.memory_per_device_bytes)
    world, G = cal.cluster.world_size, spec.global_batch_size
    if G < 1:
        raise PlannerError(f"global batch size must be >= 1, got {G}", key="global_batch_size")
    e = _enumerate(cal, spec, base, tuple(schedules))
    if not e.candidates:
        if not e.replicas_tried:
            raise NoFactorisationError(
                f"no dp x mp x pp x sharding factorisation of the world size {world} is valid "
                f"for this model: {_reasons(e.structural)}; change --nproc_per_node/--nnodes "
                "or the model",
                key="world_size",
            )
        if not e.composition:
            tried = ", ".join(str(r) for r in sorted(e.replicas_tried))
            near = ", ".join(str(x) for x in _nearest_batches(G, e.replicas_tried))
            raise NoMicroBatchingError(
                f"global batch {G} divides over the data replicas (dp x sharding) of no valid "
                f"factorisation of world {world}: tried {tried} replica(s); global batch "
                f"sizes that divide: {near}",
                key="global_batch_size",
            )
        raise NoFactorisationError(
            f"no dp x mp x pp x sharding factorisation of the world size {world} is valid: "
            f"{_reasons(_per_factorisation(e.refusals))}; change the base strategy or the "
            "world size",
            key="strategy",
        )
    estimates, failed = [], []
    for c in e.candidates:
        try:
            estimates.append(estimate(c, cal))
        except CostModelError as exc:
            failed.append(Refusal(c.key, str(exc.args[0] if exc.args else exc)))
    refused = e.refusals + failed
    if not estimates:
        raise PlannerError(
            f"no configuration could be estimated: {_reasons(failed[:3])}", key="calibration"
        )
    ranked = sorted(
        (x for x in estimates if x.memory_bytes <= limit),
        key=lambda x: (x.step_s, x.memory_bytes, x.candidate.key),
    )
    too_big = sorted(
        (x for x in estimates if x.memory_bytes > limit),
        key=lambda x: (x.memory_bytes, x.step_s, x.candidate.key),
    )
    result = Plan(
        world_size=world,
        global_batch_size=G,
        ranked=ranked,
        too_big=too_big,
        refused=refused,
        memory_limit_bytes=limit,
        fingerprint=cal.fingerprint,
        base_strategy=base,
    )
    if not ranked:
        raise NothingFitsError(_nothing_fits(result, cal), result)
    return result


def size(nbytes: float) -> str:
    """``1.50 GiB``, ``12.3 MiB``, ``640 KiB`` or ``512 B``: the unit that keeps the figure
    readable."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return (
                f"{nbytes / scale:.3g} {unit}" if unit != "GiB" else f"{nbytes / scale:.2f} {unit}"
            )
    return f"{int(nbytes)} B"


def _nothing_fits(p: Plan, cal: Calibration) -> str:
    best = p.too_big[0]
    c, short = best.candidate, best.memory_bytes - p.memory_limit_bytes
    parts = ", ".join(f"{k} {size(v)}" for k, v in best.memory_parts.items())
    knobs = ["raise memory_per_device"]
    if c.stage < 3 and p.world_size > 1:
        knobs.append("use sharding stage 3 (more sharding ranks)")
    if cal.model.layer_list and not c.recompute:
        knobs.append("turn on recompute")
    if cal.model.layer_list:
        knobs.append("use more pp stages or more devices")
    knobs.append("or lower the global batch size")
    return (
        f"no configuration fits {size(p.memory_limit_bytes)} per device: short by "
        f"{size(short)} on the fullest rank; the closest is {describe(c)} at "
        f"{size(best.memory_bytes)} ({parts}); {', '.join(knobs)}"
    )


# ---- printing -------------------------------------------------------------------------------


def describe(c: Candidate) -> str:
    """``dp 2 x mp 1 x pp 2, sharding 2 stage 1, micro-batch 4 x 2, recompute on``."""
    sh = f"sharding {c.sharding} stage {c.stage}" if c.sharding > 1 else "no sharding"
    sched = f" {c.schedule}" if c.pp > 1 and c.schedule != "1F1B" else ""
    return (
        f"dp {c.dp} x mp {c.mp} x pp {c.pp}{sched}, {sh}, micro-batch "
        f"{c.micro_batch_size} x {c.accumulate_steps}, recompute {'on' if c.recompute else 'off'}"
    )


def _share(e: Estimate, *parts: str) -> float:
    return 100.0 * sum(e.parts.get(p, 0.0) for p in parts) / e.step_s if e.step_s > 0 else 0.0


def _ms(e: Estimate) -> str:
    return f"{e.step_s * 1e3:.1f} ms"


def format_table(plan: Plan, top: int = 10) -> str:
    """The ranked candidates (``top`` of them) as a text table, with the measured step time
    when ``--verify`` ran them; when none fits, the closest by memory."""
    head = ["#", "dp", "mp", "pp", "sharding", "micro-batch", "recompute", "step ms", "memory MiB"]
    head.append("dominant")
    measured = bool(plan.measured)
    if measured:
        head.append("measured ms")
    shown = plan.ranked or plan.too_big
    rows = []
    for i, e in enumerate(shown[:top], 1):
        c = e.candidate
        row = [
            str(i),
            str(c.dp),
            str(c.mp),
            str(c.pp) + (f" {c.schedule}" if c.pp > 1 and c.schedule != "1F1B" else ""),
            f"{c.sharding}/s{c.stage}" if c.sharding > 1 else "-",
            f"{c.micro_batch_size}x{c.accumulate_steps}",
            "on" if c.recompute else "off",
            f"{e.step_s * 1e3:.2f}",
            f"{e.memory_bytes / MiB:.1f}",
            f"{e.dominant} {_share(e, e.dominant):.0f}%",
        ]
        if measured:
            got = plan.measured.get(c.key)
            row.append(f"{got * 1e3:.2f}" if got is not None else "-")
        rows.append(row)
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(head)]
    lines = [
        f"world {plan.world_size}, global batch {plan.global_batch_size}, memory limit "
        f"{plan.memory_limit_bytes / MiB:.1f} MiB: {len(plan.ranked)} fit, "
        f"{len(plan.too_big)} too big, {len(plan.refused)} refused",
    ]
    if not plan.ranked and plan.too_big:
        lines.append("none fits; the closest by memory:")
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    if len(shown) > top:
        lines.append(f"... {len(shown) - top} more")
    return "\n".join(lines)


# ---- explaining -----------------------------------------------------------------------------


def _best(pool: list[Estimate], pred: Any) -> Estimate | None:
    hits = [e for e in pool if pred(e.candidate)]
    return min(hits, key=lambda e: (e.step_s, e.memory_bytes)) if hits else None


def _missing(plan: Plan, pred: Any, what: str) -> str:
    """Why no fitting candidate has ``what``: too big (by how much) or refused (why)."""
    big = _best(plan.too_big, pred)
    if big is not None:
        return (
            f"no {what} configuration fits (the best, {describe(big.candidate)}, needs "
            f"{big.memory_bytes / MiB:.1f} MiB of {plan.memory_limit_bytes / MiB:.1f} MiB)"
        )
    for r in plan.refused:
        if pred(_degrees_of(r.what)):
            return f"no {what} configuration is valid ({r.what}: {r.why})"
    return f"the world of {plan.world_size} allows no {what} configuration"


def _degrees_of(label: str) -> Candidate:
    """A stand-in candidate with the degrees (and stage, if named) of a refusal's label."""
    num = {}
    for part in label.split("."):
        hit = re.fullmatch(r"(dp|mp|pp|sh|s)([0-9]+)", part)
        if hit:
            num[hit.group(1)] = int(hit.group(2))
    return Candidate(
        num.get("dp", 1),
        num.get("mp", 1),
        num.get("pp", 1),
        num.get("sh", 1),
        num.get("s", 0),
        1,
        1,
        False,
    )


PART_NAMES = {
    "compute": "compute",
    "recompute": "recompute",
    "bubble": "pipeline bubble",
    "pp_comm": "point-to-point traffic",
    "dp_comm": "gradient all-reduce",
    "sharding_comm": "sharding communication",
    "optimizer": "optimizer step",
}
"""Step-time parts as sentences name them."""


def _against(plan: Plan, e: Estimate, alt: Estimate | None, pred: Any, what: str) -> str:
    """How the best configuration ``what`` compares with the pick, by the part that differs
    most; or why there is none."""
    if alt is None:
        return _missing(plan, pred, what)
    gap = {k: alt.parts.get(k, 0.0) - e.parts.get(k, 0.0) for k in set(e.parts) | set(alt.parts)}
    k = max(gap, key=lambda x: (gap[x], x))
    head = f"the best {what} configuration ({describe(alt.candidate)}) takes {_ms(alt)}"
    if alt.step_s < e.step_s:
        return f"{head}, predicted faster; the measured step times decided"
    return (
        f"{head}, {gap[k] * 1e3:.1f} ms more {PART_NAMES.get(k, k)} "
        f"({_share(alt, k):.0f}% of its step)"
    )


def explain(plan: Plan) -> list[str]:
    """One sentence per knob of ``plan.chosen``: the pipeline, tensor parallelism, data
    parallelism, sharding, the micro-batching and recompute, with the numbers behind each."""
    e = plan.chosen
    c = e.candidate
    pool, every = plan.ranked, plan.ranked + plan.too_big
    limit = plan.memory_limit_bytes
    out = []
    if plan.measured and c.key in plan.measured:
        fastest = min(plan.measured.values()) >= plan.measured[c.key]
        how = (
            f"the fastest of {len(plan.measured)} run"
            if fastest
            else f"kept as predicted: none of the {len(plan.measured)} run was faster beyond "
            "the trials' spread"
        )
        out.append(
            f"verified: {describe(c)} measured {plan.measured[c.key] * 1e3:.1f} ms per step "
            f"(predicted {_ms(e)}), {how}"
        )

    def knob(head: str, pred: Any, what: str) -> str:
        return f"{head}; {_against(plan, e, _best(pool, pred), pred, what)}"

    if c.pp > 1:
        head = (
            f"pp {c.pp}: the pipeline bubble costs {_share(e, 'bubble'):.0f}% and "
            f"point-to-point traffic {_share(e, 'pp_comm'):.0f}% of the {_ms(e)} step"
        )
        out.append(knob(head, lambda d: d.pp == 1, "unpipelined"))
    else:
        head = f"pp 1: no pipeline bubble or point-to-point traffic in the {_ms(e)} step"
        out.append(knob(head, lambda d: d.pp > 1, "pipelined"))
    head = (
        f"mp {c.mp}: compute (tensor-parallel communication included) takes "
        f"{e.parts['compute'] * 1e3:.1f} ms, {_share(e, 'compute'):.0f}% of the step"
    )
    if c.mp > 1:
        out.append(knob(head, lambda d: d.mp == 1, "mp 1"))
    else:
        out.append(knob(head, lambda d: d.mp > 1, "tensor-parallel"))
    r = c.dp * c.sharding
    replicas = f"dp {c.dp} x sharding {c.sharding} = {r}" if c.sharding > 1 else str(r)
    head = (
        f"dp {c.dp}: {replicas} data replica(s) take {plan.global_batch_size // r} of the "
        f"{plan.global_batch_size} samples each; the gradient all-reduce left after overlap "
        f"costs {_share(e, 'dp_comm'):.0f}% of the step"
    )
    out.append(knob(head, lambda d: d.dp != c.dp, "other dp"))
    if c.sharding > 1:
        head = (
            f"sharding {c.sharding} stage {c.stage}: optimizer state and masters take "
            f"{e.memory_parts['optimizer'] / MiB:.1f} MiB of the fullest rank's "
            f"{e.memory_bytes / MiB:.1f} MiB, its communication "
            f"{_share(e, 'sharding_comm'):.0f}% of the step"
        )
        out.append(knob(head, lambda d: d.sharding == 1, "unsharded"))
    else:
        head = (
            f"no sharding: the fullest rank needs {e.memory_bytes / MiB:.1f} MiB of the "
            f"{limit / MiB:.1f} MiB limit"
        )
        out.append(knob(head, lambda d: d.sharding > 1, "sharded"))
    how = "pipeline micro-batches" if c.pp > 1 else "gradient-merge steps"
    head = f"micro-batch {c.micro_batch_size} x {c.accumulate_steps} {how}: " + (
        f"the bubble is {_share(e, 'bubble'):.0f}% of the step"
        if c.pp > 1
        else f"{e.memory_parts['activations'] / MiB:.1f} MiB of activations"
    )
    shape = (c.dp, c.mp, c.pp, c.sharding, c.stage, c.recompute, c.schedule)
    sibling = _best(
        every,
        lambda d: (
            (d.dp, d.mp, d.pp, d.sharding, d.stage, d.recompute, d.schedule) == shape
            and d.micro_batch_size != c.micro_batch_size
        ),
    )
    if sibling is not None:
        sc = sibling.candidate
        head += f"; the next best split, {sc.micro_batch_size} x {sc.accumulate_steps}, " + (
            f"takes {_ms(sibling)}"
            if sibling.memory_bytes <= limit
            else f"needs {sibling.memory_bytes / MiB:.1f} MiB, over the limit"
        )
    else:
        head += f"; {plan.global_batch_size // r} samples per replica allow no other split"
    out.append(head)
    flipped = Candidate(**{**c.to_dict(), "recompute": not c.recompute})
    twin = next((x for x in every if x.candidate == flipped), None)
    acts = e.memory_parts["activations"] / MiB
    if c.recompute:
        s = (
            f"recompute on: the extra forward costs {_share(e, 'recompute'):.0f}% of the step "
            f"and keeps activations at {acts:.1f} MiB"
        )
        if twin is not None:
            s += f"; without it the fullest rank needs {twin.memory_bytes / MiB:.1f} MiB" + (
                f", over the {limit / MiB:.1f} MiB limit"
                if twin.memory_bytes > limit
                else f" and the step takes {_ms(twin)}"
            )
    elif twin is not None:
        s = (
            f"recompute off: activations take {acts:.1f} MiB and fit; recompute would add "
            f"{twin.parts['recompute'] * 1e3:.1f} ms ({_share(twin, 'recompute'):.0f}% of "
            f"its step)"
        )
    else:
        s = "recompute off: it is offered for layer lists (PipelineLayer entries) only"
    out.append(s)
    return out


__all__ = [
    "PART_NAMES",
    "SCHEDULES",
    "NoFactorisationError",
    "NoMicroBatchingError",
    "NothingFitsError",
    "PlannerError",
    "degrees_label",
    "describe",
    "enumerate_candidates",
    "explain",
    "factorisations",
    "format_table",
    "plan",
]
