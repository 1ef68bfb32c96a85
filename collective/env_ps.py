"""The env contract of a PS job: the layout the launcher knows when it starts its share of one
(:class:`PSLayout`), the variables of each server, heter worker and trainer it starts, and the
automatic-checkpoint settings it hands the trainers (:class:`PSCheckpointEnv`).

Every scheduler (local, Ray, Kubernetes) builds a PS job's processes' env from here; a process
reads its place back with :func:`collective.env.read_worker_env`. :mod:`collective.env`
re-exports these names. Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from collective.env_base import (
    FLEET_BACKEND,
    FLEET_ERROR_FILE,
    FLEET_JOB_NAME,
    FLEET_LOG_DIR,
    FLEET_PS_CHECKPOINT_DIR,
    FLEET_PS_CHECKPOINT_INTERVAL,
    FLEET_PS_CHECKPOINT_KEEP,
    FLEET_STRATEGY,
    PADDLE_HETER_TRAINER_DEVICE,
    PADDLE_HETER_TRAINER_IP_PORT_LIST,
    Backend,
    TrainingRole,
    metrics_env,
    read_int,
)
from collective.errors import EnvContractError


@dataclass(frozen=True)
class PSCheckpointEnv:
    """Automatic checkpoints of a PS job, as the launcher hands them to the trainers."""

    dir: str
    """Directory of the numbered checkpoints (on the servers' side, under their roots)."""
    interval_s: float = 600.0
    """Seconds between checkpoints (cut at a step boundary every trainer agrees on)."""
    keep: int = 3
    """Newest checkpoints kept (0 = all)."""


def ps_checkpoint_env(cfg: PSCheckpointEnv) -> dict[str, str]:
    """FLEET_PS_CHECKPOINT_* for the trainers of a job with automatic checkpoints."""
    return {
        FLEET_PS_CHECKPOINT_DIR: cfg.dir,
        FLEET_PS_CHECKPOINT_INTERVAL: repr(float(cfg.interval_s)),
        FLEET_PS_CHECKPOINT_KEEP: str(cfg.keep),
    }


def read_ps_checkpoint_env(environ: Mapping[str, str] | None = None) -> PSCheckpointEnv | None:
    """The automatic-checkpoint settings (None when FLEET_PS_CHECKPOINT_DIR is unset)."""
    env = os.environ if environ is None else environ
    directory = env.get(FLEET_PS_CHECKPOINT_DIR, "")
    if not directory:
        return None
    raw = env.get(FLEET_PS_CHECKPOINT_INTERVAL) or "600"
    try:
        interval = float(raw)
    except ValueError:
        interval = -1.0
    if not interval > 0:
        raise EnvContractError(
            f"{FLEET_PS_CHECKPOINT_INTERVAL}={raw!r} must be a number of seconds > 0 "
            "(fleetrun --ps_checkpoint_interval sets it)"
        )
    keep = read_int(env, FLEET_PS_CHECKPOINT_KEEP)
    keep = 3 if keep is None else keep
    if keep < 0:
        raise EnvContractError(f"{FLEET_PS_CHECKPOINT_KEEP}={keep} must be >= 0 (0 = keep all)")
    return PSCheckpointEnv(directory, interval, keep)


@dataclass(frozen=True)
class PSLayout:
    """What the launcher on one node knows when it starts its share of a PS job."""

    run_id: str
    server_endpoints: tuple[str, ...]
    """``ip:port`` of every parameter server (the port is the one it serves on)."""
    trainer_endpoints: tuple[str, ...]
    """``ip:port`` of every trainer; trainer 0's port hosts the trainers' gloo store."""
    restart_count: int
    max_restarts: int
    backend: Backend
    log_dir: str
    error_dir: str
    job_name: str = "fleetrun"
    strategy_file: str | None = None
    heter_endpoints: tuple[str, ...] = ()
    """``ip:port`` of every heter worker (heterogeneous PS jobs; empty otherwise)."""
    heter_devices: tuple[str, ...] = ()
    """Each heter worker's device, by index (``cpu``, ``cuda``, ``cuda:N``)."""

    def server_error_file(self, index: int) -> str:
        return os.path.join(self.error_dir, f"error.server.{index}.json")

    def heter_error_file(self, index: int) -> str:
        return os.path.join(self.error_dir, f"error.heter.{index}.json")

    def trainer_error_file(self, trainer_id: int) -> str:
        return os.path.join(self.error_dir, f"error.{trainer_id}.json")

    def _common(self, err: str) -> dict[str, str]:
        return {
            "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(self.server_endpoints),
            "PADDLE_PSERVER_NUMS": str(len(self.server_endpoints)),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(self.trainer_endpoints),
            "PADDLE_TRAINERS_NUM": str(len(self.trainer_endpoints)),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_ERROR_FILE": err,
            FLEET_ERROR_FILE: err,
            FLEET_LOG_DIR: self.log_dir,
            FLEET_BACKEND: self.backend.value,
            FLEET_JOB_NAME: self.job_name,
            **({FLEET_STRATEGY: self.strategy_file} if self.strategy_file else {}),
            **(
                {PADDLE_HETER_TRAINER_IP_PORT_LIST: ",".join(self.heter_endpoints)}
                if self.heter_endpoints
                else {}
            ),
        }


def make_ps_server_env(layout: PSLayout, index: int, metrics_port: int = 0) -> dict[str, str]:
    """Env of parameter server ``index`` (TRAINING_ROLE=PSERVER, POD_IP + PADDLE_PORT)."""
    ip, _, port = layout.server_endpoints[index].rpartition(":")
    env = layout._common(layout.server_error_file(index))
    env.update(metrics_env(metrics_port))
    env.update({"TRAINING_ROLE": TrainingRole.PSERVER.value, "POD_IP": ip, "PADDLE_PORT": port})
    return env


def make_ps_heter_env(layout: PSLayout, index: int, metrics_port: int = 0) -> dict[str, str]:
    """Env of heter worker ``index`` (TRAINING_ROLE=HETER_TRAINER, POD_IP + PADDLE_PORT where
    it serves the CPU trainers, PADDLE_HETER_TRAINER_DEVICE)."""
    ip, _, port = layout.heter_endpoints[index].rpartition(":")
    env = layout._common(layout.heter_error_file(index))
    env.update(metrics_env(metrics_port))
    devices = layout.heter_devices
    device = devices[index] if index < len(devices) else (devices[-1] if devices else "cpu")
    env.update(
        {
            "TRAINING_ROLE": TrainingRole.HETER_TRAINER.value,
            "POD_IP": ip,
            "PADDLE_PORT": port,
            PADDLE_HETER_TRAINER_DEVICE: device,
        }
    )
    return env


def make_ps_trainer_env(
    layout: PSLayout, trainer_id: int, local_rank: int, local_world_size: int, metrics_port: int = 0
) -> dict[str, str]:
    """Env of PS trainer ``trainer_id``: the Paddle PS family plus RANK/WORLD_SIZE/MASTER_* for
    the trainers' own gloo group (barrier_worker, metrics), rooted at trainer 0's endpoint."""
    ip = layout.trainer_endpoints[trainer_id].rpartition(":")[0]
    master_addr, _, master_port = layout.trainer_endpoints[0].rpartition(":")
    env = layout._common(layout.trainer_error_file(trainer_id))
    env.update(metrics_env(metrics_port))
    world = str(len(layout.trainer_endpoints))
    env.update(
        {
            "TRAINING_ROLE": TrainingRole.TRAINER.value,
            "POD_IP": ip,
            "PADDLE_TRAINER_ID": str(trainer_id),
            "PADDLE_CURRENT_ENDPOINT": layout.trainer_endpoints[trainer_id],
            "PADDLE_RANK_IN_NODE": str(local_rank),
            "RANK": str(trainer_id),
            "WORLD_SIZE": world,
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": master_port,
        }
    )
    return env


__all__ = [
    "PSCheckpointEnv",
    "PSLayout",
    "make_ps_heter_env",
    "make_ps_server_env",
    "make_ps_trainer_env",
    "ps_checkpoint_env",
    "read_ps_checkpoint_env",
]
