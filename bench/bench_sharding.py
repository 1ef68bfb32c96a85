"""Sharding: fleet stage 1/2 (fleet.meta_optimizers.sharding) vs torch's ZeroRedundancyOptimizer and FSDP2.

One fleetrun job of 2 ranks (CPU/gloo) runs every implementation on the same model (an MLP of
``--layers`` Linear(width, width)), data and Adam, alternating their order per repetition:

* ``fleet-s1``: fleet.distributed_model + fleet.distributed_optimizer, sharding stage 1
* ``zero``:     torch DDP + ``ZeroRedundancyOptimizer(optimizer_class=Adam)`` (its peer)
* ``fleet-s2``: the same with sharding stage 2 (gradients reduced to their owner)
* ``fsdp2-op``: torch FSDP2 ``fully_shard(reshard_after_forward=False)`` (SHARD_GRAD_OP, peer)
* ``ddp``:      plain DDP + Adam (the unsharded optimizer-state size)

Each repetition's value is the median step time (forward, backward, step, zero_grad) of the
slowest rank; the table is median [min .. max] over repetitions and the ratio fleet/peer time
(goal <= 1.05, i.e. speed >= 0.95). Optimizer-state bytes per rank vs the unsharded bytes / N
(goal <= 1/N + 5 %).

Usage: ``python bench/bench_sharding.py [--reps 5] [--steps 20] [--layers 8] [--width 512]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Stats, fleetrun_cmd, report, run_checked

IMPLS = ("fleet-s1", "zero", "fleet-s2", "fsdp2-op", "ddp")


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    import fleet
    from fleet.meta_optimizers.sharding import optimizer_state_bytes

    def strategy(stage: int) -> fleet.DistributedStrategy:
        s = fleet.DistributedStrategy()
        s.hybrid_configs = {"sharding_degree": 2}
        s.sharding = True
        s.sharding_configs = {"stage": stage}
        return s

    fleet.init(is_collective=True, strategy=strategy(1))
    rank = tdist.get_rank()

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)

    def build(impl: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = make_model()
        if impl in ("fleet-s1", "fleet-s2"):
            s = strategy(1 if impl == "fleet-s1" else 2)
            opt = fleet.distributed_optimizer(
                torch.optim.Adam(model.parameters(), lr=1e-4), strategy=s
            )
            return fleet.distributed_model(model), opt
        if impl == "zero":
            ddp = DistributedDataParallel(model)
            return ddp, ZeroRedundancyOptimizer(
                ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4
            )
        if impl == "fsdp2-op":
            for child in model.children():
                if any(True for _ in child.parameters()):
                    fully_shard(child, reshard_after_forward=False)
            fully_shard(model, reshard_after_forward=False)
            return model, torch.optim.Adam(model.parameters(), lr=1e-4)
        ddp = DistributedDataParallel(model)
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-4)

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    times: dict[str, list[float]] = {i: [] for i in IMPLS}
    state_bytes: dict[str, int] = {}
    for rep in range(args.reps):
        order = IMPLS if rep % 2 == 0 else tuple(reversed(IMPLS))
        for impl in order:
            model, opt = build(impl)
            steps = []
            for step in range(args.warmup + args.steps):
                tdist.barrier()
                t0 = time.perf_counter()
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                if step >= args.warmup:
                    steps.append(time.perf_counter() - t0)
            slowest = torch.tensor([statistics.median(steps)])
            tdist.all_reduce(slowest, op=tdist.ReduceOp.MAX)
            times[impl].append(float(slowest))
            # ZeroRedundancyOptimizer keeps its shard's state in its local optimizer (.optim)
            state_bytes[impl] = optimizer_state_bytes(getattr(opt, "optim", opt))
            del model, opt
    if rank == 0:
        print(
            json.dumps(
                {
                    "times": times,
                    "state_bytes": state_bytes,
                    "params": sum(p.numel() for p in make_model().parameters()),
                }
            )
        )
    tdist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    passthrough = [
        f"--{k}={getattr(args, k)}" for k in ("reps", "steps", "warmup", "layers", "width", "batch")
    ]
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = fleetrun_cmd(
            "--nproc_per_node",
            "2",
            "--log_dir",
            log_dir,
            os.path.abspath(__file__),
            "--worker",
            *passthrough,
        )
        out = run_checked(cmd, timeout=1800).stdout
    data = json.loads(next(ln for ln in out.splitlines() if ln.startswith('{"times"')))
    t = {k: Stats.of(v) for k, v in data["times"].items()}
    sb = data["state_bytes"]
    full = sb["ddp"]
    report(
        f"Sharding step time, 2 ranks (CPU gloo), MLP {args.layers} x Linear({args.width}), "
        f"{data['params']} params, Adam",
        [
            (
                "stage 1: fleet vs DDP + ZeroRedundancyOptimizer",
                t["fleet-s1"],
                t["zero"],
                "fleet/zero time",
            ),
            (
                "stage 2: fleet vs FSDP2 reshard_after_forward=False",
                t["fleet-s2"],
                t["fsdp2-op"],
                "fleet/fsdp2 time",
            ),
        ],
        goal="<= 1.05 (speed >= 0.95)",
        extra={"state_bytes": sb},
        json_path=args.json,
    )
    print(
        "optimizer-state bytes per rank (rank 0) vs unsharded / 2 "
        "(goal <= 1/N + 5 %, i.e. ratio <= 0.55):"
    )
    for impl in IMPLS:
        print(f"  {impl:9s}: {sb[impl]:>10d} B  ratio to unsharded {sb[impl] / full:.3f}")


if __name__ == "__main__":
    main()
