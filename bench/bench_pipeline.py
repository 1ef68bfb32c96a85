"""Pipeline parallel: our 1F1B (fleet.meta_parallel.PipelineParallel) vs torch.distributed.pipelining
Schedule1F1B on the same 2-stage model (CPU, gloo, 1 thread per rank), in one run.

Printed:
* step time, median [min .. max] of ``--reps`` repetitions (each the median of ``--steps``
  steps, slowest stage), for both engines; ratio torch/ours (speed, goal >= 0.95). Both engines
  are built once and run alternately step by step (order flipped every step, a barrier before
  each), so load from other jobs hits both alike; the per-step ratios (median, quartiles) are
  printed too;
* the measured bubble ``1 - compute/step`` of our stages (compute = forward + backward time
  inside the stage, mean over stages) at m = 4 and 8 micro-batches vs. ``(p-1)/(m+p-1)``;
* peak saved-activation bytes (``SavedActivationMeter``) at 4 vs 16 micro-batches of the same
  size, 1F1B and FThenB (goal for 1F1B: ratio <= 1.1);
* the cost of the once-per-step shape message (64 int64) as a gloo round trip;
* the load average before and after (the machine is shared: judge the ratio, which both engines
  see under the same load, rep by rep in alternating order).

Usage: ``python bench/bench_pipeline.py [--reps 5] [--steps 8] [--hidden 512] [--json PATH]``
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import Stats, machine_info, report

LAYERS, MBS = 8, 16


def _descs(hidden: int) -> list[Any]:
    from torch import nn

    from fleet.meta_parallel import LayerDesc

    out: list[Any] = []
    for _ in range(LAYERS):
        out += [LayerDesc(nn.Linear, hidden, hidden), LayerDesc(nn.GELU)]
    return out


def _hcg(strategy: Any) -> Any:
    import torch.distributed as tdist

    from fleet.base.topology import HybridCommunicateGroup, build_topology

    return HybridCommunicateGroup(build_topology(strategy.hybrid_configs, tdist.get_world_size()))


def _strategy(m: int, schedule: str = "1F1B") -> Any:
    import fleet

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"pp_degree": 2}
    s.pipeline_configs = {"micro_batch_size": MBS, "accumulate_steps": m, "schedule_mode": schedule}
    return s


def _bubbles(hcg: Any, hidden: int, m: int, steps: int) -> list[float]:
    """``1 - compute / step`` of our engine's stage over ``steps`` steps at ``m`` micro-batches."""
    step = _make_ours(hcg, hidden, m)
    model = step.model
    step()  # warm-up
    bubbles = []
    for _ in range(steps):
        step()
        st = model.last_step_stats
        bubbles.append(1 - st["compute_s"] / st["step_s"])
    return bubbles


def _make_ours(hcg: Any, hidden: int, m: int) -> Any:
    """One train_batch of our engine as a callable."""
    import torch
    from torch import nn

    from fleet.meta_parallel import PipelineLayer, PipelineParallel

    torch.manual_seed(0)
    pipe = PipelineLayer(_descs(hidden), topology=hcg.topology(), loss_fn=nn.MSELoss())
    model = PipelineParallel(pipe, hcg, _strategy(m))
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    x, y = torch.randn(MBS * m, hidden), torch.randn(MBS * m, hidden)

    def step() -> None:
        model.train_batch([x, y], opt)

    step.model = model  # type: ignore[attr-defined]
    return step


def _make_torch(rank: int, hidden: int, m: int) -> Any:
    """One Schedule1F1B step (+ optimizer step and zero_grad, as train_batch does) as a callable."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    mods = []
    for _ in range(LAYERS):
        mods += [nn.Linear(hidden, hidden), nn.GELU()]
    half = len(mods) // 2
    sub = nn.Sequential(*(mods[:half] if rank == 0 else mods[half:]))
    stage = PipelineStage(sub, rank, 2, torch.device("cpu"))  # shapes inferred at first step
    sched = Schedule1F1B(stage, m, loss_fn=nn.MSELoss())
    opt = torch.optim.SGD(sub.parameters(), lr=1e-3)
    x, y = torch.randn(MBS * m, hidden), torch.randn(MBS * m, hidden)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()

    return step


def _interleaved(rank: int, hcg: Any, hidden: int, reps: int, steps: int) -> dict[str, Any]:
    """Both engines built once, then ``reps`` x ``steps`` steps alternating ours / torch step by
    step (order flipped every step, a barrier before each): load that comes and goes hits both
    alike. Per step the slowest stage counts; per rep the median step."""
    import torch.distributed as tdist

    fns = {"ours": _make_ours(hcg, hidden, 8), "torch": _make_torch(rank, hidden, 8)}
    for fn in fns.values():  # warm-up (torch infers shapes at its first step)
        fn()
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for i in range(reps * steps):
        for impl in ("ours", "torch") if i % 2 == 0 else ("torch", "ours"):
            tdist.barrier()
            t0 = time.perf_counter()
            fns[impl]()
            times[impl].append(time.perf_counter() - t0)
    gathered: list[Any] = [None, None]
    tdist.all_gather_object(gathered, times)
    out: dict[str, Any] = {"ours": [], "torch": [], "paired": []}
    for impl in ("ours", "torch"):
        slow = [max(a, b) for a, b in zip(gathered[0][impl], gathered[1][impl])]
        out[impl] = [statistics.median(slow[r * steps : (r + 1) * steps]) for r in range(reps)]
        out[f"{impl}_steps"] = slow
    out["paired"] = [t / o for t, o in zip(out["torch_steps"], out["ours_steps"])]
    return out


def _memory(hcg: Any, hidden: int, schedule: str, m: int) -> int:
    import torch
    from torch import nn

    from fleet.meta_parallel import PipelineLayer, PipelineParallel
    from fleet.meta_parallel.pp_memory import SavedActivationMeter

    pipe = PipelineLayer(_descs(hidden), topology=hcg.topology(), loss_fn=nn.MSELoss())
    model = PipelineParallel(pipe, hcg, _strategy(m, schedule))
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    x, y = torch.randn(MBS * m, hidden), torch.randn(MBS * m, hidden)
    with SavedActivationMeter(pipe.parameters()) as meter:
        model.train_batch([x, y], opt)
    return meter.peak_bytes


def _meta_round_trip(rank: int, n: int = 50) -> float:
    import torch
    import torch.distributed as tdist

    buf = torch.zeros(64, dtype=torch.int64)
    tdist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            tdist.send(buf, 1)
            tdist.recv(buf, 1)
        else:
            tdist.recv(buf, 0)
            tdist.send(buf, 0)
    return (time.perf_counter() - t0) / n


def worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    hcg = _hcg(_strategy(1))

    res: dict[str, Any] = {"bubble": {}, "memory": {}}
    res.update(_interleaved(rank, hcg, args.hidden, args.reps, args.steps))
    for m in (4, 8):
        bubbles = _bubbles(hcg, args.hidden, m, args.steps)
        gathered: list[Any] = [None, None]
        tdist.all_gather_object(gathered, statistics.median(bubbles))
        res["bubble"][m] = {"measured": sum(gathered) / 2, "theory": 1 / (m + 1)}
    for schedule in ("1F1B", "FThenB"):
        for m in (4, 16):
            gathered = [None, None]
            tdist.all_gather_object(gathered, _memory(hcg, args.hidden, schedule, m))
            res["memory"][f"{schedule}/{m}"] = gathered
    res["meta_rtt_s"] = _meta_round_trip(rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    tdist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.multiprocessing as tmp_mp

    from collective.env import find_free_port

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        tmp_mp.spawn(worker, args=(find_free_port(), args, out), nprocs=2, join=True)
        with open(out) as f:
            res = json.load(f)
    ours, peer = Stats.of(res["ours"]), Stats.of(res["torch"])
    extra = {
        "bubble": res["bubble"],
        "memory": res["memory"],
        "meta_rtt_s": res["meta_rtt_s"],
        "paired_speed": res["paired"],
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    report(
        f"Pipeline 1F1B step, 2 stages x {LAYERS // 2} Linear({args.hidden})+GELU, 8 micro-batches "
        f"of {MBS}, gloo CPU: fleet PipelineParallel vs torch.distributed.pipelining Schedule1F1B",
        [("median step time (slowest stage)", ours, peer, "ours/torch time")],
        goal="ours/torch time <= 1.05 (speed torch/ours >= 0.95)",
        extra=extra,
        json_path=args.json,
    )
    q = statistics.quantiles(res["paired"], n=4)
    print(
        f"  speed ratio torch/ours = {peer.median / ours.median:.3f} (of the medians); "
        f"step by step: median {statistics.median(res['paired']):.3f}, quartiles "
        f"{q[0]:.3f} .. {q[2]:.3f} over {len(res['paired'])} paired steps"
    )
    for m, b in res["bubble"].items():
        print(
            f"bubble at m={m}, p=2: measured {b['measured']:.3f} (incl. communication) "
            f"vs (p-1)/(m+p-1) = {b['theory']:.3f}"
        )
    mem = res["memory"]
    for schedule in ("1F1B", "FThenB"):
        r = [b / a for a, b in zip(mem[f"{schedule}/4"], mem[f"{schedule}/16"])]
        print(
            f"peak saved activations {schedule}: 4 mb {mem[f'{schedule}/4']} B, 16 mb "
            f"{mem[f'{schedule}/16']} B per stage; ratio 16/4 = "
            f"{', '.join(f'{x:.2f}' for x in r)}"
            + ("  (goal <= 1.1)" if schedule == "1F1B" else "")
        )
    print(
        f"shape message (64 x int64) round trip: {res['meta_rtt_s'] * 1e6:.0f} us, once per "
        f"step vs step {ours.median * 1e3:.1f} ms (an upper bound: its receive is posted when "
        "the step starts)"
    )
    load = ", ".join(f"{a:.1f}->{b:.1f}" for a, b in zip(load_before, os.getloadavg()))
    print(
        f"machine: {machine_info()['cpus']} CPUs shared with other jobs (numbers are noisy); "
        f"load average 1/5/15 min before->after: {load}"
    )


if __name__ == "__main__":
    main()
