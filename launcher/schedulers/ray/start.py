"""Start one attempt of a Ray job: the placement group, one actor per bundle, every process's
env from where the actors landed, and the processes.

:func:`start_attempt` fills the attempt's :class:`~launcher.schedulers.ray.members.Group` as it
goes (so the teardown finds whatever started); a PS job with automatic checkpoints keeps its
placement group and each server's first port across attempts. :class:`RayJob
<launcher.schedulers.ray.job.RayJob>` calls it once per attempt.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from collective.env import metrics_env
from collective.errors import LaunchError
from launcher.attempt import SERVER, TRAINER, write_endpoints
from launcher.heter_spec import HETER
from launcher.ps_env import FLEET_PS_CHECKPOINT_ROOT
from launcher.schedulers.ray import elastic
from launcher.schedulers.ray.actor import ActorInfo
from launcher.schedulers.ray.members import Group, Member, actor_results, warm_request
from launcher.schedulers.ray.plan import AttemptPaths, Placed, Slot, make_proc_specs
from launcher.spec import Mode

if TYPE_CHECKING:
    from launcher.schedulers.ray.job import RayJob

logger = logging.getLogger(__name__)


def start_attempt(job: RayJob, group: Group, attempt: int) -> None:
    """Placement group, actors, env, processes (filling ``group`` as it goes, for teardown)."""
    ray, spec = job.ray, job.spec
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if job.elastic:  # as many nodes as the cluster places now, MAX down to MIN
        group.pg, job.slots = elastic.place_round(ray, spec, job.run_id, attempt)
    elif job.kept_pg is not None:  # a recovery: the same bundles, so the same nodes
        group.pg = job.kept_pg
    else:
        group.pg = placement_group(
            [s.bundle for s in job.slots],
            strategy=str(spec.ray.placement_strategy),
            name=f"fleetrun-{spec.name}-{job.run_id}-{attempt}",
        )
    if job.recovery is not None:
        job.kept_pg = group.pg
    bundles = [s.bundle for s in job.slots]
    ready, _ = ray.wait([group.pg.ready()], timeout=spec.ray.placement_timeout_s)
    if not ready:
        raise LaunchError(
            f"the Ray cluster could not place the job's {len(bundles)} bundles "
            f"({_bundles_text(bundles)}, strategy {spec.ray.placement_strategy}) within "
            f"{spec.ray.placement_timeout_s:g} s; available: {_resources_text(ray.available_resources())}. "
            "Lower resources.trainer/server, add nodes, or pick another ray.placement_strategy"
        )
    for i, slot in enumerate(job.slots):
        b = slot.bundle
        group.actors.append(
            job.actor_cls.options(
                num_cpus=b["CPU"],
                num_gpus=b.get("GPU", 0),
                memory=b["memory"],
                max_restarts=0,
                name=f"fleetrun-{job.run_id}-{attempt}-{slot.role}-{slot.index}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group.pg, placement_group_bundle_index=i
                ),
            ).remote()
        )
    infos: list[ActorInfo] = actor_results(
        job.ray, [a.info.remote() for a in group.actors], "start the actors"
    )
    # per actor, on its node: its endpoint port, its /metrics port (metrics on), and for
    # actor 0 of a collective job the master port (rank 0 is slot 0's trainer: plan.py
    # numbers node by node)
    metrics = job.monitor.metrics_enabled
    collective = spec.mode is Mode.COLLECTIVE
    ports = actor_results(
        job.ray,
        [
            a.free_ports.remote(info.node_ip, 1 + int(metrics) + int(collective and i == 0))
            for i, (a, info) in enumerate(zip(group.actors, infos, strict=True))
        ],
        "find free ports",
    )
    placed = [
        Placed(slot, info.node_ip, info.node_id, info.gpu_ids, _port(job, slot, got[0]))
        for slot, info, got in zip(job.slots, infos, ports, strict=True)
    ]
    master_port = ports[0][-1] if collective else 0
    paths = AttemptPaths(
        job.run_id,
        attempt,
        spec.max_restarts,
        job.log_dir,
        job.strategy_file,
        ps_token=job.ps_token,
        cwd=job.cwd or ".",
    )
    procs, head = make_proc_specs(spec, placed, master_port, paths)
    if job.recovery is not None:  # as the local agent: checkpoints on, the servers may load them
        rec = job.recovery
        rec.begin_attempt(attempt)  # the coordinator forgets the rounds of earlier attempts
        procs = [
            replace(p, env={**p.env, **rec.trainer_env()})
            if p.role == TRAINER
            else replace(p, env={**p.env, **rec.heter_env()})
            if p.role == HETER
            else replace(
                p,
                env={
                    **p.env,
                    FLEET_PS_CHECKPOINT_ROOT: rec.server_roots(
                        p.env.get(FLEET_PS_CHECKPOINT_ROOT, "")
                    ),
                },
            )
            for p in procs
        ]
    if metrics:  # bound to the node IP the actor runs on
        procs = [
            replace(p, metrics_port=got[1], env={**p.env, **metrics_env(got[1], info.node_ip)})
            for p, got, info in zip(procs, ports, infos, strict=True)
        ]
    servers = [f"{p.env['POD_IP']}:{p.env['PADDLE_PORT']}" for p in procs if p.role == SERVER]
    heters = tuple(f"{p.env['POD_IP']}:{p.env['PADDLE_PORT']}" for p in procs if p.role == HETER)
    trainers = next(p.env["PADDLE_TRAINER_ENDPOINTS"] for p in procs if p.role == TRAINER)
    write_endpoints(job.log_dir, attempt, head, servers, tuple(trainers.split(",")), heters=heters)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    for actor, info, proc in zip(group.actors, infos, procs, strict=True):
        log = open(proc.log_path, "ab" if attempt else "wb", buffering=0)  # noqa: SIM115 - closed in teardown
        log.write(
            f"==== fleetrun: attempt {attempt}, {proc.label}, {stamp}, ray node {info.node_ip} "
            f"({info.hostname}) ====\n".encode()
        )
        group.members.append(Member(actor, info, proc, log))
    pids = actor_results(
        job.ray,
        [
            m.actor.start.remote(
                job.argv,
                m.proc.env,
                job.cwd,
                sys.executable,
                warm_request(job.spec, job.log_dir, m.proc),
            )
            for m in group.members
        ],
        "start the processes",
    )
    for m, pid in zip(group.members, pids, strict=True):
        m.pid = pid
    logger.info(
        "attempt %d: %d process(es) running on %d Ray node(s) (run_id %s)",
        attempt,
        len(group.members),
        len({i.node_id for i in infos}),
        job.run_id,
    )


def _port(job: RayJob, slot: Slot, found: int) -> int:
    """A slot's endpoint port: a server of a recovered job keeps its first one."""
    if job.recovery is None or slot.role != SERVER:
        return found
    return job.server_ports.setdefault(slot.index, found)


def _bundles_text(bundles: list[dict[str, float]]) -> str:
    first = bundles[0]
    each = ", ".join(
        f"{k} {v / 2**20:.0f}Mi" if k == "memory" else f"{k} {v:g}" for k, v in first.items()
    )
    same = all(b == first for b in bundles)
    return f"each {each}" if same else "; ".join(str(b) for b in bundles)


def _resources_text(res: dict[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU", "memory") if k in res]
    return (
        ", ".join(
            f"{k} {res[k] / 2**20:.0f}Mi" if k == "memory" else f"{k} {res[k]:g}" for k in keys
        )
        or "none"
    )


__all__ = ["start_attempt"]
