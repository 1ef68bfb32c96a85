"""``DistributedStrategy(auto=True)``: the planner's pick applied at ``fleet.init``.

:func:`resolve` runs on every rank once the process group is up and before the hybrid topology
is built: it computes the same cache key as ``fleetrun plan`` (:func:`plan_key`) from
``strategy.auto_configs`` and the job's world shape; rank 0 looks the plan up; when none is
cached every rank takes part in the calibration (:func:`fleet.planner.calibrate.calibrate_in_job`)
and rank 0 searches; rank 0 then broadcasts the chosen strategy keys and every rank returns the
user's strategy with them applied.

The helpers above :func:`resolve` (the cache key, the base strategy, the strategy a candidate
runs under) are plain Python: ``fleetrun plan`` uses them without torch, so both sides agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from typing import Any

from collective.errors import ConfigError
from fleet.planner.types import Candidate, ModelSpec, Plan
from fleet.strategy import DistributedStrategy

logger = logging.getLogger(__name__)

PLANNED_KEYS = (
    "hybrid_configs",
    "tensor_parallel",
    "tensor_parallel_configs",
    "pipeline",
    "pipeline_configs",
    "sharding",
    "sharding_configs",
    "gradient_merge",
    "gradient_merge_configs",
    "recompute",
    "auto",
    "auto_configs",
)
"""Strategy keys the planner sets (or that describe the planning itself): not part of the base
strategy a plan is cached under."""


def device_kind(backend: str) -> str:
    """The device a job of ``backend`` trains on, as the fingerprint names it."""
    return "cuda" if str(backend) == "nccl" else "cpu"


def amp_level(base: dict[str, Any]) -> str:
    """``O0``, ``O1`` or ``O2`` from a strategy dict's ``amp`` and ``amp_configs``."""
    if not base.get("amp"):
        return "O0"
    return "O2" if dict(base.get("amp_configs") or {}).get("use_pure_fp16") else "O1"


def check_base_strategy(base: dict[str, Any]) -> None:
    """ConfigError naming the key when ``base`` is not a valid strategy."""
    DistributedStrategy.from_dict(base)


def planner_base(strategy: dict[str, Any] | DistributedStrategy) -> dict[str, Any]:
    """The settings a plan keeps from the user's strategy: those that differ from the defaults,
    less :data:`PLANNED_KEYS`, as a nested dict (the same for a job file's ``strategy:`` and
    for the strategy object a script passes)."""
    s = (
        strategy
        if isinstance(strategy, DistributedStrategy)
        else DistributedStrategy.from_dict(
            {k: v for k, v in strategy.items() if k not in ("auto", "auto_configs")}
        )
    )
    out: dict[str, Any] = {}
    for path, value in sorted(s.non_default_settings().items()):
        parts = path.split(".")
        if parts[0] in PLANNED_KEYS:
            continue
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def plan_key(
    fingerprint: str,
    memory_limit_bytes: int | None,
    base: dict[str, Any],
    global_batch_size: int,
) -> str:
    """The cache key of a plan: the calibration's fingerprint, the memory limit (0: the
    detected one), the base strategy and the global batch."""
    text = json.dumps(
        [fingerprint, int(memory_limit_bytes or 0), planner_base(base), int(global_batch_size)],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def strategy_dict(candidate: Candidate, base: dict[str, Any]) -> dict[str, Any]:
    """The strategy keys a job runs ``candidate`` under, over ``base``: every planned switch
    explicit (a job file's own ``gradient_merge: true`` must not survive a plan without it),
    tensor parallelism through ``hybrid_configs.mp_degree`` only (``tensor_parallel`` is
    Paddle's static-graph switch, which fleet refuses)."""
    out = candidate.strategy_dict(base)
    out["tensor_parallel"] = False
    out.setdefault("gradient_merge", False)
    out["sharding"] = candidate.sharding > 1
    return out


_RESOLVED: dict[int, tuple[weakref.ref[DistributedStrategy], Any]] = {}


def remember_resolved(strategy: DistributedStrategy) -> None:
    """Record that ``strategy`` (the object) now holds a plan's degrees, so a later
    ``fleet.init`` with the same object keeps them instead of refusing them as hand-set."""
    _RESOLVED[id(strategy)] = (weakref.ref(strategy), strategy.hybrid_configs)


def was_resolved(strategy: DistributedStrategy) -> bool:
    """True when ``strategy`` is an object :func:`remember_resolved` recorded and its hybrid
    degrees are still the plan's."""
    entry = _RESOLVED.get(id(strategy))
    return entry is not None and entry[0]() is strategy and entry[1] == strategy.hybrid_configs


def spec_from_configs(strategy: DistributedStrategy) -> ModelSpec:
    """The :class:`ModelSpec` of ``strategy.auto_configs``; ConfigError naming a missing key or
    hybrid degrees set by hand."""
    cfg = strategy.auto_configs
    for name in ("model", "sample", "global_batch_size"):
        if not getattr(cfg, name):
            raise ConfigError(
                f"strategy.auto is on but auto_configs.{name} is not set; give the model, the "
                "sample and the global batch: strategy.auto_configs = {'model': 'pkg.mod:fn', "
                "'sample': 'pkg.mod:fn', 'global_batch_size': N}",
                key=f"auto_configs.{name}",
            )
    hybrid = strategy.hybrid_configs
    hand_set = {
        k: getattr(hybrid, k)
        for k, default in (("dp_degree", -1), ("mp_degree", 1), ("pp_degree", 1))
        if getattr(hybrid, k) != default
    }
    if hybrid.sharding_degree != 1:
        hand_set["sharding_degree"] = hybrid.sharding_degree
    if hand_set:
        raise ConfigError(
            f"strategy.auto plans the hybrid degrees, but hybrid_configs sets {hand_set}; "
            "set strategy.auto = False to keep your degrees, or leave hybrid_configs at its "
            "defaults",
            key="auto",
        )
    return ModelSpec(
        model=cfg.model,
        sample=cfg.sample,
        global_batch_size=cfg.global_batch_size,
        loss=cfg.loss or None,
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        path=(os.getcwd(),),
    )


def resolve(strategy: DistributedStrategy, nnodes: int, nproc_per_node: int) -> DistributedStrategy:
    """The user's strategy with the plan's keys applied (``auto`` stays recorded). Collective:
    every rank of the running process group calls it."""
    import torch.distributed as tdist  # lazy: the helpers above serve the launcher too

    from fleet.planner import cache, search
    from fleet.planner.calibrate import calibrate_in_job

    spec = spec_from_configs(strategy)
    base = planner_base(strategy)
    backend = str(tdist.get_backend())
    mb = strategy.auto_configs.memory_per_device_MB
    memory = mb * (1 << 20) if mb else None
    fp = cache.fingerprint(
        spec, nnodes, nproc_per_node, backend, device_kind(backend), amp_level(base)
    )
    key = plan_key(fp, memory, base, spec.global_batch_size)
    rank = tdist.get_rank()
    plan: Plan | None = None
    have_cal = False
    if rank == 0:
        plan = cache.load_plan(key)
        have_cal = plan is None and cache.load_calibration(fp) is not None
    found = [plan is not None, have_cal]
    tdist.broadcast_object_list(found, src=0)
    origin = f"cached plan {key}"
    if not found[0]:
        origin = f"planned now, cached as {key}"
        cal = None
        if not found[1]:
            cal = calibrate_in_job(spec, base, memory)
        if rank == 0:
            from dataclasses import replace

            cal = replace(cal, fingerprint=fp) if cal is not None else cache.load_calibration(fp)
            if not found[1]:
                cache.save_calibration(cal)
    message: list[Any] = [None, None]
    if rank == 0:
        try:
            if plan is None:
                plan = search.plan(cal, spec, base, memory)
                plan.fingerprint = fp
                plan.base_strategy = dict(base)
                cache.save_plan(key, plan)
            message = [strategy_dict(plan.chosen.candidate, base), None]
        except ConfigError as err:
            message = [None, str(err)]
            tdist.broadcast_object_list(message, src=0)
            raise
    tdist.broadcast_object_list(message, src=0)
    if message[1] is not None:
        raise ConfigError(f"strategy.auto: rank 0 could not plan: {message[1]}", key="auto")
    resolved = apply_strategy_dict(strategy, message[0])
    if rank == 0 and plan is not None:
        for sentence in search.explain(plan):
            logger.info("auto strategy: %s", sentence)
        if strategy.auto_configs.top > 1:
            logger.info("\n%s", search.format_table(plan, top=strategy.auto_configs.top))
        print(f"fleet: auto strategy: {plan.chosen.candidate.key} ({origin})", flush=True)
    return resolved


def apply_strategy_dict(strategy: DistributedStrategy, keys: dict[str, Any]) -> DistributedStrategy:
    """A copy of ``strategy`` with ``keys`` set (sections merged key by key)."""
    data = strategy.to_dict()
    for k, v in keys.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return DistributedStrategy.from_dict(data)


def apply_to_runtime(runtime: Any) -> None:
    """Resolve ``strategy.auto`` on every rank of ``runtime`` (a ``FleetRuntime`` fresh from
    ``init_runtime``) and rebuild what it derived from the strategy: the data-parallel degree
    and the hybrid groups. The resolved keys are set on the strategy object itself, so the
    script's object, the runtime's and the later ``distributed_model`` /
    ``distributed_optimizer`` calls see the same strategy. ``fleet.init`` and the trial
    runner call it."""
    import dataclasses

    from fleet.base.topology import HybridCommunicateGroup, build_topology
    from fleet.strategy import check_strategy_supported

    if was_resolved(runtime.strategy):
        # fleet.init again with the strategy object an earlier call resolved: init_runtime
        # has built the groups of its (planned) degrees already
        return
    env = runtime.env
    resolved = resolve(runtime.strategy, env.num_nodes, env.local_world_size)
    check_strategy_supported(resolved, "fleet.init (strategy.auto)")
    for f in dataclasses.fields(resolved):
        setattr(runtime.strategy, f.name, getattr(resolved, f.name))
    remember_resolved(runtime.strategy)
    hybrid = runtime.strategy.hybrid_configs
    runtime.dp_degree = hybrid.resolve_dp_degree(env.world_size)
    runtime.hcg = (
        None
        if hybrid.mp_degree == hybrid.pp_degree == hybrid.sharding_degree == 1
        else HybridCommunicateGroup(build_topology(hybrid, env.world_size))
    )


__all__ = [
    "apply_to_runtime",
    "PLANNED_KEYS",
    "amp_level",
    "apply_strategy_dict",
    "check_base_strategy",
    "device_kind",
    "plan_key",
    "planner_base",
    "resolve",
    "spec_from_configs",
    "strategy_dict",
]
