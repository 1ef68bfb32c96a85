"""``fleet.distributed_model``: validate the model and hand it to the composition.

Collective mode: :func:`fleet.parallelize.compose.parallelize` picks and applies the wrappers
(features, pipeline, FSDP2, DDP over the right group). Parameter-server mode: the model stays as
it is (dense parameters are synchronised through the servers by :mod:`fleet.ps.optimizer`).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from collective.errors import ConfigError
from fleet.base.runtime import get_runtime
from fleet.parallelize.compose import parallelize
from fleet.ps.runtime import in_ps_mode
from fleet.strategy import check_strategy_supported


def distributed_model(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``model`` for distributed training as the strategy asks (:mod:`fleet.parallelize.compose`).

    Pure data parallel gives a :class:`DataParallel` (torch ``DistributedDataParallel``); hybrid
    strategies give DDP over the data-parallel (x sharding) group, a ``PipelineParallel``
    (``pp_degree > 1``), an FSDP2 module (sharding stage 3), or the model itself when there is
    no replica to average with (tensor parallel alone). The model must already be on its device:
    CPU, or ``cuda:<local_rank>`` under NCCL (then ``device_ids=[that device]``). Parameters are
    broadcast from the first rank of the group when wrapping.
    """
    runtime = get_runtime("distributed_model()")
    if in_ps_mode():
        # Dense parameters are synchronised through the parameter servers (fleet.ps.optimizer),
        # not by all-reduce: the model stays as it is.
        return model  # type: ignore[return-value]
    strategy = runtime.strategy
    check_strategy_supported(strategy, "fleet.distributed_model")
    strategy.hybrid_configs.resolve_dp_degree(runtime.env.world_size)  # still fits the world?
    if isinstance(model, DistributedDataParallel):
        raise ConfigError("this model is already wrapped for data parallel", key="model")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"expected a torch.nn.Module, got {type(model).__name__}", key="model")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no parameter that requires grad", key="model")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ConfigError(
            f"the model's parameters are on several devices {sorted(map(str, devices))}; data "
            "parallel needs one device per process",
            key="model",
        )
    device = devices.pop()
    backend = torch.distributed.get_backend()
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"the process group uses NCCL but the model is on {device}; move it first: "
            f"model.to(f'cuda:{{fleet.local_rank()}}')  (here cuda:{runtime.env.local_rank})",
            key="model",
        )
    # Every wrapper (features, pipeline, FSDP2, DDP over the right group) is chosen and applied
    # in one place, in one order: fleet.parallelize.compose.
    return parallelize(runtime, model=model)  # type: ignore[no-any-return]


__all__ = ["distributed_model"]
