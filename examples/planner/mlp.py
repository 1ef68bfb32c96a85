"""An MLP-heavy model for the planner: residual blocks of a Megatron MLP (column-parallel
``width -> 4 width``, GELU, row-parallel back), a regression head, mean squared error.

``fleetrun plan --model examples.planner.mlp:model --sample examples.planner.mlp:sample
--global_batch_size 256``. Many parameters per sample, so the gradient all-reduce of data
parallelism weighs against the activations' all-reduces of tensor parallelism. Sizes from
``PLAN_MLP_WIDTH`` (default 512) and ``PLAN_MLP_BLOCKS`` (default 8).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleet.meta_parallel import ColumnParallelLinear, LayerDesc, RowParallelLinear


def width() -> int:
    return int(os.environ.get("PLAN_MLP_WIDTH", "512"))


def blocks() -> int:
    return int(os.environ.get("PLAN_MLP_BLOCKS", "8"))


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))`` with fc1 split by columns and fc2 by rows."""

    def __init__(self, width: int, mp_group: Any = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = ColumnParallelLinear(width, 4 * width, gather_output=False, mp_group=mp_group)
        self.fc2 = RowParallelLinear(4 * width, width, input_is_parallel=True, mp_group=mp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def model(mp_group: Any = None) -> tuple[list[Any], nn.Module]:
    """Input projection, ``blocks()`` MLP blocks, a 1-output head; mean squared error."""
    w = width()
    return (
        [
            LayerDesc(nn.Linear, w, w),
            *[LayerDesc(MLPBlock, w, mp_group=mp_group) for _ in range(blocks())],
            LayerDesc(nn.LayerNorm, w),
            LayerDesc(nn.Linear, w, 1),
        ],
        nn.MSELoss(),
    )


def sample(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and targets of a fixed seed."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, width(), generator=g), torch.randn(batch_size, 1, generator=g)


__all__ = ["MLPBlock", "blocks", "model", "sample", "width"]
