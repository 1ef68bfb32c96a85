"""Data parallel: torch DDP that follows fleet's gradient-merge cycle.

Data parallelism is torch's own ``DistributedDataParallel`` (bucketed, overlapped all-reduce);
fleet adds only the strategy mapping (``find_unused_parameters``; ``fuse_grad_size_in_MB``,
``last_comm_group_size_MB``, ``fuse_all_reduce_ops`` → the bucket sizes; ``fp16_allreduce``,
``localsgd``, ``adaptive_localsgd``, ``dgc`` → a communication hook; both chosen in
:mod:`fleet.parallelize.compose`) and one behaviour: when the optimizer of this model merges gradients over K
micro-steps (``strategy.gradient_merge``), the forward of micro-steps 1..K-1 runs under DDP's
``no_sync`` so their backward skips the all-reduce (see :mod:`fleet.meta_optimizers.gradient_merge`).

``fleet.distributed_model`` (:mod:`fleet.parallelize.model`) validates the model and hands it to
:func:`fleet.parallelize.compose.parallelize`, which picks the wrappers (pipeline, FSDP2, DDP over
which group) from the strategy and applies this one for the data-parallel axis.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import fleet.telemetry as telemetry
from fleet.meta_optimizers.gradient_merge import GradientMergeState


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


__all__ = ["DataParallel"]
