"""A dead PS server on Ray restarted alone, in place (async/GEO mode), as the local agent does.

:mod:`launcher.ps_recovery` decides (:meth:`~launcher.ps_recovery.PSRecovery.alone_possible`:
a server died, every trainer's progress file says async or GEO, a committed checkpoint exists, a
unit of ``max_restarts`` is left); this module does it on the cluster
(:func:`respawn_server`, called by :class:`launcher.schedulers.ray_job.RayJob` while it watches
the attempt):

1. the dead server's actor is killed (its process may have died with it, or alone);
2. a new :class:`~launcher.schedulers.ray_actor.ProcessActor` is created **in the same
   placement-group bundle** (the job's placement group is kept for the whole job), so on the
   same node;
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
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, replace
from typing import IO, Any

from collective.env import metrics_env
from launcher.attempt import SERVER, ProcSpec
from launcher.ps_recovery import PSRecovery, Recovery
from launcher.schedulers.ray_actor import ActorInfo
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
    """What :func:`respawn_server` needs of the driver (``ray_job.RayJob``)."""

    ray: Any
    actor_cls: Any
    """The ``ray.remote`` ProcessActor class."""
    pg: Any
    """The job's placement group (kept across attempts of a recovered PS job)."""
    run_id: str
    argv: list[str]
    """The job's worker command (:func:`launcher.agent.worker_argv`)."""
    no_python: bool
    cwd: str | None
    metrics: bool
    get: Any
    """``RayJob._get``: ray.get bounded in time, errors as LaunchError."""


def server_argv(ctx: RespawnContext) -> list[str]:
    """The restarted server's command: the server side of a fleet script is only init_server +
    run_server, so ``python -m ps_server --from_env`` does the same without the script's
    imports (torch: seconds); a ``--no_python`` entrypoint is run as given."""
    if ctx.no_python:
        return ctx.argv
    return [sys.executable, "-u", "-m", "collective.bootstrap", "-m", "ps_server", "--from_env"]


def respawn_server(ctx: RespawnContext, recovery: PSRecovery, failures: list[Failure],
                   old_actor: Any, old_proc: ProcSpec, bundle_index: int, bundle: dict[str, float],
                   log: IO[bytes], attempt: int, budget_left: bool) -> Respawned | str | None:
    """Re-create the actor of the one dead server of ``failures`` alone (see the module
    docstring). When the attempt must end instead: :data:`PORT_TAKEN` (its port is taken on its
    node: the restart-all recovery must give it a new one), else None (not a lone server death,
    not async/GEO, no checkpoint, no budget)."""
    if len(failures) != 1 or failures[0].role != SERVER:
        return None
    (failed,) = failures
    if not recovery.alone_possible(attempt, failed.role, budget_left):
        return None
    from ray.exceptions import RayError
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    try:
        ctx.ray.kill(old_actor, no_restart=True)
    except (RayError, ValueError):
        pass  # already gone with its node or process
    actor = ctx.actor_cls.options(
        num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), memory=bundle["memory"],
        max_restarts=0,
        name=f"fleetrun-{ctx.run_id}-{attempt}-{SERVER}-{failed.rank}-r{len(recovery.recoveries) + 1}",
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            ctx.pg, placement_group_bundle_index=bundle_index),
    ).remote()
    info: ActorInfo = ctx.get([actor.info.remote()],
                              f"re-create the actor of server {failed.rank}")[0]
    port = int(old_proc.env["PADDLE_PORT"])
    ip = old_proc.env["POD_IP"]
    if info.node_ip != ip or not ctx.get([actor.port_free.remote(ip, port, PORT_WAIT_S)],
                                         "check a port")[0]:
        logger.warning("server %d cannot come back on %s:%d (its bundle's node is %s, or the port "
                       "is taken): every process restarts instead, the server on a new port",
                       failed.rank, ip, port, info.node_ip)
        try:
            ctx.ray.kill(actor, no_restart=True)
        except (RayError, ValueError):
            pass
        return PORT_TAKEN
    rec = recovery.recover_alone(attempt, f"{SERVER} {failed.rank} {failed.exit_desc}", failed.role,
                                 failed.rank, budget_left)
    if rec is None:  # the progress files changed in between (a trainer finished the attempt)
        ctx.ray.kill(actor, no_restart=True)
        return None
    env = {**old_proc.env, **recovery.restore_env()}
    proc = replace(old_proc, env=env)
    if ctx.metrics and old_proc.metrics_port:
        (mport,) = ctx.get([actor.free_ports.remote(ip, 1)], "find a free port")[0]
        proc = replace(proc, metrics_port=mport, env={**env, **metrics_env(mport, ip)})
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    log.write(f"==== fleetrun: attempt {attempt}, {proc.label} restarted alone, {stamp}, "
              f"ray node {info.node_ip} ({info.hostname}) ====\n".encode())
    pid = ctx.get([actor.start.remote(server_argv(ctx), proc.env, ctx.cwd, sys.executable)],
                  f"restart server {failed.rank}")[0]
    return Respawned(actor, info, proc, int(pid), rec)


__all__ = ["PORT_TAKEN", "RespawnContext", "Respawned", "respawn_server", "server_argv"]
