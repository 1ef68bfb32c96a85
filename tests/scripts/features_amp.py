"""Fixture for tests/test_amp.py: a tensor-parallel MLP trained a few steps under bf16 autocast
with a loss scaler wrapped by ``fleet.distributed_scaler``; global rank 1 injects an inf into one
of its gradients at steps INJECT. Writes ``<out>/rank<N>.json`` with, per step and per scaler
kind (fleet's GradScaler, torch.amp.GradScaler): whether this rank's own gradients held an inf,
whether its parameters were left unchanged (skipped), and the scale after ``update``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

import fleet
from fleet.meta_optimizers.amp import GradScaler
from fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

STEPS = 9
INJECT = (2, 5)
INJECT_RANK = 1
IN, HIDDEN, OUT = 8, 16, 4


def make_scaler(kind: str):
    if kind == "fleet":
        return GradScaler(
            init_loss_scaling=1024.0,
            incr_ratio=2.0,
            decr_ratio=0.5,
            incr_every_n_steps=3,
            decr_every_n_nan_or_inf=1,
        )
    return torch.amp.GradScaler(
        "cpu", init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3
    )


def train(kind: str, rank: int, dp_rank: int) -> list[dict]:
    torch.manual_seed(0)
    d1, d2 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
    model = nn.Sequential(
        ColumnParallelLinear.from_dense(d1, gather_output=False),
        nn.ReLU(),
        RowParallelLinear.from_dense(d2, input_is_parallel=True),
    )
    params = list(model.parameters())
    wrapped = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(torch.optim.SGD(params, lr=0.05))
    scaler = fleet.distributed_scaler(make_scaler(kind))
    gen = torch.Generator().manual_seed(100 + dp_rank)
    steps = []
    for step in range(STEPS):
        x, y = torch.randn(4, IN, generator=gen), torch.randn(4, OUT, generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = wrapped(x)
        loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        if step in INJECT and rank == INJECT_RANK:
            params[0].grad[0, 0] = float("inf")
        local_inf = not all(bool(torch.isfinite(p.grad).all()) for p in params)
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        skipped = all(torch.equal(a, p.detach()) for a, p in zip(before, params))
        steps.append(
            {"local_inf": local_inf, "skipped": skipped, "scale": float(scaler.get_scale())}
        )
        opt.zero_grad()
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--mp", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "mp_degree": args.mp}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    rank = fleet.worker_index()
    rec = {
        "rank": rank,
        "fleet": train("fleet", rank, hcg.get_data_parallel_rank()),
        "torch": train("torch", rank, hcg.get_data_parallel_rank()),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    tdist.barrier()


if __name__ == "__main__":
    main()
