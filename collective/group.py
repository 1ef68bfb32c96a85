"""Process-group set-up from the env contract, and group queries.

Thin over ``torch.distributed``: the default group is torch's default group, ``new_group`` returns
a torch ``ProcessGroup``; nothing is wrapped on the hot path.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence

import torch
import torch.distributed as tdist

from collective.clean_exit import install_atexit
from collective.env import Backend, WorkerEnv, read_worker_env
from collective.errors import ConfigError
from collective.store import make_store

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0


def resolve_backend(backend: str | Backend | None) -> str:
    """``auto`` → nccl when CUDA is available, else gloo. Explicit nccl without CUDA is an error."""
    b = Backend(str(backend).lower()) if backend else Backend.AUTO
    if b is Backend.AUTO:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if b is Backend.NCCL and not torch.cuda.is_available():
        raise ConfigError(
            "backend 'nccl' needs CUDA GPUs but torch.cuda.is_available() is False; "
            "use --backend gloo (or auto) on CPU",
            key="backend",
        )
    return b.value


def init_parallel_env(
    backend: str | None = None,
    timeout_s: float | None = None,
    env: WorkerEnv | None = None,
) -> WorkerEnv:
    """Initialise the default process group from the env contract and return the parsed env.

    ``backend``: ``auto`` | ``gloo`` | ``nccl``; default is what the launcher asked for
    (``FLEET_BACKEND``, itself defaulting to auto). ``timeout_s``: collective timeout in seconds
    (default 1800). Calling it again after success is a no-op. A standalone process (no launcher)
    gets a world of one. The process then exits through :func:`collective.clean_exit.shutdown`
    (at exit, or when called).
    """
    env = env or read_worker_env()
    install_atexit()
    if tdist.is_initialized():
        return env
    name = resolve_backend(backend or env.backend)
    if name == "nccl":
        torch.cuda.set_device(env.local_rank % max(torch.cuda.device_count(), 1))
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    # Our own store so rank 0 listens only on MASTER_ADDR (torch's would bind every interface).
    # A standalone process (no launcher) has no port: its store takes any free one.
    store = make_store(env.master_addr, env.master_port, env.rank == 0, timeout.total_seconds())
    master_port = env.master_port or int(store.port)
    tdist.init_process_group(
        backend=name, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    # torch.distributed and friends read these; keep them consistent for standalone runs.
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    logger.debug("process group %s up: rank %d of %d", name, env.rank, env.world_size)
    return env


def is_initialized() -> bool:
    """True once :func:`init_parallel_env` (or torch's init) has run."""
    return tdist.is_initialized()


def destroy_process_group() -> None:
    """Tear down the default group (no-op when not initialised)."""
    if tdist.is_initialized():
        tdist.destroy_process_group()


def get_rank(group: tdist.ProcessGroup | None = None) -> int:
    """Rank in ``group`` (default group); 0 when not initialised."""
    return tdist.get_rank(group) if tdist.is_initialized() else 0


def get_world_size(group: tdist.ProcessGroup | None = None) -> int:
    """Size of ``group`` (default group); 1 when not initialised."""
    return tdist.get_world_size(group) if tdist.is_initialized() else 1


def get_backend(group: tdist.ProcessGroup | None = None) -> str:
    """Backend name of ``group``."""
    return str(tdist.get_backend(group))


def new_group(
    ranks: Sequence[int] | None = None, backend: str | None = None, timeout_s: float | None = None
) -> tdist.ProcessGroup:
    """A sub-group of ``ranks`` (all when None). Every rank must call it, as with torch."""
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    return tdist.new_group(
        ranks=list(ranks) if ranks is not None else None, backend=backend, timeout=timeout
    )
