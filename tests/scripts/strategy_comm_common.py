"""Shared by the strategy_comm_* fixtures: data, models, the per-rank record, cross-rank spread."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist

import fleet


def global_batch(
    step: int, size: int, features: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression batch of ``size`` samples for ``step`` (same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, features, generator=g, dtype=dtype)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(size, 1, generator=g, dtype=dtype)
    return x, y


def my_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous share of ``t``."""
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def mlp(*widths: int, seed: int = 1234, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Linear layers of ``widths`` with Tanh between (same weights for the same seed)."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers).to(dtype)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, flattened into one vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def spread(t: torch.Tensor) -> float:
    """Largest difference of ``t`` between ranks (0.0 when identical)."""
    gathered = [torch.zeros_like(t) for _ in range(tdist.get_world_size())]
    tdist.all_gather(gathered, t.contiguous())
    return max(float((g - gathered[0]).abs().max()) for g in gathered)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of two tensors."""
    return float((a - b).abs().max())


def run_fixture(cases: dict[str, Callable[[int, int, dict[str, Any]], None]]) -> None:
    """``--case NAME --out DIR``: fleet.init, run the case, write ``DIR/rank<N>.json``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(cases), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    rec: dict[str, Any] = {"rank": rank, "world": world}
    cases[args.case](rank, world, rec)
    fleet.barrier_worker()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    print(f"STRATEGY_COMM_OK rank={rank} case={args.case}", flush=True)
