"""Worker of the data-parallel step-time benchmark: fleet's DP against plain torch DDP.

``--impl fleet``: ``fleet.init`` + ``fleet.distributed_model`` + ``fleet.distributed_optimizer``
(launch under fleetrun). ``--impl ddp``: the plain torchrun way, ``init_process_group("gloo")``
(``nccl`` on GPUs) from the environment and ``DistributedDataParallel`` (launch under torchrun).
Same model (an MLP of ~4.2 M parameters by default), same data, same optimizer. After
``--warmup`` steps each of ``--steps`` steps is timed (forward + backward + optimizer step, the
slowest rank's time, agreed by an all-reduce MAX); rank 0 prints one JSON line::

    {"impl": "fleet", "step_time_s_median": 0.0123, "step_time_s_min": ..., "step_time_s_max": ...,
     "steps": 30, "world_size": 2, "params": 4208650, "device": "cpu", "threads": 1}

fleetrun and torchrun both give workers ``OMP_NUM_THREADS=1`` when they start more than one;
``--threads N`` pins the intra-op threads explicitly, and ``threads`` in the output says what ran.

``--comm`` picks the gradient communication (``bench/bench_dp_comm.py``): ``fp16`` / ``bf16``
(fleet: ``strategy.fp16_allreduce``; ddp: torch's ``fp16_compress_hook`` / ``bf16_compress_hook``),
``localsgd`` (k_steps 4 after the warm-up; ddp: torch's ``post_localSGD_hook`` +
``PostLocalSGDOptimizer``), ``dgc`` (sparsity 0.999 after the warm-up; ddp: plain DDP, torch has no
DGC). ``--count_steps N`` runs N more steps under ``fleet.meta_optimizers.comm_hooks.CommCounter``
(untimed: the counter sees every op) and adds ``allreduce_per_step`` and ``bytes_per_step``
(bytes handed to collectives, median over those steps) to the JSON line. The DDP peer uses the
buckets fleet uses by default (``bucket_cap_mb_list=[1, 32]``: ``last_comm_group_size_MB``, then
``fuse_grad_size_in_MB``).

Usage: ``fleetrun --nproc_per_node 2 bench/dp_step_worker.py --impl fleet`` and
``torchrun --nproc_per_node 2 bench/dp_step_worker.py --impl ddp``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as tdist


def make_model(width: int, depth: int, in_features: int, classes: int) -> torch.nn.Module:
    """``depth`` hidden Linear+ReLU layers of ``width`` (identical weights on every rank)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(in_features, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


Setup = tuple[torch.nn.Module, torch.optim.Optimizer, int, int]
"""(wrapped model, optimizer, rank, world size)"""


def fleet_strategy(comm: str, warmup: int) -> Any:
    """The strategy of ``--comm`` (communication starts its special mode after ``warmup``)."""
    import fleet

    settings: dict[str, Any] = {
        "none": {},
        "fp16": {"fp16_allreduce": True},
        "bf16": {"fp16_allreduce": True, "fp16_allreduce_configs": {"dtype": "bfloat16"}},
        "localsgd": {"localsgd": True, "localsgd_configs": {"k_steps": 4, "begin_step": warmup}},
        "dgc": {"dgc": True, "dgc_configs": {"rampup_begin_step": warmup, "sparsity": [0.999]}},
    }[comm]
    return fleet.DistributedStrategy.from_dict(settings)


def setup_fleet(model: torch.nn.Module, lr: float, comm: str = "none", warmup: int = 0) -> Setup:
    """fleet's way: init from the env contract, DDP and optimizer wrapper from the strategy."""
    import fleet

    fleet.init(is_collective=True, strategy=fleet_strategy(comm, warmup))
    model = model.to(_device(fleet.local_rank()))
    dp = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(torch.optim.SGD(dp.parameters(), lr=lr, momentum=0.9))
    return dp, opt, fleet.worker_index(), fleet.worker_num()


def _bf16_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    # torch's hook under another name: DDP refuses bf16_compress_hook by name without NCCL.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(process_group, bucket)


def setup_ddp(model: torch.nn.Module, lr: float, comm: str = "none", warmup: int = 0) -> Setup:
    """The torchrun way: env:// rendezvous, DDP with the buckets fleet uses (1 MiB, then 32 MiB)
    and torch's own hook / optimizer for ``comm``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    tdist.init_process_group(backend)
    device = _device(local_rank)
    model = model.to(device)
    dp = torch.nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb_list=[1, 32],
    )
    opt: Any = torch.optim.SGD(dp.parameters(), lr=lr, momentum=0.9)
    if comm == "fp16":
        dp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif comm == "bf16":
        dp.register_comm_hook(None, _bf16_hook)
    elif comm == "localsgd":
        state = post_localSGD_hook.PostLocalSGDState(
            None, None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False
        )
        dp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        opt = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=4, warmup_steps=warmup))
    return dp, opt, tdist.get_rank(), tdist.get_world_size()


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    return torch.device("cpu")


def main() -> None:
    """Time the steps and print the JSON line on rank 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=["fleet", "ddp"], required=True)
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--batch_size", type=int, default=64, help="samples per rank per step")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--in_features", type=int, default=1024)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: as given)")
    p.add_argument("--comm", choices=["none", "fp16", "bf16", "localsgd", "dgc"], default="none")
    p.add_argument(
        "--count_steps",
        type=int,
        default=0,
        help="untimed steps after the timed ones, collectives counted",
    )
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    model = make_model(args.width, args.depth, args.in_features, args.classes)
    setup = setup_fleet if args.impl == "fleet" else setup_ddp
    dp, opt, rank, world = setup(model, lr=0.01, comm=args.comm, warmup=args.warmup)
    device = next(dp.parameters()).device
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch_size, args.in_features, generator=g).to(device)
    y = torch.randint(0, args.classes, (args.batch_size,), generator=g).to(device)

    def one_step() -> float:
        loss = torch.nn.functional.cross_entropy(dp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    times = []
    for i in range(args.warmup + args.steps):
        tdist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        one_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        if i >= args.warmup:
            times.append(float(elapsed))
    counted: dict[str, Any] = {}
    if args.count_steps:
        from fleet.meta_optimizers.comm_hooks import CommCounter

        calls, nbytes = [], []
        for _ in range(args.count_steps):
            with CommCounter() as counter:
                one_step()
            calls.append(counter.calls["allreduce"])
            nbytes.append(counter.total_bytes)
        counted = {
            "allreduce_per_step": sum(calls) / len(calls),
            "bytes_per_step": statistics.median(nbytes),
            "allreduce_calls": calls,
        }

    if rank == 0:
        print(
            json.dumps(
                {
                    "impl": args.impl,
                    "step_time_s_median": statistics.median(times),
                    "step_time_s_min": min(times),
                    "step_time_s_max": max(times),
                    "steps": len(times),
                    "world_size": world,
                    "params": sum(p.numel() for p in dp.parameters()),
                    "device": str(device.type),
                    "threads": torch.get_num_threads(),
                    "comm": args.comm,
                    **counted,
                }
            ),
            flush=True,
        )
    dp = opt = None  # DDP goes before its group (after CommCounter steps a rank hung at exit)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
