"""Which strategies fleet can run: :func:`check_strategy_supported` and the composition rules.

Pure checks over a :class:`~fleet.strategy.DistributedStrategy` (no process group, no torch):
settings that contradict each other, combinations not supported yet, and features that have not
landed, each refused with the keys involved and what to do. ``fleet.init``,
``fleet.distributed_model`` and ``fleet.distributed_optimizer`` call
:func:`check_strategy_supported`; :mod:`fleet.parallelize.compose` reads :func:`sharding_stage` and
:func:`uses_pipeline` to pick its wrappers.
"""

from __future__ import annotations

from typing import Any

from collective.errors import ConfigError, FleetNotImplementedError
from fleet.strategy.configs import ShardingConfig
from fleet.strategy.distributed_strategy import DistributedStrategy

# Strategy switch -> what it is, for the not-implemented message. Everything else has landed
# (data parallel, gradient merge, AMP, recompute, LARS/LAMB, pipeline, sharding); each entry
# leaves this table when its implementation lands.
_NOT_LANDED: dict[str, str] = {
    "tensor_parallel": "tensor parallelism",
}
# Hybrid axes not landed yet (all have: mp, pp and sharding degrees build fleet.base.topology groups).
_HYBRID_AXES: dict[str, str] = {}


DEFAULT_SHARDING_CONFIG_DEGREE = ShardingConfig().sharding_degree
"""``sharding_configs.sharding_degree``'s default (Paddle's static-graph key): left at it, the
degree comes from ``hybrid_configs.sharding_degree`` alone."""


def sharding_stage(strategy: DistributedStrategy) -> int:
    """0 when sharding is off, else ``sharding_configs.stage`` (``sharding_degree > 1`` turns
    sharding on, as in Paddle's dygraph hybrid mode; ``strategy.sharding`` may say it too)."""
    return strategy.sharding_configs.stage if strategy.hybrid_configs.sharding_degree > 1 else 0


def uses_pipeline(strategy: DistributedStrategy) -> bool:
    """True when the job is pipelined (``pp_degree > 1``)."""
    return strategy.hybrid_configs.pp_degree > 1


def check_composition(strategy: DistributedStrategy) -> None:
    """ConfigError / FleetNotImplementedError for settings that contradict each other or
    combinations not supported, naming both features and what to do."""
    hybrid, sc = strategy.hybrid_configs, strategy.sharding_configs
    if strategy.sharding and hybrid.sharding_degree == 1:
        raise ConfigError(
            "strategy.sharding is on but hybrid_configs.sharding_degree is 1 (nothing to shard "
            "over); set strategy.hybrid_configs = {'sharding_degree': N} with N > 1",
            key="hybrid_configs.sharding_degree",
        )
    if sc.sharding_degree not in (DEFAULT_SHARDING_CONFIG_DEGREE, hybrid.sharding_degree):
        raise ConfigError(
            f"sharding_configs.sharding_degree={sc.sharding_degree} but "
            f"hybrid_configs.sharding_degree={hybrid.sharding_degree}; the degree is set in "
            "hybrid_configs (leave sharding_configs.sharding_degree at its default or equal)",
            key="sharding_configs.sharding_degree",
        )
    if strategy.pipeline and hybrid.pp_degree == 1:
        raise ConfigError(
            "strategy.pipeline is on but hybrid_configs.pp_degree is 1; set "
            "strategy.hybrid_configs = {'pp_degree': N} with N > 1",
            key="hybrid_configs.pp_degree",
        )
    # Allowed, each with a parity test (docs/collective/strategy.md): stage 3 with tensor and with
    # pipeline parallelism, AMP O2 with stages 1/2/3, float16 loss scaling with stage 2 and with
    # stage 1 under pipeline parallelism, global-norm clipping with stages 1/2.
    if (
        strategy.gradient_merge
        and strategy.gradient_merge_configs.k_steps > 1
        and hybrid.pp_degree > 1
    ):
        raise FleetNotImplementedError(
            "gradient_merge with pipeline parallelism (pp_degree > 1)",
            hint="the pipeline already accumulates micro-batches: set "
            "strategy.pipeline_configs = {'accumulate_steps': K} and strategy.gradient_merge = "
            "False",
        )
    _check_communication(strategy)


# The communication-efficient data-parallel keys, each replacing DDP's plain gradient all-reduce
# (a DDP communication hook, plus an optimizer wrapper for the last three).
_COMM_KEYS = ("fp16_allreduce", "localsgd", "adaptive_localsgd", "dgc")

_ONE_EXCHANGE = "each replaces the gradient all-reduce with its own exchange; keep one"
_MASTER = "the models would be averaged under the float32 master weights; use AMP O1"
_NO_DDP = {
    "pipeline": "PipelineParallel reduces gradients itself, there is no DDP to hook",
    "sharding_reduce": (
        "the sharded optimizer / FSDP2 reduce(-scatter) the gradients, not DDP; "
        "use sharding stage 1"
    ),
}
_DP_ONLY = {
    "sharding": "local steps and DGC need every rank's whole optimizer state; use pure data "
    "parallel",
    "tensor_parallel": "local SGD and DGC are built and tested for pure data parallel only so far",
}

# (a, b, contradiction?, why and what to do). A contradiction is a ConfigError; otherwise the
# pair is a FleetNotImplementedError (it could work, it is not built or tested yet).
_REFUSED_PAIRS: list[tuple[str, str, bool, str]] = [
    ("localsgd", "adaptive_localsgd", True, "two model-averaging schedules; keep one"),
    ("dgc", "localsgd", True, _ONE_EXCHANGE),
    ("dgc", "adaptive_localsgd", True, _ONE_EXCHANGE),
    (
        "fp16_allreduce",
        "dgc",
        True,
        (
            "DGC sends float32 top-k values and indices, there is no dense all-reduce to cast "
            "(Paddle refuses it too); keep one"
        ),
    ),
    (
        "dgc",
        "gradient_merge",
        True,
        "DGC already accumulates the gradient it did not send (local accumulation); keep one",
    ),
    (
        "dgc",
        "lars",
        True,
        "DGC's momentum correction needs a momentum SGD, LARS replaces it; keep one",
    ),
    (
        "dgc",
        "lamb",
        True,
        "DGC's momentum correction needs a momentum SGD, LAMB replaces an Adam; keep one",
    ),
    ("localsgd", "gradient_merge", False, "use one of them"),
    ("adaptive_localsgd", "gradient_merge", False, "use one of them"),
    ("localsgd", "amp_o2", False, _MASTER),
    ("adaptive_localsgd", "amp_o2", False, _MASTER),
    (
        "dgc",
        "amp_o2",
        False,
        "DGC compresses float32 gradients of float32 parameters (as Paddle); use AMP O1",
    ),
    (
        "asp",
        "amp_o2",
        False,
        "the 2:4 masks would be re-applied under the float32 master weights; use AMP O1",
    ),
    (
        "asp",
        "sharding",
        False,
        "the masks would be re-applied to this rank's partition only; use asp without sharding",
    ),
    *((key, other, False, why) for key in _COMM_KEYS for other, why in _NO_DDP.items()),
    *((key, other, False, why) for key in _COMM_KEYS[1:] for other, why in _DP_ONLY.items()),
]


def _active_settings(strategy: DistributedStrategy) -> dict[str, str]:
    """The switches the refusal table talks about that are on, with how to name them."""
    hybrid, stage = strategy.hybrid_configs, sharding_stage(strategy)
    names = [*_COMM_KEYS, "asp", "lars", "lamb"]
    on = {k: f"strategy.{k}" for k in names if getattr(strategy, k)}
    if strategy.gradient_merge and strategy.gradient_merge_configs.k_steps > 1:
        on["gradient_merge"] = "strategy.gradient_merge"
    if strategy.amp and strategy.amp_configs.use_pure_fp16:
        on["amp_o2"] = "amp_configs.use_pure_fp16 (AMP O2)"
    if hybrid.pp_degree > 1:
        on["pipeline"] = f"hybrid_configs.pp_degree={hybrid.pp_degree}"
    if stage:
        on["sharding"] = f"sharding stage {stage}"
    if stage in (2, 3):
        on["sharding_reduce"] = f"sharding stage {stage}"
    if hybrid.mp_degree > 1:
        on["tensor_parallel"] = f"hybrid_configs.mp_degree={hybrid.mp_degree}"
    return on


def _check_communication(strategy: DistributedStrategy) -> None:
    """Refuse the pairs of :data:`_REFUSED_PAIRS` that are both on, naming both."""
    on = _active_settings(strategy)
    for a, b, contradiction, why in _REFUSED_PAIRS:
        if a in on and b in on:
            what = f"{on[a]} with {on[b]}"
            if contradiction:
                raise ConfigError(f"{what}: {why}", key=a)
            raise FleetNotImplementedError(what, hint=why)


def require_strategy(strategy: Any) -> DistributedStrategy:
    """``strategy`` itself if it is a DistributedStrategy, else ConfigError."""
    if not isinstance(strategy, DistributedStrategy):
        raise ConfigError(
            f"expected a fleet.DistributedStrategy, got {type(strategy).__name__} {strategy!r}; "
            "build one with fleet.DistributedStrategy() or DistributedStrategy.from_yaml(path)",
            key="strategy",
        )
    return strategy


def check_strategy_supported(strategy: DistributedStrategy, where: str) -> None:
    """Raise FleetNotImplementedError naming every enabled strategy key that has not landed.

    ``where`` says which call is refusing (``"fleet.init"``), for the message.
    """
    require_strategy(strategy)
    keys = [key for key in _NOT_LANDED if getattr(strategy, key)]
    hybrid = strategy.hybrid_configs
    axes = [axis for axis in _HYBRID_AXES if getattr(hybrid, axis) > 1]
    if not keys and not axes:
        check_composition(strategy)  # contradictory settings / unsupported combinations
        return
    asked = [f"strategy.{key} ({_NOT_LANDED[key]})" for key in keys]
    asked += [
        f"strategy.hybrid_configs.{axis}={getattr(hybrid, axis)} ({_HYBRID_AXES[axis]})"
        for axis in axes
    ]
    fixes = [f"strategy.{key} = False" for key in keys]
    if axes:
        fixes.append(f"strategy.hybrid_configs = {{{', '.join(repr(a) + ': 1' for a in axes)}}}")
    raise FleetNotImplementedError(
        ", ".join(asked),
        hint=(
            f"{where} was given a strategy that asks for it, but so far only data parallel, "
            f"tensor, pipeline and sharding parallelism (hybrid_configs) and gradient_merge "
            f"have landed; "
            f"to train data-parallel, set {'; '.join(fixes)}"
        ),
    )


__all__ = [
    "DEFAULT_SHARDING_CONFIG_DEGREE",
    "check_composition",
    "check_strategy_supported",
    "require_strategy",
    "sharding_stage",
    "uses_pipeline",
]
