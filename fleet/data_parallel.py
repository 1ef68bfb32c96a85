"""``fleet.distributed_model``: torch DDP, configured from the strategy.

Data parallelism is torch's own ``DistributedDataParallel`` (bucketed, overlapped all-reduce);
fleet adds only the strategy mapping (``find_unused_parameters``; ``fuse_grad_size_in_MB`` →
``bucket_cap_mb``) and one behaviour: when the optimizer of this model merges gradients over K
micro-steps (``strategy.gradient_merge``), the forward of micro-steps 1..K-1 runs under DDP's
``no_sync`` so their backward skips the all-reduce (see :mod:`fleet.optimizer`).

:func:`distributed_model` validates the model and hands it to :func:`fleet.parallelize.parallelize`,
which picks the wrappers (pipeline, FSDP2, DDP over which group) from the strategy.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from collective.errors import ConfigError
from fleet import telemetry
from fleet.base import check_strategy_supported, get_runtime
from fleet.optimizer import GradientMergeState

logger = logging.getLogger(__name__)


class DataParallel(DistributedDataParallel):
    """torch DDP that follows the gradient-merge cycle of its fleet optimizer.

    ``grad_merge`` is set by :func:`fleet.distributed_optimizer` (None: every backward reduces).
    """

    def __init__(self, module: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self.grad_merge: GradientMergeState | None = None
        telemetry.watch_ddp(self)  # all_reduce time, with metrics on (fleet/telemetry.py)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """DDP's forward; under ``no_sync`` when the coming backward is not a merge boundary."""
        if self.training:
            telemetry.on_forward(inputs)  # samples (fleet/telemetry.py)
        gm = self.grad_merge
        if gm is not None and not gm.sync_this_step():
            # DDP decides in forward whether the next backward all-reduces.
            with self.no_sync():
                return super().forward(*inputs, **kwargs)
        return super().forward(*inputs, **kwargs)


def distributed_model(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``model`` for distributed training as the strategy asks (:mod:`fleet.parallelize`).

    Pure data parallel gives a :class:`DataParallel` (torch ``DistributedDataParallel``); hybrid
    strategies give DDP over the data-parallel (x sharding) group, a ``PipelineParallel``
    (``pp_degree > 1``), an FSDP2 module (sharding stage 3), or the model itself when there is
    no replica to average with (tensor parallel alone). The model must already be on its device:
    CPU, or ``cuda:<local_rank>`` under NCCL (then ``device_ids=[that device]``). Parameters are
    broadcast from the first rank of the group when wrapping.
    """
    runtime = get_runtime("distributed_model()")
    from fleet.ps_runtime import in_ps_mode

    if in_ps_mode():
        # Dense parameters are synchronised through the parameter servers (fleet.ps_optimizer),
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
    # in one place, in one order: fleet.parallelize.
    from fleet.parallelize import parallelize

    return parallelize(runtime, model=model)  # type: ignore[no-any-return]


__all__ = ["DataParallel", "distributed_model"]
