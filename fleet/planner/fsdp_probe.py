"""FSDP2's overhead beyond its collectives' bytes, measured inside the calibration job.

Sharding stage 3 wraps every unit of the model with ``fully_shard``: each forward and backward
of a unit all-gathers its parameters, each backward reduce-scatters its gradients, and the
optimizer steps over DTensor parameters. Besides the bytes (which the alpha-beta fits of
:mod:`fleet.planner.links` cost), every unit pays its hooks, the copies in and out of the flat
buffers and the collectives' latency; every parameter pays DTensor's dispatch in the optimizer;
and on a CPU node with more ranks than cores every unit's collective makes each rank of the
mesh wait for the slowest one, which time-slicing makes late. These figures do not scale with
the parameters' size, so a model of tiny parameters measures them: :data:`UNITS` units of
``Linear + LayerNorm`` at width :data:`WIDTH`, run plain and under ``fully_shard`` with every
rank of the job at once (as the job runs), the difference divided by the units (forward,
backward) and by the parameter tensors (optimizer step).

Mesh shapes: every ``(dp, sharding)`` with ``sharding > 1`` whose product divides the world,
each over consecutive blocks of ``dp * sharding`` ranks (all blocks at once), ``dp > 1`` as
HSDP's 2-D mesh, as :func:`fleet.parallelize.compose.sharding_mesh` builds it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from fleet.planner.spec import make_optimizer
from fleet.planner.types import FsdpOverhead, fsdp_key

UNITS = 6
"""Units of the probe model."""
WIDTH = 32
"""Width of the probe's layers (tiny: the figures must not depend on bytes)."""
STEPS = 2
"""Timed steps per variant (their median counts), after one untimed step."""


def mesh_shapes(world: int) -> list[tuple[int, int]]:
    """Every ``(dp, sharding)`` with ``sharding > 1`` and ``dp * sharding`` dividing ``world``."""
    return [
        (dp, sh)
        for sh in range(2, world + 1)
        for dp in range(1, world // sh + 1)
        if world % (dp * sh) == 0
    ]


def _probe_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(UNITS)]
    )


def _mesh(dp: int, sh: int, device_type: str) -> Any:
    """This rank's mesh of the shape (every rank takes part in making every group)."""
    from torch.distributed.device_mesh import DeviceMesh

    world, rank = tdist.get_world_size(), tdist.get_rank()
    block = dp * sh
    shard_group = data_group = None
    for start in range(0, world, block):
        for d in range(dp):
            ranks = list(range(start + d * sh, start + (d + 1) * sh))
            g = tdist.new_group(ranks)
            if rank in ranks:
                shard_group = g
        if dp > 1:
            for s in range(sh):
                ranks = list(range(start + s, start + block, sh))
                g = tdist.new_group(ranks)
                if rank in ranks:
                    data_group = g
    if dp == 1:
        return DeviceMesh.from_group(shard_group, device_type, mesh_dim_names=("sharding",))
    start = rank - rank % block
    layout = torch.arange(start, start + block).view(dp, sh)
    return DeviceMesh.from_group(
        [data_group, shard_group], device_type, mesh=layout, mesh_dim_names=("dp", "sharding")
    )


def _time_steps(model: nn.Module, optimizer: str, device: torch.device) -> dict[str, float]:
    opt = make_optimizer(optimizer, model.parameters(), 1e-3)
    x = torch.randn(4, WIDTH, device=device)
    times: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for i in range(STEPS + 1):
        tdist.barrier()
        a = time.perf_counter()
        loss = model(x).sum()
        b = time.perf_counter()
        loss.backward()
        c = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        d = time.perf_counter()
        if i:
            times["forward"].append(b - a)
            times["backward"].append(c - b)
            times["step"].append(d - c)
    return {k: statistics.median(v) for k, v in times.items()}


def _slowest(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t.item())


def measure_fsdp_overhead(optimizer: str, device: torch.device) -> dict[str, FsdpOverhead]:
    """:func:`fsdp_key` -> overhead for every mesh shape of the world (collective: every rank
    calls it; every rank returns the same figures, the slowest rank's)."""
    from torch.distributed.fsdp import fully_shard

    world = tdist.get_world_size()
    params = sum(1 for _ in _probe_model().parameters())
    plain = _time_steps(_probe_model().to(device), optimizer, device)
    out: dict[str, FsdpOverhead] = {}
    for dp, sh in mesh_shapes(world):
        mesh = _mesh(dp, sh, device.type)
        model = _probe_model().to(device)
        for unit in model:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = _time_steps(model, optimizer, device)
        extra = {k: _slowest(max(0.0, sharded[k] - plain[k]), device) for k in sharded}
        out[fsdp_key(dp, sh)] = FsdpOverhead(
            unit_forward_s=extra["forward"] / UNITS,
            unit_backward_s=extra["backward"] / UNITS,
            param_step_s=extra["step"] / params,
        )
        del model
    return out


__all__ = ["STEPS", "UNITS", "WIDTH", "measure_fsdp_overhead", "mesh_shapes"]
