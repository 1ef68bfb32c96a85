"""Synchronised batch norm (Paddle's ``strategy.sync_batch_norm``): batch statistics over every
data-parallel replica instead of each rank's share of the batch.

On accelerators this is torch's ``nn.SyncBatchNorm`` unchanged (its fused CUDA kernels, through
``nn.SyncBatchNorm.convert_sync_batchnorm``). torch's refuses CPU tensors (its kernels
``batch_norm_stats`` & co. exist for GPUs only, and DDP rejects ``nn.SyncBatchNorm`` in a CPU
module), so for CPU modules — gloo jobs, and the tests — :func:`convert_sync_batchnorm` puts in
:class:`SyncBatchNorm`, which computes the statistics with one autograd-aware all-reduce
(torch's functional ``all_reduce``, which torch 2.13 differentiates) of ``[sum, sum of squares, count]`` per channel;
backward all-reduces their gradients, so every rank's parameter gradient is that of the whole
batch, as torch's CUDA path gives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
from torch import nn


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm whose training statistics are all-reduced over ``process_group``, for CPU
    modules (see the module docstring). Not a subclass of ``nn.SyncBatchNorm``: DDP refuses those
    on CPU. Outside training, or in a world of one, it is plain batch norm."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Plain batch norm outside training; in training the statistics of every rank's
        batch."""
        group = self.process_group or tdist.group.WORLD
        if not self.training or not tdist.is_initialized() or tdist.get_world_size(group) == 1:
            return super().forward(input)
        import torch.distributed._functional_collectives as funcol  # lazy: 90 ms of import

        self._check_input_dim(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        count = torch.full((1,), input.numel() // channels, dtype=input.dtype)
        local = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = funcol.all_reduce(local, "sum", group)  # differentiable: backward all-reduces
        n = total[2 * channels]
        mean = total[:channels] / n
        var = (total[channels : 2 * channels] / n - mean * mean).clamp_min(0)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(mean.detach(), var.detach() * n / (n - 1))
        return out

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        assert self.num_batches_tracked is not None and self.running_var is not None
        self.num_batches_tracked.add_(1)
        factor = (
            self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        )
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var, alpha=factor)


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """``module`` with every BatchNorm layer synchronised over ``process_group`` (None: the
    default group): torch's ``nn.SyncBatchNorm.convert_sync_batchnorm`` for modules on an
    accelerator, :class:`SyncBatchNorm` layers for modules on CPU. Parameters and running
    statistics are the same tensors (an optimizer built before keeps working). Returns the module
    to use (a new one when ``module`` itself is a BatchNorm layer)."""
    if any(t.device.type != "cpu" for t in (*module.parameters(), *module.buffers())):
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        out = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out


__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
