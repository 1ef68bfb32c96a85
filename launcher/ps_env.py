"""What every scheduler puts in a PS job's environment besides the env contract.

The job's token (FLEET_PS_TOKEN: the user's, else a new random one; every server checks it on
each call) and the directories a server's checkpoint requests may name
(FLEET_PS_CHECKPOINT_ROOT). The local agent, the Ray driver and the Kubernetes renderer all set
them from here. Standard library only.
"""

from __future__ import annotations

import os
import secrets

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
