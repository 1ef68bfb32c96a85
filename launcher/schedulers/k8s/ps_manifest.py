"""A PS job's recovery in its Kubernetes manifest (:mod:`launcher.schedulers.k8s.render` and the
coordinator pod's manifest call these): the check that ``ps_checkpoint.dir`` is on a volume every
pod shares and may write, the env every pod gets (the checkpoint settings, the restart budget,
the trainers' reconnect time), and the trainers' ``podFailurePolicy`` that fails the Job at once
when a pod says the job cannot recover. Pure functions of the :class:`~launcher.spec.JobSpec`.

What the pods do with it at run time, the recovery files on that volume, is
:mod:`launcher.schedulers.k8s.ps_recovery`.
"""

from __future__ import annotations

import os
from typing import Any

from collective.env import PSCheckpointEnv, ps_checkpoint_env
from collective.errors import ConfigError
from launcher.spec import JobSpec

RECONNECT_ENV = "FLEET_PS_RECONNECT_S"
"""PSClient's reconnect time (``ps_server.rpc.rpc_client.RECONNECT_ENV``; not imported: the
launcher loads no grpc)."""
RECONNECT_S = 60.0
"""The trainers' FLEET_PS_RECONNECT_S (unless the job's env sets it): a restarting server pod
(container start, imports, tables) is waited for this long."""
MAX_RESTARTS_ENV = "FLEET_PS_MAX_RESTARTS"
"""The job's ``max_restarts`` in every pod: the recoveries the pods may start (counted on the
volume)."""
REFUSED_EXIT = 3
"""Exit code of a pod when the job cannot recover (no checkpoint yet, budget spent): the
trainers' Job fails at once on it (``podFailurePolicy``)."""


def check_checkpoint_volume(spec: JobSpec) -> None:
    """ConfigError unless ``ps_checkpoint.dir`` is an absolute path on a writable mount of a
    PersistentVolumeClaim (every pod, servers and trainers, must see the same files)."""
    directory = spec.ps_checkpoint.dir
    if not directory:
        return
    claims = {v.get("name") for v in spec.k8s.volumes if "persistentVolumeClaim" in v}
    example = (
        "e.g. k8s: {volumes: [{name: ckpt, persistentVolumeClaim: {claimName: ps-ckpt}}], "
        "volume_mounts: [{name: ckpt, mountPath: /ckpt}]} and ps_checkpoint.dir: /ckpt/JOB; "
        "the claim must be ReadWriteMany (NFS, CephFS, a cloud file store) and exist before "
        "the job is applied"
    )
    if not os.path.isabs(directory):
        raise ConfigError(
            f"{directory!r} must be an absolute path inside the pods on a mounted "
            f"PersistentVolumeClaim shared by every pod; {example}",
            key="ps_checkpoint.dir",
        )
    for mount in spec.k8s.volume_mounts:
        path = str(mount.get("mountPath", "")).rstrip("/")
        if (
            mount.get("name") in claims
            and not mount.get("readOnly")
            and (directory == path or directory.startswith(path + "/"))
        ):
            return
    raise ConfigError(
        f"{directory!r} is on no writable k8s.volume_mounts entry of a "
        f"persistentVolumeClaim volume: servers and trainers must share it; {example}",
        key="ps_checkpoint.dir",
    )


def checkpoint_env(spec: JobSpec, role: str) -> list[dict[str, Any]]:
    """FLEET_PS_CHECKPOINT_* and FLEET_PS_MAX_RESTARTS of every pod (the pods keep their
    recovery files in the directory) and the trainers' FLEET_PS_RECONNECT_S; empty without
    ``ps_checkpoint.dir``."""
    cfg = spec.ps_checkpoint
    if not cfg.dir:
        return []
    env = ps_checkpoint_env(PSCheckpointEnv(cfg.dir, cfg.interval_s, cfg.keep))
    env[MAX_RESTARTS_ENV] = str(spec.max_restarts)
    if role == "trainer" and RECONNECT_ENV not in spec.env:
        env[RECONNECT_ENV] = f"{RECONNECT_S:g}"
    return [{"name": k, "value": v} for k, v in env.items() if k not in spec.env]


def pod_failure_policy(spec: JobSpec) -> dict[str, Any] | None:
    """The trainers' Job ``podFailurePolicy``: a pod exiting :data:`REFUSED_EXIT` (the job cannot
    recover) fails the Job at once rather than being retried; None without ``ps_checkpoint``."""
    if not spec.ps_checkpoint.dir:
        return None
    # (an empty onPodConditions: the 1.28 schema requires the field; the API server takes an
    # empty list as "not set", as elastic.py does)
    return {
        "rules": [
            {
                "action": "FailJob",
                "onPodConditions": [],
                "onExitCodes": {
                    "containerName": "trainer",
                    "operator": "In",
                    "values": [REFUSED_EXIT],
                },
            }
        ]
    }


__all__ = [
    "MAX_RESTARTS_ENV",
    "RECONNECT_ENV",
    "RECONNECT_S",
    "REFUSED_EXIT",
    "check_checkpoint_volume",
    "checkpoint_env",
    "pod_failure_policy",
]
