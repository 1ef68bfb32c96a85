"""The PS trainers' coordinator of a Kubernetes job: its pod (rendered) and its process.

Locally fleetrun's agent hosts the trainers' coordinator (:mod:`launcher.recovery.coordinator`): it
outlives every trainer, so a dead async/half-async/GEO trainer can be restarted alone and replay
its prologue's rounds from the coordinator's record. On Kubernetes no fleetrun process outlives the
pods, so a PS job with ``ps_checkpoint`` gets one more pod running only the coordinator::

    Service     N-coord   headless: N-coord-0.N-coord.NS.svc
    StatefulSet N-coord   1 replica, restartPolicy Always, running
                          python -m launcher.schedulers.k8s.coordinator

and every pod of the job FLEET_PS_COORDINATOR=N-coord-0.N-coord.NS.svc:PORT. A StatefulSet, not a
Deployment: it runs *at most one* pod (a Deployment may start a replacement while a partitioned
old pod still runs, and two coordinators would split the trainers' rounds).

The coordinator pod is a member of the job's generations
(:mod:`launcher.schedulers.k8s.ps_recovery`, marker ``coordinator-0`` on the checkpoint volume):
it listens for a generation before its marker says it joined, so the trainers of that generation
(who start once every pod joined) always find it serving their generation (their attempt); when
a newer generation starts (a restart-all recovery) it serves that one afresh, without
restarting.

**When the coordinator pod itself dies** its rounds are lost (they live in its memory): the
kubelet restarts it, it finds its own marker at the current generation — a restart — and decides
as any restarted pod that cannot restart alone: a new generation (every pod restarts from the
newest checkpoint, one unit of the budget), or, with no committed checkpoint yet or the budget
spent, the job fails (exit 3). A trainer pod restarted meanwhile asks the coordinator before
restarting alone (``restart_alone``), and a coordinator that does not hold its rounds says no.
The rounds are not kept on the volume: a restart-all is the honest, simple answer, and the
coordinator is a small process that rarely dies alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from collective.env import read_ps_checkpoint_env
from collective.errors import ConfigError, FleetError
from launcher.attempt import Interrupted, install_signal_handlers
from launcher.recovery.coordinator import Coordinator
from launcher.schedulers.k8s import ps_recovery
from launcher.spec import JobSpec, Mode

logger = logging.getLogger(__name__)

ROLE = "coordinator"
"""The pod's role label (``fleetrun.io/role``) and object-name suffix key."""
PORT = 6179
"""The port the coordinator listens on in its own pod (no other process there: no conflict)."""
CPU, MEMORY, MEMORY_LIMIT = "100m", "256Mi", "1Gi"
"""The coordinator pod's requests and memory limit: a thread per trainer connection and every
round's values for the job's life (a few numbers each; an AUC histogram is 64 KiB)."""
TOKEN_ENV = "FLEET_PS_TOKEN"


def wanted(spec: JobSpec) -> bool:
    """A coordinator pod is rendered: a PS job with ``ps_checkpoint.dir``."""
    return spec.mode is Mode.PS and bool(spec.ps_checkpoint.dir)


def coordinator_args(spec: JobSpec, trainers: int, servers: int) -> list[str]:
    """The coordinator container's command and arguments."""
    return [
        "python",
        "-m",
        "launcher.schedulers.k8s.coordinator",
        "--run_id",
        spec.run_id or spec.name,
        "--trainers",
        str(trainers),
        "--servers",
        str(servers),
        "--port",
        str(PORT),
    ]


def coordinator_env(spec: JobSpec, token_ref: dict[str, Any]) -> list[dict[str, Any]]:
    """The coordinator's env: the job's env, its token from its Secret (``token_ref``:
    secretKeyRef), FLEET_PS_CHECKPOINT_* and FLEET_PS_MAX_RESTARTS (its generation files, the
    interval of the checkpoint epochs), its pod's IP (what it listens on)."""
    env: list[dict[str, Any]] = [
        {"name": k, "value": str(v)} for k, v in spec.env.items() if k != TOKEN_ENV
    ]
    env.append({"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": token_ref}})
    env += ps_recovery.checkpoint_env(spec, ROLE)
    env += [
        {"name": "FLEET_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    return env


def coordinator_container(
    spec: JobSpec, trainers: int, servers: int, token_ref: dict[str, Any]
) -> dict[str, Any]:
    """The coordinator pod's one container (the job's image, its volume mounts)."""
    k = spec.k8s
    args = coordinator_args(spec, trainers, servers)
    return {
        "name": ROLE,
        "image": k.image,
        "imagePullPolicy": str(k.image_pull_policy),
        "command": args[:1],
        "args": args[1:],
        "env": coordinator_env(spec, token_ref),
        "ports": [{"name": ROLE, "containerPort": PORT}],
        "resources": {
            "requests": {"cpu": CPU, "memory": MEMORY},
            "limits": {"memory": MEMORY_LIMIT},
        },
        "volumeMounts": list(k.volume_mounts),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False},
    }


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m launcher.schedulers.k8s.coordinator",
        description="The PS trainers' coordinator pod of a Kubernetes job.",
    )
    p.add_argument("--run_id", required=True, help="The job's run id (its files on the volume).")
    p.add_argument("--trainers", type=int, required=True, help="Trainer pods of the job.")
    p.add_argument("--servers", type=int, required=True, help="Server pods of the job.")
    p.add_argument("--port", type=int, default=PORT, help="Port to listen on.")
    p.add_argument(
        "--host",
        default=os.environ.get("FLEET_POD_IP", ""),
        help="Address to listen on (default: FLEET_POD_IP, the pod's IP).",
    )
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """Serve the job's trainers until the pod is deleted (0) or the job cannot recover (3)."""
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ConfigError(
            "is not set: the coordinator admits the job's trainers by the job's "
            "token (the rendered pod reads it from the Secret N-ps-token)",
            key=TOKEN_ENV,
        )
    if not args.host:
        raise ConfigError(
            "no address to listen on: pass --host or set FLEET_POD_IP (the rendered "
            "pod sets it from status.podIP)",
            key="--host",
        )
    if args.trainers < 1:
        raise ConfigError(f"must be >= 1, got {args.trainers}", key="--trainers")
    cfg = read_ps_checkpoint_env()
    gen = ps_recovery.make_generation(ROLE, 0, args.run_id, args.servers, args.trainers)
    if cfg is None or gen is None:
        raise ConfigError(
            "is not set: the coordinator pod belongs to a PS job with ps_checkpoint "
            "(its files are on the checkpoint volume)",
            key=ps_recovery.CHECKPOINT_DIR_ENV,
        )
    coord: Coordinator | None = None

    def serve(generation: int) -> None:  # before the marker: its trainers find it serving
        nonlocal coord
        if coord is None:
            coord = Coordinator(token, args.trainers, cfg.interval_s, args.host, args.port)
            logger.info(
                "coordinator of %d trainer(s) listening on %s", args.trainers, coord.endpoint
            )
        coord.reset(generation)

    install_signal_handlers()
    try:
        gen.join(0.0, wait=False, ready=serve)  # it waits for no pod: it serves whoever comes
        reason = gen.follow(serve)
    except ps_recovery.RecoveryRefused as err:
        reason = str(err)
    except Interrupted:
        return 0  # the pod is deleted (the job ended)
    finally:
        if coord is not None:
            coord.close()
    sys.stderr.write(f"fleetrun coordinator: {reason}\n")
    return ps_recovery.REFUSED_EXIT


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.schedulers.k8s.coordinator``: the coordinator pod's process."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s fleetrun coordinator: %(message)s",
    )
    try:
        return run(_parse(sys.argv[1:] if argv is None else argv))
    except FleetError as err:
        sys.stderr.write(f"fleetrun coordinator: error: {err}\n")
        return 2 if isinstance(err, ConfigError) else 1


__all__ = ["PORT", "ROLE", "coordinator_container", "main", "run", "wanted"]

if __name__ == "__main__":
    raise SystemExit(main())
