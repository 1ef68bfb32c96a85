"""The env contract's vocabulary: its variable names, the role and backend enums, and the small
readers every half of the contract shares.

:mod:`collective.env` (the one parser of a process's place in the job, and a collective job's
layout) and :mod:`collective.env_ps` (a PS job's layout) build on it; :mod:`collective.env`
re-exports all of it, so ``from collective.env import Backend`` keeps working. Standard library
only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum
from typing import Any

from collective.errors import EnvContractError


class StrEnum(str, Enum):
    """``enum.StrEnum`` for Python 3.10 (3.11 has it built in)."""

    def __str__(self) -> str:
        return str(self.value)


class TrainingRole(StrEnum):
    """Paddle's ``TRAINING_ROLE`` values."""

    TRAINER = "TRAINER"
    PSERVER = "PSERVER"
    HETER_TRAINER = "HETER_TRAINER"
    """A heterogeneous PS job's device worker: runs the dense half of the model for the CPU
    trainers (:mod:`fleet.heter`)."""


class Backend(StrEnum):
    """Process-group backend asked of the launcher; ``auto`` is resolved in the worker."""

    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


# The fleetrun-specific variables (the rest are the torchrun and Paddle families).
FLEET_ERROR_FILE = "FLEET_ERROR_FILE"
FLEET_LOG_DIR = "FLEET_LOG_DIR"
FLEET_BACKEND = "FLEET_BACKEND"
FLEET_JOB_NAME = "FLEET_JOB_NAME"
FLEET_NNODES = "FLEET_NNODES"
FLEET_STRATEGY = "FLEET_STRATEGY"
FLEET_METRICS_PORT = "FLEET_METRICS_PORT"
FLEET_METRICS_HOST = "FLEET_METRICS_HOST"
FLEET_PS_TABLE_THREADS = "FLEET_PS_TABLE_THREADS"
"""Threads a parameter server splits one large pull/push over (ps_server.server)."""
FLEET_PS_CHECKPOINT_DIR = "FLEET_PS_CHECKPOINT_DIR"
"""PS trainers: where the job's automatic checkpoints go (fleetrun --ps_checkpoint_dir); set =
checkpoints on, and the trainers resume from the newest good one there at start."""
FLEET_PS_CHECKPOINT_INTERVAL = "FLEET_PS_CHECKPOINT_INTERVAL"
"""Seconds between automatic PS checkpoints (--ps_checkpoint_interval)."""
FLEET_PS_CHECKPOINT_KEEP = "FLEET_PS_CHECKPOINT_KEEP"
"""Automatic PS checkpoints kept (--ps_checkpoint_keep; 0 = all)."""
FLEET_PS_COORDINATOR = "FLEET_PS_COORDINATOR"
"""PS trainers: ``host:port`` of the trainers' coordinator that fleetrun's agent hosts for a job
with automatic checkpoints (``launcher.recovery.coordinator``); async/half-async/GEO trainers then form
no gloo group and meet through it, so one of them can be restarted alone
(:mod:`collective.ps_coordination`)."""
PADDLE_HETER_TRAINER_IP_PORT_LIST = "PADDLE_HETER_TRAINER_IP_PORT_LIST"
"""Heterogeneous PS jobs: ``ip:port`` of every heter worker, in every role's environment (its
presence makes a PS job heterogeneous, as in Paddle)."""
PADDLE_HETER_TRAINER_DEVICE = "PADDLE_HETER_TRAINER_DEVICE"
"""A heter worker's device (``cpu``, ``cuda``, ``cuda:N``; fleetrun ``--heter_devices``)."""
FLEET_PS_SSD_ROOT = "FLEET_PS_SSD_ROOT"
"""A parameter server's directory for the cold rows of ``storage="ssd"`` tables (fleetrun
``--ps_ssd_dir``: ``<dir>/server-<i>``), read by every way a server starts from the env
contract (``fleet.init_server``, ``python -m ps_server --from_env``)."""
FLEET_PS_CPU_SHARE = "FLEET_PS_CPU_SHARE"
"""``I/N``: a parameter server binds itself to the I-th of N blocks of its host's CPUs at start
(fleetrun ``--ps_bind_cpus``; :mod:`collective.cpu_share`), then drops the variable."""
FLEET_PS_RESUME_POSITION = "FLEET_PS_RESUME_POSITION"
"""A PS trainer restarted alone: its data position as JSON (``{"pass", "step_in_pass",
"step"}``), from its progress file; it skips that much data and loads no checkpoint."""


def read_int(env: Mapping[str, str], name: str) -> int | None:
    """Integer variable ``name`` of ``env`` (None when unset or empty); not a whole number raises
    :class:`EnvContractError` naming it."""
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise EnvContractError(
            f"environment variable {name}={raw!r} is not an integer; the launcher sets it to a "
            "whole number — unset it or launch with fleetrun/torchrun"
        ) from None


def read_metrics_endpoint(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{"metrics_port", "metrics_host"}`` from FLEET_METRICS_PORT / FLEET_METRICS_HOST (the
    part of the contract a bare ``PSServer`` reads too); port 0 = no endpoint."""
    env = os.environ if environ is None else environ
    port = read_int(env, FLEET_METRICS_PORT) or 0
    if not 0 <= port < 65536:
        raise EnvContractError(
            f"{FLEET_METRICS_PORT}={port} is not a port (0..65535; 0 = no endpoint)"
        )
    return {"metrics_port": port, "metrics_host": env.get(FLEET_METRICS_HOST) or "127.0.0.1"}


def metrics_env(port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """FLEET_METRICS_PORT/HOST for a process given a metrics port (nothing for 0)."""
    return {FLEET_METRICS_PORT: str(port), FLEET_METRICS_HOST: host} if port else {}
