"""``fleet.strategy``: the typed :class:`DistributedStrategy`, its config sections, YAML, and the
checks of what can run.

Owns every distributed-training switch as data: ``distributed_strategy`` (the strategy object,
Paddle's key names, YAML round trip), ``configs`` (one frozen dataclass per ``*_configs``
section) and ``composition`` (contradictions, unsupported combinations, features not landed).
The bottom of fleet with :mod:`fleet.telemetry`: it imports only :mod:`collective` and PyYAML —
never torch and nothing else of fleet — so ``fleet.DistributedStrategy`` and its YAML loading
work in the launcher.
"""

from fleet.strategy.composition import (
    check_composition,
    check_strategy_supported,
    require_strategy,
    sharding_stage,
    uses_pipeline,
)
from fleet.strategy.configs import (
    AdaptiveLocalSGDConfig,
    AmpConfig,
    AmpDtype,
    ASyncConfig,
    AutoConfig,
    DGCConfig,
    FP16AllReduceConfig,
    GradientMergeConfig,
    HybridConfig,
    LambConfig,
    LarsConfig,
    LocalSGDConfig,
    PipelineConfig,
    PipelineSchedule,
    RecomputeConfig,
    ShardingConfig,
    StrategySection,
    TensorParallelConfig,
)
from fleet.strategy.distributed_strategy import NO_OP_KEYS, DistributedStrategy
from fleet.strategy.heter_config import HeterConfig

__all__ = [
    "NO_OP_KEYS",
    "ASyncConfig",
    "AdaptiveLocalSGDConfig",
    "AmpConfig",
    "AmpDtype",
    "AutoConfig",
    "DGCConfig",
    "DistributedStrategy",
    "FP16AllReduceConfig",
    "GradientMergeConfig",
    "HeterConfig",
    "HybridConfig",
    "LambConfig",
    "LarsConfig",
    "LocalSGDConfig",
    "PipelineConfig",
    "PipelineSchedule",
    "RecomputeConfig",
    "ShardingConfig",
    "StrategySection",
    "TensorParallelConfig",
    "check_composition",
    "check_strategy_supported",
    "require_strategy",
    "sharding_stage",
    "uses_pipeline",
]
