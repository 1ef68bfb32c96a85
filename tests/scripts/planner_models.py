"""Small models for the planner's command-line tests: a plain ``nn.Module`` (no layer list, no
tensor-parallel layers: only data parallelism and sharding apply to it) and a model function
that fails."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class PlainNet(nn.Module):
    """Two linear layers; not a layer list, so the planner cannot cut pipeline stages."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inner = nn.Linear(8, width)
        self.act = nn.ReLU()
        self.outer = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.act(self.inner(x)))


def plain() -> tuple[nn.Module, nn.Module]:
    """The plain model and its loss."""
    return PlainNet(), nn.MSELoss()


def sample(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random inputs and targets."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 8, generator=g)


def broken(mp_group: Any = None) -> Any:
    """A model function that fails while it builds."""
    raise ValueError("this model function fails on purpose")


__all__ = ["PlainNet", "broken", "plain", "sample"]
