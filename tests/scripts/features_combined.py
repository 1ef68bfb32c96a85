"""Fixture for tests/test_amp_combined.py: AMP (bf16 autocast) + recompute + gradient merge
through the real entry points (``fleet.init`` with the strategy, ``fleet.distributed_model``,
``fleet.distributed_optimizer``, ``fleet.distributed_scaler``) at world 2 (data parallel), and on
rank 0 the single-process reference with the same settings on the global batch. Writes
``<out>/rank<N>.json`` with the final parameters' distance to the reference (rank 0), the
spread between ranks and what the wrappers did.
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
from fleet.parallelize.features import wrap_model_features

DIM, MICRO, K, UPDATES, LR = 16, 4, 2, 3, 0.05


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_strategy(world: int) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy(amp=True, recompute=True, gradient_merge=True)
    s.amp_configs = {"dtype": "bfloat16", "init_loss_scaling": 256.0}
    s.recompute_configs = {"checkpoints": ["layers.0", "layers.1"]}
    s.gradient_merge_configs = {"k_steps": K, "avg": True}
    return s


def batches(world: int):
    gen = torch.Generator().manual_seed(42)
    for _ in range(UPDATES * K):
        yield (
            torch.randn(MICRO * world, DIM, generator=gen),
            torch.randn(MICRO * world, 1, generator=gen),
        )


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def reference(strategy: fleet.DistributedStrategy, world: int) -> torch.Tensor:
    """One process, the global batch, the same AMP/recompute wrappers, merge by hand."""
    torch.manual_seed(0)
    net = wrap_model_features(Net(), strategy)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    scale = strategy.amp_configs.init_loss_scaling
    for i, (x, y) in enumerate(batches(world)):
        (F.mse_loss(net(x).float(), y) * scale).backward()
        if (i + 1) % K == 0:
            for p in net.parameters():
                p.grad.div_(K * scale)
            opt.step()
            opt.zero_grad()
    return flat(net)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    strategy = make_strategy(world)
    fleet.init(is_collective=True, strategy=strategy)
    rank = fleet.worker_index()
    torch.manual_seed(0)
    net = Net()
    model = fleet.distributed_model(net)
    opt = fleet.distributed_optimizer(torch.optim.SGD(net.parameters(), lr=LR))
    scaler = fleet.distributed_scaler(GradScaler.from_config(strategy.amp_configs))
    dtypes, updates = set(), 0
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    for x, y in batches(world):
        out = model(x[mine])
        dtypes.add(str(out.dtype))
        scaler.scale(F.mse_loss(out.float(), y[mine])).backward()
        before = flat(net)
        scaler.step(opt)
        scaler.update()
        updates += int(not torch.equal(before, flat(net)))
        opt.zero_grad()
    params = flat(net)
    gathered = [torch.empty_like(params) for _ in range(world)]
    tdist.all_gather(gathered, params)
    rec = {
        "rank": rank,
        "out_dtypes": sorted(dtypes),
        "updates": updates,
        "recompute_wrapped": [type(layer.__dict__.get("forward")).__name__ for layer in net.layers],
        "spread": max(float((g - params).abs().max()) for g in gathered),
        "scale": scaler.get_scale(),
        "is_ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
    }
    if rank == 0:
        ref = reference(strategy, world)
        rec["vs_reference"] = float((params - ref).abs().max())
        rec["moved"] = float((ref - reference_init()).abs().max())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    tdist.barrier()


def reference_init() -> torch.Tensor:
    torch.manual_seed(0)
    return flat(Net())


if __name__ == "__main__":
    main()
