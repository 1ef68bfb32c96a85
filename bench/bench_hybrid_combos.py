"""The hybrid combinations (stage 3 x TP, AMP O2 x stage 2, stage 3 x PP): step time against the
nearest torch-native composition and memory per rank, theory and measurement side by side.
World 4 on CPU/gloo (fleetrun), small models; both sides run in the same job, in alternating
blocks of timed steps.

1. sharding stage 3 x tensor parallel (sharding 2 x mp 2): fleet (FSDP2 over fleet's TP layers)
   against torch-native FSDP2 + DTensor TP (``parallelize_module`` with Colwise/RowwiseParallel
   on a 2-D ``(dp, tp)`` mesh, ``fully_shard`` over ``dp``: torchtitan's composition). Goal:
   ours at >= 0.95x torch's speed (time ratio <= 1.05). Memory: parameter and Adam-state bytes
   per rank.
2. AMP O2 (bfloat16) x sharding stage 2 at the same layout: float32 master-weight bytes per rank
   (theory: this rank's TP shard / sharding degree); step time against float32 stage 2 (no torch
   peer: torch has no O2 + ZeRO-2 optimizer to compare with).
3. sharding stage 3 x pipeline (pp 2 x sharding 2): step time against fleet's stage 1 under the
   same pipeline (no torch-native peer here: torch.distributed.pipelining has no
   PipelineLayer / tied-weight equivalent, see fleet/meta_parallel/pipeline_parallel.py), and
   parameter / Adam-state bytes per rank.

Usage: ``python bench/bench_hybrid_combos.py [--reps 7] [--steps 10] [--width 256] [--json P]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Stats, fleetrun_cmd, report, run_checked

NPROC = 4
BLOCKS = 2


# ---- worker (one process of the 4-rank job) ----------------------------------------------------


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _timed(step: Any, steps: int) -> float:
    """Median seconds of ``steps`` calls of ``step`` (after a barrier)."""
    import torch.distributed as tdist

    tdist.barrier()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _alternate(steps_of: dict[str, Any], reps: int, steps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in steps_of}
    names = list(steps_of)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            out[name].append(_timed(steps_of[name], steps))
    return out


def worker_tp(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import fleet
    from fleet.meta_optimizers.amp import MasterWeightOptimizer
    from fleet.meta_optimizers.sharding import optimizer_state_bytes
    from fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

    w, h, batch = args.width, 4 * args.width, args.batch

    def strategy(stage: int, o2: bool = False) -> Any:
        s = fleet.DistributedStrategy()
        s.hybrid_configs = {"mp_degree": 2, "sharding_degree": 2}
        s.sharding_configs = {"stage": stage}
        if o2:
            s.amp, s.amp_configs = True, {"dtype": "bfloat16", "use_pure_fp16": True}
        return s

    def fleet_model() -> Any:
        layers: list[nn.Module] = []
        for _ in range(BLOCKS):
            layers += [
                ColumnParallelLinear(w, h, gather_output=False),
                nn.Tanh(),
                RowParallelLinear(h, w, input_is_parallel=True),
                nn.Tanh(),
            ]
        return nn.Sequential(*layers)

    fleet.init(is_collective=True, strategy=strategy(3))
    torch.manual_seed(0)
    ours = fleet.distributed_model(fleet_model())
    ours_opt = fleet.distributed_optimizer(torch.optim.Adam(ours.parameters(), lr=1e-4))
    rank = fleet.worker_index()
    g = torch.Generator().manual_seed(rank // 2)  # the two mp ranks of a replica: same data
    x, y = torch.randn(batch, w, generator=g), torch.randn(batch, w, generator=g)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    native = nn.Sequential(
        *[
            m
            for _ in range(BLOCKS)
            for m in (nn.Linear(w, h), nn.Tanh(), nn.Linear(h, w), nn.Tanh())
        ]
    )
    plan = {}
    for b in range(BLOCKS):
        plan[str(4 * b)], plan[str(4 * b + 2)] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(native, mesh["tp"], plan)
    for m in native:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh["dp"])
    fully_shard(native, mesh=mesh["dp"])
    native_opt = torch.optim.Adam(native.parameters(), lr=1e-4)

    def step_of(model: Any, opt: Any) -> Any:
        def step() -> None:
            nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()

        return step

    for s in (step_of(ours, ours_opt), step_of(native, native_opt)):
        s()  # warm-up (lazy init, Adam state)
    times = _alternate(
        {
            "fleet_s3_tp": step_of(ours, ours_opt),
            "torch_fsdp2_dtensor_tp": step_of(native, native_opt),
        },
        args.reps,
        args.steps,
    )
    split = BLOCKS * (h * w + h + w * h) * 4  # TP-split tensors (weights, column biases)
    replicated = BLOCKS * w * 4  # row biases: replicated over mp
    theory_params = split // 4 + replicated // 2
    mem = {
        "theory_param_bytes": theory_params,
        "theory_adam_bytes": 2 * theory_params,
        "fleet_param_bytes": _local_bytes(ours.parameters()),
        "fleet_adam_bytes": optimizer_state_bytes(ours_opt),
        "torch_param_bytes": _local_bytes(native.parameters()),
        "torch_adam_bytes": optimizer_state_bytes(native_opt),
        "dense_param_bytes": split + 2 * replicated,
    }
    # 2. AMP O2 x stage 2 (and float32 stage 2 to time against)
    steps_o2: dict[str, Any] = {}
    for name, o2 in (("fleet_o2_s2", True), ("fleet_fp32_s2", False)):
        fleet.init(is_collective=True, strategy=strategy(2, o2))
        torch.manual_seed(0)
        model = fleet.distributed_model(fleet_model())
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
        step = step_of(model, opt)
        step()
        steps_o2[name] = step
        if o2:
            mw: Any = opt
            while not isinstance(mw, MasterWeightOptimizer):
                mw = mw.__dict__["_inner"]
            mem["o2_master_bytes"] = sum(m.numel() * 4 for m in mw._masters.values())
            mem["o2_param_bytes"] = _local_bytes(model.parameters())
            mem["o2_theory_master_bytes"] = (split // 2 + replicated) // 2
    times.update(_alternate(steps_o2, args.reps, args.steps))
    return {"times": times, "mem": mem}


def worker_pp(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn

    import fleet
    from fleet.meta_optimizers.sharding import optimizer_state_bytes
    from fleet.meta_parallel.pipeline_layer import LayerDesc, PipelineLayer

    w, h = args.width, 4 * args.width
    micro, acc = args.batch // 4, 4
    descs = []
    for _ in range(2 * BLOCKS):
        descs += [
            LayerDesc(nn.Linear, w, h),
            LayerDesc(nn.Tanh),
            LayerDesc(nn.Linear, h, w),
            LayerDesc(nn.Tanh),
        ]
    steps: dict[str, Any] = {}
    mem: dict[str, Any] = {}
    for stage in (3, 1):
        s = fleet.DistributedStrategy()
        s.hybrid_configs = {"pp_degree": 2, "sharding_degree": 2}
        s.sharding_configs = {"stage": stage}
        s.pipeline_configs = {"micro_batch_size": micro, "accumulate_steps": acc}
        fleet.init(is_collective=True, strategy=s)
        hcg = fleet.get_hybrid_communicate_group()
        torch.manual_seed(0)
        pipe = PipelineLayer(descs, topology=hcg.topology(), loss_fn=nn.MSELoss())
        stage_bytes = sum(p.numel() * 4 for p in pipe.parameters())
        model = fleet.distributed_model(pipe)
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
        g = torch.Generator().manual_seed(hcg.get_sharding_parallel_rank())
        x, y = torch.randn(micro * acc, w, generator=g), torch.randn(micro * acc, w, generator=g)

        def step(model: Any = model, opt: Any = opt, x: Any = x, y: Any = y) -> None:
            model.train_batch([x, y], opt)

        step()
        steps[f"fleet_s{stage}_pp"] = step
        mem[f"s{stage}_param_bytes"] = _local_bytes(pipe.parameters())
        mem[f"s{stage}_adam_bytes"] = optimizer_state_bytes(opt)
        mem["stage_param_bytes"] = stage_bytes
    mem["s3_theory_param_bytes"] = mem["stage_param_bytes"] // 2
    mem["s3_theory_adam_bytes"] = mem["stage_param_bytes"]
    mem["s1_theory_param_bytes"] = mem["stage_param_bytes"]
    mem["s1_theory_adam_bytes"] = mem["stage_param_bytes"]  # 2 x params / 2 owners
    return {"times": _alternate(steps, args.reps, args.steps), "mem": mem}


def worker_main(args: argparse.Namespace) -> None:
    import torch.distributed as tdist

    import fleet

    rec = worker_tp(args) if args.worker == "tp" else worker_pp(args)
    rank = fleet.worker_index()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.worker}_rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    tdist.barrier()
    tdist.destroy_process_group()


# ---- driver ------------------------------------------------------------------------------------


def run_job(kind: str, args: argparse.Namespace, out: str) -> list[dict[str, Any]]:
    cmd = fleetrun_cmd(
        "--nproc_per_node",
        str(NPROC),
        "--log_dir",
        os.path.join(out, kind),
        os.path.abspath(__file__),
        "--worker",
        kind,
        "--out",
        out,
        "--reps",
        str(args.reps),
        "--steps",
        str(args.steps),
        "--width",
        str(args.width),
        "--batch",
        str(args.batch),
    )
    run_checked(cmd, timeout=1200)
    recs = []
    for r in range(NPROC):
        with open(os.path.join(out, f"{kind}_rank{r}.json"), encoding="utf-8") as f:
            recs.append(json.load(f))
    return recs


def slowest(recs: list[dict[str, Any]], name: str) -> list[float]:
    """Per block, the slowest rank's median step time (a step ends when every rank's does)."""
    return [max(r["times"][name][i] for r in recs) for i in range(len(recs[0]["times"][name]))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=7, help="alternating timed blocks per side")
    ap.add_argument("--steps", type=int, default=10, help="steps per block (its median kept)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="samples per data replica")
    ap.add_argument("--json")
    ap.add_argument("--worker", choices=["tp", "pp"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    with tempfile.TemporaryDirectory() as out:
        tp, pp = run_job("tp", args, out), run_job("pp", args, out)
    rows = [
        (
            "1. sharding stage 3 x TP (sharding 2 x mp 2): fleet vs torch FSDP2 + DTensor TP",
            Stats.of(slowest(tp, "fleet_s3_tp")),
            Stats.of(slowest(tp, "torch_fsdp2_dtensor_tp")),
            "fleet/torch time",
        ),
        (
            "2. AMP O2 bf16 x sharding stage 2 (sharding 2 x mp 2): vs float32 stage 2 (fleet)",
            Stats.of(slowest(tp, "fleet_o2_s2")),
            Stats.of(slowest(tp, "fleet_fp32_s2")),
            "O2/fp32 time",
        ),
        (
            "3. sharding stage 3 x pipeline (pp 2 x sharding 2): vs stage 1 (fleet)",
            Stats.of(slowest(pp, "fleet_s3_pp")),
            Stats.of(slowest(pp, "fleet_s1_pp")),
            "stage3/stage1 time",
        ),
    ]
    paired = [
        a / b for a, b in zip(slowest(tp, "fleet_s3_tp"), slowest(tp, "torch_fsdp2_dtensor_tp"))
    ]
    extra = {
        "tp_mem_rank0": tp[0]["mem"],
        "pp_mem": [r["mem"] for r in pp],
        "s3_tp_paired_ratio": Stats.of(paired).__dict__,
        "uptime": os.getloadavg(),
    }
    report(
        f"Hybrid combinations, world {NPROC}, width {args.width}, CPU/gloo",
        rows,
        goal="row 1 <= 1.05 (>= 0.95x speed); rows 2-3 informational",
        extra=extra,
        json_path=args.json,
    )
    m = tp[0]["mem"]
    print(f"row 1 paired ratio per block: {Stats.of(paired).fmt('x')}")
    print("memory per rank, bytes (theory | fleet | torch):")
    print(
        f"  stage 3 x TP params     {m['theory_param_bytes']} | {m['fleet_param_bytes']} | "
        f"{m['torch_param_bytes']}   (dense model {m['dense_param_bytes']})"
    )
    print(
        f"  stage 3 x TP Adam state {m['theory_adam_bytes']} | {m['fleet_adam_bytes']} | "
        f"{m['torch_adam_bytes']}"
    )
    print(
        f"  O2 x stage 2 fp32 masters {m['o2_theory_master_bytes']} | {m['o2_master_bytes']} "
        f"(bf16 params held: {m['o2_param_bytes']})"
    )
    for rank, r in enumerate(pp):
        pm = r["mem"]
        print(
            f"  pp rank {rank}: stage params {pm['stage_param_bytes']}; stage 3 params "
            f"{pm['s3_theory_param_bytes']} | {pm['s3_param_bytes']}, Adam "
            f"{pm['s3_theory_adam_bytes']} | {pm['s3_adam_bytes']}; stage 1 params "
            f"{pm['s1_theory_param_bytes']} | {pm['s1_param_bytes']}, Adam "
            f"{pm['s1_theory_adam_bytes']} | {pm['s1_adam_bytes']}"
        )


if __name__ == "__main__":
    main()
