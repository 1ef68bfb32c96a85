"""A dead PS server or trainer on Ray restarted alone, in place (async/GEO mode), as the local
agent does.

:mod:`launcher.recovery.ps_policy` decides
(:meth:`~launcher.recovery.ps_policy.PSRecovery.alone_possible`: a server died, every trainer's
progress file says async or GEO, a committed checkpoint exists, a unit of ``max_restarts`` is
left); this module does it on the cluster
(:func:`respawn_server`, called by :class:`launcher.schedulers.ray.job.RayJob` while it watches
the attempt):

1. the dead server's actor is killed (its process may have died with it, or alone);
2. a new :class:`~launcher.schedulers.ray.actor.ProcessActor` is created **in the same
   placement-group bundle** (the job's placement group is kept for the whole job), so on the
   same node. With warm starts (``warm_start: on``) the dead process's own actor is kept when
   it still answers, and the process is forked from that actor's warm process, every import
   done (steps 1 and 2 apply when the actor died too);
3. it checks on that node that the server's previous port is free: the trainers' PSClient knows
   the servers by endpoint (PADDLE_PSERVERS_IP_PORT_LIST, fixed for a process's life), so the
   server must come back on it. When the port is taken, nothing is restarted alone: the attempt
   ends as any failed one and the restart-all recovery gives that server a new port, which every
   trainer gets in its env (the one way a new endpoint reaches running trainers today: they are
   restarted with it; a PSClient that re-resolves endpoints while it runs does not exist);
4. the server is started with its previous env plus FLEET_PS_RESTORE_LATEST=DIR (it restores
   its own shards from the newest good checkpoint before it listens; ``python -m ps_server
   --from_env``, without the user's script and its imports, unless ``--no_python``), its output
   appended to ``serverlog.N``.

The trainer actors and the other servers keep running; their calls to the restarted server wait
for it (FLEET_PS_RECONNECT_S). The recovery is one unit of ``max_restarts``, listed as
``restarted: server N only`` (console, ``job_state.json`` ``recoveries`` and ``restarts``, the
final summary, ``fleet_ps_recoveries_total``).

**A dead trainer** (:func:`respawn_trainer`): the driver hosts the trainers' coordinator
(:mod:`launcher.recovery.coordinator`, on the driver node's IP; ``RayJob.run``), so async/GEO
trainers meet through it instead of a gloo group, as locally. When one trainer's process or actor dies,
:meth:`~launcher.recovery.ps_policy.PSRecovery.trainer_position` says whether it can restart alone
(every trainer's progress file says it meets through the coordinator, the dead one's file has
its data position, a restart is left). Its actor is re-created in its bundle as a server's,
and it runs the user's script again with its previous env plus FLEET_PS_RESUME_POSITION (its
data position): it replays its prologue's rounds from the coordinator's record and trains on
from there, while the servers and the other trainers go on. Listed as ``restarted: trainer N
only, resumed at its data position``. When Ray re-placed its bundle on another node (its node
was lost), every process restarts instead (its env names its node).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import IO, Any

from collective.env import metrics_env
from collective.errors import LaunchError
from launcher.attempt import SERVER, TRAINER, ProcSpec
from launcher.recovery.ps_policy import PSRecovery, Recovery
from launcher.schedulers.ray.actor import ActorInfo, WarmRequest
from launcher.summary import Failure

logger = logging.getLogger(__name__)

PORT_WAIT_S = 5.0
"""How long the new actor waits for the server's port to be free (its dead predecessor's
process, killed with its actor, may hold it for a moment)."""
PORT_TAKEN = "port taken"
""":func:`respawn_server`'s answer when the server's previous port is taken on its node."""


@dataclass(frozen=True)
class Respawned:
    """The server's new actor, running its process."""

    actor: Any
    info: ActorInfo
    proc: ProcSpec
    pid: int
    recovery: Recovery


@dataclass(frozen=True)
class RespawnContext:
    """What :func:`respawn_server` needs of the driver (``job.RayJob``)."""

    ray: Any
    actor_cls: Any
    """The ``ray.remote`` ProcessActor class."""
    pg: Any
    """The job's placement group (kept across attempts of a recovered PS job)."""
    run_id: str
    argv: list[str]
    """The job's worker command (:func:`launcher.attempt.worker_argv`)."""
    no_python: bool
    cwd: str | None
    metrics: bool
    get: Any
    """``members.actor_results`` on the job's ray: ray.get bounded in time, errors as
    LaunchError."""
    warm: Callable[[ProcSpec], WarmRequest | None] | None = None
    """``members.warm_request`` on the job's spec (warm starts on): the process is restarted
    in its actor, if that is alive, forked from the actor's warm process."""


def server_argv(ctx: RespawnContext) -> list[str]:
    """The restarted server's command: the server side of a fleet script is only init_server +
    run_server, so ``python -m ps_server --from_env`` does the same without the script's
    imports (torch: seconds); a ``--no_python`` entrypoint is run as given."""
    if ctx.no_python:
        return ctx.argv
    return [sys.executable, "-u", "-m", "collective.bootstrap", "-m", "ps_server", "--from_env"]


def respawn_server(
    ctx: RespawnContext,
    recovery: PSRecovery,
    failures: list[Failure],
    old_actor: Any,
    old_proc: ProcSpec,
    bundle_index: int,
    bundle: dict[str, float],
    log: IO[bytes],
    attempt: int,
    budget_left: bool,
) -> Respawned | str | None:
    """Re-create the actor of the one dead server of ``failures`` alone (see the module
    docstring). When the attempt must end instead: :data:`PORT_TAKEN` (its port is taken on its
    node: the restart-all recovery must give it a new one), else None (not a lone server death,
    not async/GEO, no checkpoint, no budget)."""
    if len(failures) != 1 or failures[0].role != SERVER:
        return None
    (failed,) = failures
    if not recovery.alone_possible(attempt, failed.role, budget_left):
        return None
    actor, info = _actor_for_restart(
        ctx,
        old_actor,
        old_proc,
        bundle_index,
        bundle,
        failed,
        attempt,
        len(recovery.recoveries) + 1,
    )
    port = int(old_proc.env["PADDLE_PORT"])
    ip = old_proc.env["POD_IP"]
    if (
        info.node_ip != ip
        or not ctx.get([actor.port_free.remote(ip, port, PORT_WAIT_S)], "check a port")[0]
    ):
        logger.warning(
            "server %d cannot come back on %s:%d (its bundle's node is %s, or the port "
            "is taken): every process restarts instead, the server on a new port",
            failed.rank,
            ip,
            port,
            info.node_ip,
        )
        _kill(ctx, actor)
        return PORT_TAKEN
    rec = recovery.recover_alone(
        attempt, f"{SERVER} {failed.rank} {failed.exit_desc}", failed.role, failed.rank, budget_left
    )
    if rec is None:  # the progress files changed in between (a trainer finished the attempt)
        _kill(ctx, actor)
        return None
    return _launch(
        ctx,
        actor,
        info,
        replace(old_proc, env={**old_proc.env, **recovery.restore_env()}),
        old_proc,
        log,
        attempt,
        server_argv(ctx),
        rec,
    )


def respawn_trainer(
    ctx: RespawnContext,
    recovery: PSRecovery,
    failures: list[Failure],
    old_actor: Any,
    old_proc: ProcSpec,
    bundle_index: int,
    bundle: dict[str, float],
    log: IO[bytes],
    attempt: int,
    budget_left: bool,
) -> Respawned | None:
    """Re-create the actor of the one dead trainer of ``failures`` alone, running the user's
    script from its data position (see the module docstring); None when the attempt must end
    instead (not a lone trainer death, the trainers do not meet through the coordinator, no
    data position yet, no budget, its bundle moved to another node)."""
    if len(failures) != 1 or failures[0].role != TRAINER:
        return None
    (failed,) = failures
    if not recovery.alone_possible(attempt, TRAINER, budget_left, failed.rank):
        return None
    actor, info = _actor_for_restart(
        ctx,
        old_actor,
        old_proc,
        bundle_index,
        bundle,
        failed,
        attempt,
        len(recovery.recoveries) + 1,
    )
    if info.node_ip != old_proc.env["POD_IP"]:
        logger.warning(
            "trainer %d's bundle is now on node %s, not %s: every process restarts instead",
            failed.rank,
            info.node_ip,
            old_proc.env["POD_IP"],
        )
        _kill(ctx, actor)
        return None
    rec = recovery.recover_alone(
        attempt, f"rank {failed.rank} {failed.exit_desc}", failed.role, failed.rank, budget_left
    )
    if rec is None:  # its progress file changed in between
        _kill(ctx, actor)
        return None
    return _launch(
        ctx,
        actor,
        info,
        replace(old_proc, env={**old_proc.env, **recovery.resume_env(rec)}),
        old_proc,
        log,
        attempt,
        ctx.argv,
        rec,
    )


def _kill(ctx: RespawnContext, actor: Any) -> None:
    from ray.exceptions import RayError

    try:
        ctx.ray.kill(actor, no_restart=True)
    except (RayError, ValueError):
        pass  # already gone with its node or process


def _actor_for_restart(
    ctx: RespawnContext,
    old_actor: Any,
    old_proc: ProcSpec,
    bundle_index: int,
    bundle: dict[str, float],
    failed: Failure,
    attempt: int,
    number: int,
) -> tuple[Any, ActorInfo]:
    """With warm starts, the dead process's own actor when it answers (its warm process has
    every import done); otherwise a new one in the same bundle (:func:`_recreate`)."""
    if ctx.warm is not None and ctx.warm(old_proc) is not None:
        try:
            info: ActorInfo = ctx.get([old_actor.info.remote()], "reach the actor")[0]
            return old_actor, info
        except LaunchError:  # the actor died with the process (or its node): a new one
            pass
    return _recreate(ctx, old_actor, bundle_index, bundle, failed, attempt, number)


def _recreate(
    ctx: RespawnContext,
    old_actor: Any,
    bundle_index: int,
    bundle: dict[str, float],
    failed: Failure,
    attempt: int,
    number: int,
) -> tuple[Any, ActorInfo]:
    """Kill the dead process's actor; a new one in the same bundle, and where it landed."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _kill(ctx, old_actor)
    actor = ctx.actor_cls.options(
        num_cpus=bundle["CPU"],
        num_gpus=bundle.get("GPU", 0),
        memory=bundle["memory"],
        max_restarts=0,
        name=f"fleetrun-{ctx.run_id}-{attempt}-{failed.role}-{failed.rank}-r{number}",
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            ctx.pg, placement_group_bundle_index=bundle_index
        ),
    ).remote()
    info: ActorInfo = ctx.get(
        [actor.info.remote()], f"re-create the actor of {failed.role} {failed.rank}"
    )[0]
    return actor, info


def _launch(
    ctx: RespawnContext,
    actor: Any,
    info: ActorInfo,
    proc: ProcSpec,
    old_proc: ProcSpec,
    log: IO[bytes],
    attempt: int,
    argv: list[str],
    rec: Recovery,
) -> Respawned:
    """Start ``proc`` (a fresh /metrics port when the old one had one) in the new actor, its
    output appended to the process's log."""
    ip = info.node_ip
    if ctx.metrics and old_proc.metrics_port:
        (mport,) = ctx.get([actor.free_ports.remote(ip, 1)], "find a free port")[0]
        proc = replace(proc, metrics_port=mport, env={**proc.env, **metrics_env(mport, ip)})
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    log.write(
        f"==== fleetrun: attempt {attempt}, {proc.label} restarted alone, {stamp}, "
        f"ray node {info.node_ip} ({info.hostname}) ====\n".encode()
    )
    warm = ctx.warm(proc) if ctx.warm is not None else None
    pid = ctx.get(
        [actor.start.remote(argv, proc.env, ctx.cwd, sys.executable, warm)],
        f"restart {proc.label}",
    )[0]
    return Respawned(actor, info, proc, int(pid), rec)


__all__ = [
    "PORT_TAKEN",
    "RespawnContext",
    "Respawned",
    "respawn_server",
    "respawn_trainer",
    "server_argv",
]
