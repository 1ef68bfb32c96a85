"""Fixture for tests/test_fleet_dp.py: one run checks fleet's roles, data parallel and gradient
merge against single-process training, and writes ``<out>/rank<N>.json`` with what it saw.

The single-process reference runs inside rank 0 on the full global batch. Everything is float64
so "equal" can mean within 1e-6 (in practice ~1e-15).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as tdist

import fleet
from collective.errors import FleetError, FleetNotImplementedError
from fleet.base.runtime import get_runtime

IN, HIDDEN, OUT = 6, 16, 1


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    ).double()


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, IN, generator=g, dtype=torch.float64)
    noise = torch.randn(size, 1, generator=g, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * noise
    return x, y


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def reference(steps: int, batch: int, lr: float) -> torch.Tensor:
    """Plain single-process SGD on the full global batch of every step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = global_batch(step, batch)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return flat_params(model)


def spread(t: torch.Tensor) -> float:
    """Largest difference of ``t`` between ranks (0.0 when identical)."""
    gathered = [torch.zeros_like(t) for _ in range(fleet.worker_num())]
    tdist.all_gather(gathered, t)
    return max(float((g - gathered[0]).abs().max()) for g in gathered)


def check_data_parallel(rank: int, world: int, rec: dict) -> None:
    """Pure DP: each rank trains on its contiguous slice of a fixed global batch."""
    steps, batch, lr = 5, 8 * world, 0.1
    model = make_model()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=lr))
    dp = fleet.distributed_model(model)
    rec["dp_is_ddp"] = isinstance(dp, torch.nn.parallel.DistributedDataParallel)
    rec["dp_bucket_bytes_cap"] = int(dp.bucket_bytes_cap)
    rec["opt_is_optimizer"] = isinstance(opt, torch.optim.Optimizer)
    rec["opt_param_groups_shared"] = opt.param_groups is opt.inner_optimizer.param_groups
    per = batch // world
    for step in range(steps):
        x, y = global_batch(step, batch)
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        opt.zero_grad()
        torch.nn.functional.mse_loss(dp(xs), ys).backward()
        opt.step()
    params = flat_params(model)
    rec["dp_spread"] = spread(params)
    if rank == 0:
        rec["dp_vs_reference"] = float((params - reference(steps, batch, lr)).abs().max())
    rec["opt_state_dict_passthrough"] = (
        opt.state_dict()["param_groups"] == opt.inner_optimizer.state_dict()["param_groups"]
    )


def check_gradient_merge(rank: int, world: int, rec: dict) -> None:
    """K=4 micro-steps with avg equal one step on the K-times larger batch; DDP skips the
    all-reduce on micro-steps 1..K-1 (counted with a comm hook)."""
    k, updates, micro, lr = 4, 2, 4, 0.1
    strategy = fleet.DistributedStrategy(
        gradient_merge=True, gradient_merge_configs={"k_steps": k, "avg": True}
    )
    model = make_model()
    # Paddle's order: optimizer first (its strategy replaces fleet.init's), then the model.
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=lr), strategy=strategy)
    dp = fleet.distributed_model(model)
    rec["gm_linked"] = dp.grad_merge is opt.grad_merge and dp.grad_merge is not None

    reduces = [0]

    # no annotations: DDP checks them at runtime and this module's are strings
    def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
        reduces[0] += 1
        t = bucket.buffer().div_(world)
        return tdist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

    dp.register_comm_hook(None, counting_allreduce)
    counts, grad_kept = [], []
    global_size = micro * world * k  # samples per update
    for update in range(updates):
        x, y = global_batch(update, global_size)
        for j in range(k):
            # micro-step j of this update: rank r reads its slice of chunk j
            lo = j * micro * world + rank * micro
            xs, ys = x[lo : lo + micro], y[lo : lo + micro]
            torch.nn.functional.mse_loss(dp(xs), ys).backward()
            opt.step()
            opt.zero_grad()
            counts.append(reduces[0])
            grad_kept.append(model[0].weight.grad is not None)
    rec["gm_reduce_counts"] = counts
    rec["gm_grad_kept"] = grad_kept
    params = flat_params(model)
    rec["gm_spread"] = spread(params)
    if rank == 0:
        rec["gm_vs_reference"] = float((params - reference(updates, global_size, lr)).abs().max())


def check_not_implemented(rec: dict) -> None:
    """Switching on a feature that has not landed makes distributed_model/optimizer raise."""
    strategy = get_runtime("test").strategy
    strategy.tensor_parallel = True
    try:
        fleet.distributed_model(make_model())
        rec["ni_model"] = "no error"
    except FleetNotImplementedError as err:
        rec["ni_model"] = str(err)
    finally:
        strategy.tensor_parallel = False
    amp = fleet.DistributedStrategy(tensor_parallel=True)
    try:
        fleet.distributed_optimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), amp)
        rec["ni_optimizer"] = "no error"
    except FleetNotImplementedError as err:
        rec["ni_optimizer"] = str(err)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rec: dict = {}
    try:
        fleet.worker_num()
        rec["before_init"] = "no error"
    except FleetError as err:
        rec["before_init"] = str(err)

    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    rec.update(
        rank=rank,
        world=world,
        is_first_worker=fleet.is_first_worker(),
        local_rank=fleet.local_rank(),
        endpoints=fleet.worker_endpoints(),
        endpoints_str=fleet.worker_endpoints(to_string=True),
        shard=fleet.util.get_file_shard([f"part-{i}" for i in range(5)]),
        strategy=get_runtime("test").strategy.non_default_settings(),
    )
    check_data_parallel(rank, world, rec)
    check_not_implemented(rec)
    check_gradient_merge(rank, world, rec)
    fleet.barrier_worker()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    print(f"FLEET_DP_OK rank={rank} world={world}", flush=True)


if __name__ == "__main__":
    main()
