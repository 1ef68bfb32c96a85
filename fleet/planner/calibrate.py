"""Calibration inside a running job: the model profiled at every tensor-parallel degree, the
collectives fitted per group shape, gathered into one :class:`~fleet.planner.types.Calibration`.

::

    fleetrun --nproc_per_node 4 -m fleet.planner.calibrate --spec spec.json --out cal.json

:func:`calibrate_in_job` runs on every rank at once. For every mp degree ``k`` dividing the world
(1 included) the world is split into consecutive groups of ``k`` and every rank profiles its
group's model at the same time (:func:`fleet.planner.profile.profile_model`), so the figures
include the contention of the job's ranks for the machine, as the real job has it. A degree the
model cannot be built at (heads not divisible by ``k``, say) is recorded with its error and
skipped. An entry's time is the slowest rank's, scaled so that the entries add up to the median
rank's whole forward + backward pass; the collectives are measured with every rank taking part
(:func:`fleet.planner.links.measure_links`), and FSDP2's overhead beyond those bytes on every
sharding mesh shape (:func:`fleet.planner.fsdp_probe.measure_fsdp_overhead`). On a CPU node
with more ranks than cores, group 0 also times its whole pass while the other ranks wait (``ModelProfile.idle_speedup``: what a
pipeline stage gains while its neighbours idle in the bubble). The optimizer step is timed on
every rank at once over ``1 / world`` of the model (the share one rank updates once the model is
split), the median rank's per-byte figure kept. Rank 0 assembles the calibration and broadcasts it,
so every rank returns the same object.

The micro-batch sizes profiled come from the global batch ``G``: each replica count ``r``
dividing the world (and ``G``) gives a local batch ``G / r``; every divisor of one is a possible
micro-batch size; the smallest, the largest and one in the middle are profiled, and each figure
is fitted as ``a + c * b`` over them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from collective.env import read_worker_env, usable_cpus
from collective.errors import ConfigError
from fleet.planner.cache import fingerprint, write_json_atomic
from fleet.planner.fsdp_probe import measure_fsdp_overhead
from fleet.planner.links import measure_links
from fleet.planner.profile import (
    MpProfile,
    build_stage,
    optimizer_step_s_per_byte,
    profile_model,
    time_alone,
)
from fleet.planner.spec import build_model
from fleet.planner.types import (
    Calibration,
    ClusterProfile,
    LayerProfile,
    Linear,
    ModelProfile,
    ModelSpec,
)
from fleet.strategy.configs import AmpConfig
from fleet.strategy.distributed_strategy import DistributedStrategy

logger = logging.getLogger(__name__)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batch_sizes(global_batch_size: int, world: int) -> list[int]:
    """The sizes to profile: smallest, middle and largest of the possible micro-batch sizes."""
    if global_batch_size < 1:
        raise ConfigError(
            f"the global batch size must be >= 1, got {global_batch_size}",
            key="--global_batch_size",
        )
    local = {global_batch_size // r for r in _divisors(world) if global_batch_size % r == 0}
    sizes = sorted({d for n in local for d in _divisors(n)})
    picked = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
    return picked


def amp_level(strategy: DistributedStrategy) -> str:
    """``O0`` without AMP, ``O2`` with pure low-precision parameters, else ``O1``."""
    if not strategy.amp:
        return "O0"
    return "O2" if strategy.amp_configs.use_pure_fp16 else "O1"


def _short(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return text[:300]


def _device(backend: str, local_rank: int) -> tuple[torch.device, str, int | None]:
    """(torch device, its name for the calibration, its memory in bytes or None on CPU)."""
    if backend == "nccl" and torch.cuda.is_available():
        index = local_rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        props = torch.cuda.get_device_properties(index)
        return torch.device("cuda", index), f"cuda:{props.name}", int(props.total_memory)
    return torch.device("cpu"), "cpu", None


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def _combine(profiles: dict[int, list[MpProfile]]) -> list[LayerProfile]:
    """One LayerProfile per entry: times the max over ranks, then scaled so that at each
    micro-batch size the entries add up to the median rank's whole pass (the max of every
    entry over the ranks sums to more than any one rank's pass); bytes the max over ranks;
    each figure fitted over the micro-batch sizes; parameter and output bytes from the lowest
    degree."""
    degrees = sorted(profiles)
    base = profiles[degrees[0]][0]
    fwd_at: dict[int, list[dict[int, float]]] = {}
    bwd_at: dict[int, list[dict[int, float]]] = {}
    for k in degrees:
        ranks = profiles[k]
        sizes = sorted(ranks[0].entries[0].fwd_s) if ranks[0].entries else []
        fwd_at[k] = [{} for _ in base.entries]
        bwd_at[k] = [{} for _ in base.entries]
        for b in sizes:
            for i in range(len(base.entries)):
                fwd_at[k][i][b] = max(p.entries[i].fwd_s[b] for p in ranks)
                bwd_at[k][i][b] = max(p.entries[i].bwd_s[b] for p in ranks)
            summed = sum(fwd_at[k][i][b] + bwd_at[k][i][b] for i in range(len(base.entries)))
            wholes = [p.whole_pass_s[b] for p in ranks if b in p.whole_pass_s]
            if wholes and summed > 0:
                scale = statistics.median(wholes) / summed
                for i in range(len(base.entries)):
                    fwd_at[k][i][b] *= scale
                    bwd_at[k][i][b] *= scale
    layers = []
    for i, entry in enumerate(base.entries):
        fwd, bwd, act = {}, {}, {}
        for k in degrees:
            per_rank = [p.entries[i] for p in profiles[k]]
            sizes = sorted(per_rank[0].fwd_s)
            fwd[k] = Linear.fit([(b, fwd_at[k][i][b]) for b in sizes])
            bwd[k] = Linear.fit([(b, bwd_at[k][i][b]) for b in sizes])
            act[k] = Linear.fit([(b, max(e.act_bytes[b] for e in per_rank)) for b in sizes])
        layers.append(
            LayerProfile(
                index=i,
                name=entry.name,
                param_bytes=entry.param_bytes,
                tp_param_bytes=entry.tp_param_bytes,
                shared_key=entry.shared_key,
                fwd_s=fwd,
                bwd_s=bwd,
                act_bytes=act,
                out_bytes=Linear.fit(sorted(entry.out_bytes.items())),
                param_count=entry.param_count,
            )
        )
    return layers


def calibrate_in_job(
    spec: ModelSpec,
    base_strategy: DistributedStrategy | dict[str, Any] | None = None,
    memory_per_device_bytes: int | None = None,
    link_sizes: tuple[int, ...] | None = None,
) -> Calibration:
    """Calibrate on every rank of the running job; every rank returns the same Calibration
    (see the module docstring). ``base_strategy``: the job's strategy (its AMP settings are
    profiled under); ``memory_per_device_bytes``: the CPU budget per rank (default: RAM /
    ranks per node; on CUDA the device's memory is used)."""
    start = time.perf_counter()
    if not tdist.is_initialized():
        raise ConfigError(
            "calibrate_in_job needs a running process group; call fleet.init(is_collective=True) "
            "first (or run python -m fleet.planner.calibrate under fleetrun)",
            key="process_group",
        )
    if isinstance(base_strategy, dict):
        base_strategy = DistributedStrategy.from_dict(base_strategy)
    strategy = base_strategy or DistributedStrategy()
    amp = amp_level(strategy)
    amp_config: AmpConfig = strategy.amp_configs
    env = read_worker_env()
    rank, world = tdist.get_rank(), tdist.get_world_size()
    # the env contract's shape (LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE / FLEET_NNODES) when it
    # describes this world; a process group made by hand counts as one node
    if env.launched and env.num_nodes * env.local_world_size == world:
        nproc, nnodes = env.local_world_size, env.num_nodes
    else:
        nproc, nnodes = world, 1
    backend = str(tdist.get_backend())
    device, device_name, device_memory = _device(backend, env.local_rank)
    sizes = micro_batch_sizes(spec.global_batch_size, world)

    crowded = device.type == "cpu" and nproc > usable_cpus()
    mp_degrees: dict[int, str] = {}
    idle_speedup: dict[int, float] = {}
    profiles: dict[int, list[MpProfile]] = {}
    link_groups: dict[tuple[int, bool], Any] = {}
    phases: dict[str, float] = {}
    for k in _divisors(world):
        group = None
        for s in range(0, world, k):
            g = tdist.new_group(list(range(s, s + k)))
            if s <= rank < s + k:
                group = g
        if k > 1 and nproc % k == 0:
            link_groups[(k, False)] = group
        error = ""
        built = pipe = None
        local: ConfigError | None = None
        try:
            built = build_model(spec, group)
            pipe = build_stage(spec, built, k)
        except ConfigError as exc:
            local, error = exc, _short(exc)
        errors = [""] * world
        tdist.all_gather_object(errors, error)  # every rank learns of any rank's failure
        failed = next((e for e in errors if e), "")
        if failed and k == 1:
            # the model does not build at all: every rank raises (the user's traceback where
            # this rank has it)
            raise local or ConfigError(
                f"the model {spec.model} failed to build on another rank: {failed}",
                key="--model",
            )
        if failed:
            mp_degrees[k] = failed
            if rank == 0:
                logger.info("mp_degree=%d skipped: %s", k, failed)
            continue
        tdist.barrier()
        t_k = time.perf_counter()
        mine = profile_model(
            spec, group, sizes, amp, amp_config, device=device, built=built, pipe=pipe,
            time_optimizer=False,
        )  # fmt: skip
        if k == 1:
            # every rank steps over its share of the model at the same moment, as a job does
            tdist.barrier()
            share = 1.0 / world
            mine.optimizer_step_s_per_byte = optimizer_step_s_per_byte(
                list(pipe.parameters()), spec.optimizer, spec.lr, share=share
            )
        if crowded and k < nproc:
            # group 0 alone (the other ranks wait): a pipeline stage while its neighbours idle
            b = max(sizes)
            tdist.barrier()
            alone = time_alone(spec, built, pipe, b, amp, amp_config, device) if rank < k else 0.0
            tdist.barrier()
            speedups: list[Any] = [None] * world
            tdist.all_gather_object(speedups, mine.whole_pass_s[b] / alone if alone else 0.0)
            idle_speedup[k] = max(1.0, statistics.median(speedups[:k]))
            if rank == 0:
                logger.info(
                    "mp_degree=%d: a group's pass %.3f s with every rank busy, %.3f s alone",
                    k, mine.whole_pass_s[b], alone,
                )  # fmt: skip
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        tdist.gather_object(mine, gathered, dst=0)
        profiles[k] = gathered or []
        mp_degrees[k] = ""
        del built, pipe
        phases[f"profile mp={k}"] = time.perf_counter() - t_k
    t_links = time.perf_counter()
    links = measure_links(world, nnodes, nproc, **_link_args(link_sizes, link_groups, device))
    phases["links"] = time.perf_counter() - t_links
    t_fsdp = time.perf_counter()
    fsdp = measure_fsdp_overhead(spec.optimizer, device) if world > 1 else {}
    phases["fsdp"] = time.perf_counter() - t_fsdp
    if rank == 0:
        logger.info(
            "calibration phases: %s", ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
        )

    payload: list[Any] = [None]
    if rank == 0:
        base = profiles[1][0]
        input_bytes = Linear.fit(sorted(base.input_bytes.items()))
        step = statistics.median(p.optimizer_step_s_per_byte for p in profiles[1])
        model = ModelProfile(
            layers=tuple(_combine(profiles)),
            block_class=base.block_class,
            layer_list=base.layer_list,
            mp_degrees=mp_degrees,
            optimizer=spec.optimizer,
            optimizer_step_s_per_byte=step,
            micro_batch_sizes=tuple(sizes),
            input_bytes=input_bytes,
            amp=amp,
            idle_speedup=idle_speedup,
        )
        if device_memory is not None:
            memory = device_memory
        else:
            memory = memory_per_device_bytes or _ram_bytes() // max(1, nproc)
        cluster = ClusterProfile(
            nnodes=nnodes,
            nproc_per_node=nproc,
            device=device_name,
            backend=backend,
            memory_per_device_bytes=int(memory),
            cores_per_node=usable_cpus(),
            links=links,
            fsdp=fsdp,
        )
        fp = fingerprint(spec, nnodes, nproc, backend, device_name, amp)
        cal = Calibration(model, cluster, fp, time.perf_counter() - start)
        payload[0] = cal.to_dict()
    tdist.broadcast_object_list(payload, src=0)
    return Calibration.from_dict(payload[0])


def _link_args(
    sizes: tuple[int, ...] | None, groups: dict[tuple[int, bool], Any], device: torch.device
) -> dict[str, Any]:
    out: dict[str, Any] = {"groups": groups, "device": device}
    if sizes:
        out["sizes"] = sizes
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fleet.planner.calibrate",
        description="Calibrate the planner inside a fleetrun job (rank 0 writes the result).",
    )
    p.add_argument("--spec", required=True, help="JSON file of the ModelSpec")
    p.add_argument("--out", required=True, help="where rank 0 writes the Calibration (JSON)")
    p.add_argument(
        "--memory_per_device", type=int, default=None, help="CPU memory budget per rank, bytes"
    )
    p.add_argument("--base_strategy", default=None, help="JSON file of the job's strategy")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``python -m fleet.planner.calibrate --spec SPEC.json --out CAL.json ...``."""
    from fleet.base.runtime import init_runtime  # the job's process group (fleet.init's core)

    args = _parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    try:
        spec = ModelSpec.from_dict(json.loads(Path(args.spec).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read the model spec {args.spec}: {exc}", key="--spec") from exc
    base: dict[str, Any] | None = None
    if args.base_strategy:
        try:
            base = json.loads(Path(args.base_strategy).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot read the base strategy {args.base_strategy}: {exc}",
                key="--base_strategy",
            ) from exc
    if not tdist.is_initialized():
        init_runtime(True, strategy=DistributedStrategy())
    cal = calibrate_in_job(spec, base, args.memory_per_device)
    if tdist.get_rank() == 0:
        write_json_atomic(args.out, cal.to_dict())
        print(
            f"calibrated {len(cal.model.layers)} layers at mp degrees "
            f"{sorted(cal.model.mp_degrees)} and {len(cal.cluster.links)} link fits in "
            f"{cal.seconds:.1f} s -> {args.out}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["amp_level", "calibrate_in_job", "main", "micro_batch_sizes"]
