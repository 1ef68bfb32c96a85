"""Fixture of tests/test_strategy_comm.py: sync batch norm and ASP through fleet on 2 ranks.

``sync_bn``: a BatchNorm MLP trained data-parallel with ``sync_batch_norm`` equals one process
training on the whole batch (parameters and running statistics, float64); without it the
statistics are per rank and it does not. ``asp``: weights are 2:4 after ``distributed_model`` and
stay so through momentum-SGD steps, density 0.5, the excluded layer dense.

``--case sync_bn|asp --out DIR`` writes ``DIR/rank<N>.json``.
"""

from __future__ import annotations

from typing import Any

import torch
from strategy_comm_common import global_batch, max_diff, my_slice, run_fixture, spread

import fleet
from fleet.meta_optimizers import asp
from fleet.meta_parallel.sync_batch_norm import SyncBatchNorm

IN = 8


def bn_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    ).double()


def state_vector(model: torch.nn.Module) -> torch.Tensor:
    """Parameters and floating buffers (running statistics)."""
    return torch.cat(
        [
            t.detach().reshape(-1).double()
            for t in model.state_dict().values()
            if t.is_floating_point()
        ]
    )


def train_bn(model: Any, opt: Any, steps: int, rank: int, world: int, whole: bool) -> None:
    for step in range(steps):
        x, y = global_batch(step, 8 * world, IN, dtype=torch.float64)
        if not whole:
            x, y = my_slice(x, rank, world), my_slice(y, rank, world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def case_sync_bn(rank: int, world: int, rec: dict[str, Any]) -> None:
    steps = 4
    reference = bn_model()
    train_bn(reference, torch.optim.SGD(reference.parameters(), lr=0.1), steps, rank, world, True)
    for sync in (True, False):
        model = bn_model()
        # with two more keys: one with a process-wide effect, one accepted without effect
        strategy = fleet.DistributedStrategy(
            sync_batch_norm=sync, cudnn_exhaustive_search=sync, nccl_comm_num=2 if sync else 1
        )
        opt = fleet.distributed_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy
        )
        dp = fleet.distributed_model(model)
        if sync:
            rec["cudnn_benchmark"] = torch.backends.cudnn.benchmark
        train_bn(dp, opt, steps, rank, world, False)
        key = "sync" if sync else "plain"
        rec[f"{key}_vs_whole_batch"] = max_diff(state_vector(dp.module), state_vector(reference))
        rec[f"{key}_bn_type"] = type(dp.module[1]).__name__
        rec[f"{key}_is_fleet_sync_bn"] = isinstance(dp.module[1], SyncBatchNorm)
    dp.module.eval()  # eval: running statistics, no communication
    rec["eval_ok"] = bool(torch.isfinite(dp(torch.randn(3, IN, dtype=torch.float64))).all())


def case_asp(rank: int, world: int, rec: dict[str, Any]) -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(4, 8, 3),
        torch.nn.Tanh(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 6, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 4),
        torch.nn.Tanh(),
        torch.nn.Linear(4, 3),
    )
    asp.set_excluded_layers(model, ["5.weight"])
    opt = fleet.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        strategy=fleet.DistributedStrategy(asp=True),
    )
    dp = fleet.distributed_model(model)
    weights = {n: p for n, p in model.named_parameters() if n.endswith("weight")}
    rec["after_prune"] = {n: asp.check_sparsity(p) for n, p in weights.items()}
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4 * world, 4, 8, generator=g)
        y = torch.randn(4 * world, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(
            dp(my_slice(x, rank, world)), my_slice(y, rank, world)
        ).backward()
        opt.step()
    rec["after_steps"] = {n: asp.check_sparsity(p) for n, p in weights.items()}
    rec["density"] = {n: asp.calculate_density(p) for n, p in weights.items()}
    rec["spread"] = spread(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


if __name__ == "__main__":
    run_fixture({"sync_bn": case_sync_bn, "asp": case_asp})
