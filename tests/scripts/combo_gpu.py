"""Fixture of the GPU test in tests/test_strategy_hybrid_combos.py (world 1, NCCL): the float16
paths of the hybrid combinations, on CUDA tensors — AMP O2 float16 master weights under a
stage-2 sharded optimizer (a sharding group of one: the reduce and broadcast run on NCCL), the
float16 loss scaler reducing through it and skipping an overflowing step, the global-norm clip
over a sharded partition, and FSDP2 stage 3 with a float16 ``MixedPrecisionPolicy``. The sharded
run must equal the same O2 training without the sharded optimizer (one rank: the same
arithmetic).

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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import fleet
from fleet.meta_optimizers.amp import GradScaler
from fleet.meta_optimizers.sharding import ShardedOptimizer, apply_fsdp
from fleet.parallelize.features import wrap_model_features, wrap_optimizer_features

O2_FP16 = {
    "dtype": "float16",
    "use_pure_fp16": True,
    "init_loss_scaling": 1024.0,
    "decr_ratio": 0.5,
    "decr_every_n_nan_or_inf": 1,
}


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    if step == 1:
        y[:4] = 1e4  # float16 gradients overflow at scale 1024
    return x.to(device), y.to(device)


def train_o2(device: torch.device, sharded: bool) -> dict[str, Any]:
    strategy = fleet.DistributedStrategy(amp=True, amp_configs=O2_FP16)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)
    model = wrap_model_features(model, strategy)
    user = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    user.grad_clip = fleet.ClipGradByGlobalNorm(0.05)
    opt: Any = wrap_optimizer_features(user, strategy)
    if sharded:
        opt.grad_clip.sharded_partition = True
        opt = ShardedOptimizer(
            opt, stage=2, group=tdist.group.WORLD, group_ranks=[0], reduce_grads=False
        )
    scaler = GradScaler.from_config(strategy.amp_configs)
    skipped, scales = [], []
    for step in range(3):
        x, y = batch(step, device)
        loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        skipped.append(bool(scaler.found_inf(opt)))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return {
        "params": [p.detach().float().cpu() for p in model.parameters()],
        "dtype": str(next(model.parameters()).dtype),
        "skipped": skipped,
        "scales": scales,
    }


def train_fsdp_fp16(device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)
    mesh = DeviceMesh.from_group(tdist.group.WORLD, device.type, mesh_dim_names=("sharding",))
    model = apply_fsdp(model, mesh, offload=False, param_dtype=torch.float16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in (0, 2):
        x, y = batch(step, device)
        out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "out_dtype": str(out.dtype),
        "param_dtype": str(next(model.parameters()).dtype),
        "finite": all(math.isfinite(v) for v in losses),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the same code on gloo")
    args = parser.parse_args()
    fleet.init(is_collective=True)
    device = torch.device(f"cuda:{fleet.local_rank()}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    plain, sharded = train_o2(device, False), train_o2(device, True)
    rec: dict[str, Any] = {
        "backend": tdist.get_backend(),
        "o2_dtype": sharded["dtype"],
        "o2_vs_unsharded": max(
            float((a - b).abs().max()) for a, b in zip(sharded["params"], plain["params"])
        ),
        "skipped": sharded["skipped"],
        "ref_skipped": plain["skipped"],
        "scales": sharded["scales"],
        "ref_scales": plain["scales"],
        "fsdp_fp16": train_fsdp_fp16(device),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rank0.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
