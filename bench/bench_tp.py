"""Tensor-parallel MLP step time: fleet's ColumnParallelLinear/RowParallelLinear vs DTensor's
ColwiseParallel/RowwiseParallel (``torch.distributed.tensor.parallel.parallelize_module``) on
the same MLP, mp2 on gloo CPU; plus the activation memory recompute saves.

Both run in the same two worker processes, alternating which goes first in each repetition;
one repetition is the median forward+backward step time (slowest rank) over ``--steps`` steps.
The table shows median [min .. max] over repetitions and the ratio of throughputs
fleet/DTensor (= DTensor time / fleet time; goal >= 0.95). The recompute line runs a stack of
the TP MLP blocks with and without ``fleet.utils.recompute`` per block and reports the bytes
autograd saved for backward (``saved_tensors_hooks``) and the step-time cost.

Usage: ``python bench/bench_tp.py [--reps 7] [--steps 20] [--dim 512] [--batch 128] [--json P]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import Stats, bench_env, report

from collective.env import find_free_port

WORLD = 2


# ---- worker ------------------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear
    from fleet.meta_parallel.recompute import SavedTensorBytes, recompute

    torch.set_num_threads(1)
    tdist.init_process_group("gloo")
    rank, group = tdist.get_rank(), tdist.group.WORLD
    dim, ffn, batch = args.dim, 4 * args.dim, args.batch

    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(F.gelu(self.fc1(x)))

    class Ours(nn.Module):
        def __init__(self, dense: Dense) -> None:
            super().__init__()
            self.fc1 = ColumnParallelLinear.from_dense(
                dense.fc1, gather_output=False, mp_group=group
            )
            self.fc2 = RowParallelLinear.from_dense(
                dense.fc2, input_is_parallel=True, mp_group=group
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(F.gelu(self.fc1(x)))

    torch.manual_seed(0)
    dense = Dense()
    ours = Ours(dense)
    mesh = init_device_mesh("cpu", (WORLD,))
    theirs = Dense()
    theirs.load_state_dict(dense.state_dict())
    theirs = parallelize_module(theirs, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1))

    # same function: outputs agree before anything is timed
    diff = float((ours(x) - theirs(x)).abs().max())
    if diff > 1e-4:
        raise SystemExit(f"fleet and DTensor MLPs disagree by {diff}")

    def step_time(model: nn.Module, fn=None) -> float:
        times = []
        for _ in range(args.steps):
            tdist.barrier()
            t0 = time.perf_counter()
            out = fn(model, x) if fn else model(x)
            out.sum().backward()
            t = torch.tensor([time.perf_counter() - t0])
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)  # the slowest rank
            times.append(float(t))
        model.zero_grad(set_to_none=True)
        return statistics.median(times)

    for m in (ours, theirs):  # warm-up
        step_time(m)
    res: dict[str, list[float]] = {"fleet": [], "dtensor": []}
    for rep in range(args.reps):
        order = ("fleet", "dtensor") if rep % 2 == 0 else ("dtensor", "fleet")
        for impl in order:
            res[impl].append(step_time(ours if impl == "fleet" else theirs))

    # recompute: a stack of TP blocks, saved bytes and step time with/without recompute
    torch.manual_seed(0)
    stack = nn.ModuleList(Ours(Dense()) for _ in range(args.depth))

    def run_stack(m: nn.Module, inp: torch.Tensor, use_recompute: bool) -> torch.Tensor:
        h = inp.requires_grad_()
        for block in m:
            h = h + (recompute(block, h) if use_recompute else block(h))
        return h

    mem, rc_times = {}, {"plain": [], "recompute": []}
    for flag, key in ((False, "plain"), (True, "recompute")):
        with SavedTensorBytes() as saved:
            out = run_stack(stack, x.clone(), flag)
        out.sum().backward()
        mem[key] = saved.bytes
    for _ in range(args.reps):
        for flag, key in ((False, "plain"), (True, "recompute")):
            rc_times[key].append(
                step_time(stack, lambda m, inp, f=flag: run_stack(m, inp.clone(), f))
            )
    if rank == 0:
        print(
            json.dumps(
                {
                    "tp": res,
                    "recompute_bytes": mem,
                    "recompute_times": rc_times,
                    "parity_diff": diff,
                }
            )
        )
    tdist.destroy_process_group()


# ---- driver ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4, help="TP blocks in the recompute stack")
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    port = str(find_free_port())
    passthrough = [
        "--reps",
        str(args.reps),
        "--steps",
        str(args.steps),
        "--dim",
        str(args.dim),
        "--batch",
        str(args.batch),
        "--depth",
        str(args.depth),
        "--worker",
    ]
    procs = []
    for rank in range(WORLD):
        env = bench_env()
        env.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_RANK": str(rank),
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *passthrough],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=1200)
            if p.returncode != 0:
                raise RuntimeError(f"worker failed ({p.returncode}):\n{out}\n{err}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("{"))
    data = json.loads(line)
    fleet_t, dt_t = Stats.of(data["tp"]["fleet"]), Stats.of(data["tp"]["dtensor"])
    # throughput ratio fleet/DTensor = DTensor time / fleet time: report() divides ours by peer,
    # so pass the peer as "ours" in a second, explicit line below.
    report(
        f"TP MLP fwd+bwd step time, mp{WORLD} gloo CPU, dim {args.dim} -> {4 * args.dim} -> "
        f"{args.dim}, batch {args.batch}: fleet Column/RowParallelLinear vs DTensor "
        "Colwise/RowwiseParallel",
        [("median step time per repetition", fleet_t, dt_t, "fleet/DTensor time")],
        goal="time ratio <= 1/0.95 = 1.053 (speed >= 0.95)",
        json_path=args.json,
        extra={
            "recompute_bytes": data["recompute_bytes"],
            "recompute_times": data["recompute_times"],
        },
    )
    print(f"  speed ratio fleet/DTensor = {dt_t.median / fleet_t.median:.3f}   goal: >= 0.95")
    mem, rt = data["recompute_bytes"], data["recompute_times"]
    plain, rc = Stats.of(rt["plain"]), Stats.of(rt["recompute"])
    print(
        f"recompute, {args.depth} TP MLP blocks, batch {args.batch}: saved-tensor bytes "
        f"plain {mem['plain'] / 2**20:.2f} MiB, recompute {mem['recompute'] / 2**20:.2f} MiB "
        f"({mem['plain'] / max(mem['recompute'], 1):.1f}x less); step time plain {plain.fmt()}, "
        f"recompute {rc.fmt()} (x{rc.median / plain.median:.2f})"
    )


if __name__ == "__main__":
    main()
