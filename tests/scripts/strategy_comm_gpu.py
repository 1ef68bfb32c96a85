"""Fixture of the GPU test in tests/test_strategy_comm.py (world 1, NCCL): fp16/bf16 all-reduce,
DGC and sync batch norm on CUDA tensors through fleet — the hooks register on NCCL, the
compressed bucket halves the bytes, DGC's top-k/all_gather run on the GPU, and sync batch norm
is torch's own ``nn.SyncBatchNorm`` there.

``--out DIR`` writes ``DIR/rank0.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import torch
import torch.distributed as tdist
from strategy_comm_common import global_batch, mlp

import fleet
from fleet.meta_optimizers.comm_hooks import CommCounter


def train(
    strategy: fleet.DistributedStrategy, model: torch.nn.Module, device: torch.device, features: int
) -> dict[str, Any]:
    model = model.to(device)
    opt = fleet.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), strategy=strategy
    )
    dp = fleet.distributed_model(model)
    losses, nbytes = [], 0
    for step in range(4):
        x, y = (t.to(device) for t in global_batch(step, 16, features))
        with CommCounter() as counter:
            loss = torch.nn.functional.mse_loss(dp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
        nbytes = counter.bytes["allreduce"]
    return {
        "finite": all(math.isfinite(v) for v in losses),
        "bytes": nbytes,
        "device": str(next(model.parameters()).device),
        "dp": dp,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fleet.init(is_collective=True)
    device = torch.device(f"cuda:{fleet.local_rank()}")
    torch.cuda.set_device(device)
    rec: dict[str, Any] = {"backend": tdist.get_backend()}
    plain = train(fleet.DistributedStrategy(), mlp(16, 32, 1), device, 16)
    rec["fp32_bytes"] = plain["bytes"]
    for key, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        out = train(
            fleet.DistributedStrategy(fp16_allreduce=True, fp16_allreduce_configs={"dtype": dtype}),
            mlp(16, 32, 1),
            device,
            16,
        )
        rec[key] = {k: v for k, v in out.items() if k != "dp"}
    out = train(
        fleet.DistributedStrategy(dgc=True, dgc_configs={"rampup_begin_step": 1}),
        mlp(64, 256, 1),
        device,
        64,
    )
    rec["dgc"] = {k: v for k, v in out.items() if k != "dp"}
    torch.manual_seed(0)
    bn = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    out = train(fleet.DistributedStrategy(sync_batch_norm=True), bn, device, 16)
    layer = out["dp"].module[1]
    rec["sync_bn_type"], rec["sync_bn_module"] = type(layer).__name__, type(layer).__module__
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rank0.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
