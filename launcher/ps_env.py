"""What every scheduler puts in a PS job's environment besides the env contract.

The job's token (FLEET_PS_TOKEN: the user's, else a new random one; every server checks it on
each call) and the directories a server's checkpoint requests may name
(FLEET_PS_CHECKPOINT_ROOT). The local agent, the Ray driver and the Kubernetes renderer all set
them from here; the local agent and the Ray driver also give each server its SSD directory
(FLEET_PS_SSD_ROOT, from ``--ps_ssd_dir``) and, with ``--ps_bind_cpus``, its share of its host's
CPUs (FLEET_PS_CPU_SHARE). Standard library only.
"""

from __future__ import annotations

import os
import secrets

from collective.env import FLEET_PS_CPU_SHARE, FLEET_PS_SSD_ROOT
from collective.errors import ConfigError
from launcher.spec import JobSpec

FLEET_PS_TOKEN = "FLEET_PS_TOKEN"
"""The PS job's shared secret, in every server's and trainer's environment (the name
``ps_server.rpc.auth.TOKEN_ENV`` reads; the launcher does not import ps_server: numpy)."""
FLEET_PS_CHECKPOINT_ROOT = "FLEET_PS_CHECKPOINT_ROOT"
"""Directories a server's Save / Load requests may name (``ps_server.checkpoint.roots``)."""


def user_ps_token(spec: JobSpec) -> str | None:
    """FLEET_PS_TOKEN from the job's env or fleetrun's own, if the user set one."""
    return spec.env.get(FLEET_PS_TOKEN) or os.environ.get(FLEET_PS_TOKEN) or None


def job_ps_token(spec: JobSpec) -> str:
    """The token of a PS job: the user's (:func:`user_ps_token`), else a new random one
    (``secrets.token_urlsafe(32)``). Never logged."""
    return user_ps_token(spec) or secrets.token_urlsafe(32)


def ps_checkpoint_root_env(env: dict[str, str], log_dir: str, cwd: str) -> dict[str, str]:
    """FLEET_PS_CHECKPOINT_ROOT for a server: the directory fleetrun runs in (where relative
    save paths land) and the job's log directory, unless the job's env sets it."""
    if FLEET_PS_CHECKPOINT_ROOT in env:
        return {}
    roots = dict.fromkeys([cwd, os.path.abspath(log_dir)])
    return {FLEET_PS_CHECKPOINT_ROOT: os.pathsep.join(roots)}


def ps_ssd_root(ssd_dir: str, server_index: int) -> str:
    """Server ``server_index``'s own SSD directory under the job's ``--ps_ssd_dir``."""
    return os.path.join(ssd_dir, f"server-{server_index}")


def ps_ssd_root_env(spec: JobSpec, server_index: int) -> dict[str, str]:
    """FLEET_PS_SSD_ROOT for a server when the job has ``ps.ssd_dir`` (else nothing)."""
    if not spec.ps.ssd_dir:
        return {}
    return {FLEET_PS_SSD_ROOT: ps_ssd_root(spec.ps.ssd_dir, server_index)}


def ps_cpu_share_env(spec: JobSpec, share: int, count: int) -> dict[str, str]:
    """FLEET_PS_CPU_SHARE for the ``share``-th of the ``count`` servers on one host when the job
    has ``ps.bind_cpus`` (else nothing, or when the job's env sets it)."""
    if not spec.ps.bind_cpus or FLEET_PS_CPU_SHARE in spec.env:
        return {}
    return {FLEET_PS_CPU_SHARE: f"{share}/{count}"}


def check_ps_ssd_dir(spec: JobSpec) -> None:
    """Create ``ps.ssd_dir`` on this machine (when missing) and check it is a writable
    directory: ConfigError naming ``--ps_ssd_dir`` otherwise. For schedulers whose servers run
    on this machine."""
    directory = spec.ps.ssd_dir
    if not directory:
        return
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"--ps_ssd_dir / ps.ssd_dir {directory!r} cannot be created ({err.strerror}); give "
            "a directory on a local disk this user can write",
            key="ps.ssd_dir",
        ) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--ps_ssd_dir / ps.ssd_dir {directory!r} is not writable by this user; give a "
            "directory on a local disk this user can write",
            key="ps.ssd_dir",
        )
