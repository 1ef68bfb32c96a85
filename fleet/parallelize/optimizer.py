"""``fleet.distributed_optimizer``: validate the optimizer and hand it to the composition.

Collective mode: :func:`fleet.parallelize.compose.parallelize` applies the strategy's optimizer
features, sharding and gradient merge (:class:`~fleet.meta_optimizers.gradient_merge.DistributedOptimizer`).
Parameter-server mode: a :class:`~fleet.ps.optimizer.PSOptimizer` (dense parameters on the
servers).
"""

from __future__ import annotations

import logging

import torch

from collective.errors import ConfigError
from fleet.base.runtime import get_runtime
from fleet.meta_optimizers.gradient_merge import DistributedOptimizer
from fleet.parallelize.compose import parallelize
from fleet.ps.optimizer import PSOptimizer
from fleet.ps.runtime import in_ps_mode
from fleet.strategy import DistributedStrategy, check_strategy_supported, require_strategy

logger = logging.getLogger(__name__)


def distributed_optimizer(
    optimizer: torch.optim.Optimizer, strategy: DistributedStrategy | None = None
) -> DistributedOptimizer:
    """Wrap ``optimizer`` for distributed training according to the strategy.

    ``strategy``: None uses the one given to :func:`fleet.init`; a strategy given here replaces
    it for the rest of the job (as in Paddle). Strategies asking for features that have not
    landed raise FleetNotImplementedError naming the key.
    """
    if strategy is not None:
        require_strategy(strategy)
        check_strategy_supported(strategy, "fleet.distributed_optimizer")
    runtime = get_runtime("distributed_optimizer()")
    if in_ps_mode():
        if strategy is not None and strategy.to_dict() != runtime.strategy.to_dict():
            raise ConfigError(
                "in parameter-server mode the strategy is fixed by fleet.init; pass it there",
                key="strategy",
            )
        return PSOptimizer(optimizer)  # type: ignore[return-value]
    if strategy is None:
        strategy = runtime.strategy
        check_strategy_supported(strategy, "fleet.distributed_optimizer")
    elif strategy is not runtime.strategy:
        if strategy.hybrid_configs != runtime.strategy.hybrid_configs:
            raise ConfigError(
                f"the strategy's hybrid_configs ({strategy.hybrid_configs.to_dict()}) differ from "
                f"the ones fleet.init built the process groups for "
                f"({runtime.strategy.hybrid_configs.to_dict()}); set the degrees before fleet.init",
                key="hybrid_configs",
            )
        runtime.dp_degree = strategy.hybrid_configs.resolve_dp_degree(runtime.env.world_size)
        runtime.strategy = strategy
        if runtime.env.rank == 0:
            logger.info(
                "fleet.distributed_optimizer replaced the strategy of fleet.init:\n%s", strategy
            )
    if isinstance(optimizer, DistributedOptimizer):
        raise ConfigError(
            "this optimizer is already wrapped by fleet.distributed_optimizer", key="optimizer"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}", key="optimizer"
        )
    # Features, sharding and gradient merge are chosen and applied in one place, in one order:
    # fleet.parallelize.compose.
    return parallelize(runtime, optimizer=optimizer)  # type: ignore[no-any-return]


__all__ = ["distributed_optimizer"]
