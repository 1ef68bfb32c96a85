"""``spawn``: start N trainer processes of a Python function on this machine, as
``paddle.distributed.spawn`` does.

Process management is torch's (``torch.multiprocessing.start_processes`` with the ``spawn`` start
method: it forwards a child's traceback and terminates the other children when one fails). What
this module adds is the env contract: each child gets exactly the variables fleetrun would give it
(:func:`collective.env.make_worker_env`), set in the child before ``func`` runs, so ``func`` calls
``collective.init_parallel_env()`` itself, as in Paddle. A failure becomes one
:class:`collective.errors.WorkerFailedError` naming the rank and carrying its traceback.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as tmp
from torch.multiprocessing import ProcessContext, ProcessExitedException, ProcessRaisedException

from collective.clean_exit import mark_failing
from collective.env import Backend, NodeLayout, find_free_port, make_worker_env
from collective.errors import ConfigError, WorkerFailedError

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_OPTIONS = ("backend", "log_dir")
"""The ``**options`` :func:`spawn` understands (Paddle's ips/gpus/xpus are multi-device only)."""


def _run_worker(
    local_rank: int, func: Callable[..., Any], args: Sequence[Any], envs: list[dict[str, str]]
) -> None:
    """Child entry point: install this rank's env contract, then run the user's function."""
    os.environ.update(envs[local_rank])
    try:
        func(*args)
    except BaseException:
        # torch's spawn wrapper catches the exception itself (no excepthook runs): mark the
        # process failing so that its exit leaves the groups alone (collective.clean_exit).
        mark_failing()
        raise


class SpawnContext:
    """The running children of one :func:`spawn` call (what ``join=False`` returns)."""

    def __init__(self, context: ProcessContext) -> None:
        self._context = context

    @property
    def processes(self) -> list[Any]:
        """The ``multiprocessing.Process`` of each rank, by rank."""
        return list(self._context.processes)

    def pids(self) -> list[int]:
        """Process ids of the children, by rank."""
        return self._context.pids()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: until something happens).

        Returns True when every child has exited successfully, False when some are still
        running. When a child failed, the others are terminated and :class:`WorkerFailedError`
        is raised with the failed rank and its traceback.
        """
        try:
            return bool(self._context.join(timeout))
        except ProcessRaisedException as exc:
            trace = exc.msg.split("following error:\n", 1)[-1].strip()
            raise WorkerFailedError(
                f"spawn: rank {exc.error_index} (pid {exc.error_pid}) raised an exception; the "
                f"other ranks were stopped. Traceback of rank {exc.error_index}:\n{trace}"
            ) from None
        except ProcessExitedException as exc:
            how = (
                f"was killed by signal {exc.signal_name}"
                if exc.signal_name
                else f"exited with code {exc.exit_code}"
            )
            raise WorkerFailedError(
                f"spawn: rank {exc.error_index} (pid {exc.error_pid}) {how} without a Python "
                "traceback (crash, os._exit or out of memory); the other ranks were stopped"
            ) from None

    def terminate(self, grace_s: float = 5.0) -> None:
        """Stop every child still alive: SIGTERM, then SIGKILL after ``grace_s`` seconds."""
        procs = self._context.processes
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(grace_s)
            if p.is_alive():
                logger.warning("spawn: pid %d ignored SIGTERM, sending SIGKILL", p.pid)
                p.kill()
                p.join()


def _resolve_nprocs(nprocs: int) -> int:
    if nprocs == -1:
        return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(
            f"{nprocs!r} is not a process count; pass a whole number >= 1, or -1 for one per "
            "CUDA device (1 on CPU)",
            key="nprocs",
        )
    return nprocs


def _check_options(options: dict[str, Any]) -> tuple[Backend, str]:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)}; spawn understands {', '.join(_OPTIONS)}",
            key="options",
        )
    raw = str(options.get("backend", Backend.AUTO.value)).lower()
    try:
        backend = Backend(raw)
    except ValueError:
        raise ConfigError(
            f"{options['backend']!r} is not one of auto, gloo, nccl", key="backend"
        ) from None
    log_dir = os.path.abspath(str(options.get("log_dir", "log")))
    return backend, log_dir


def make_spawn_envs(nprocs: int, backend: Backend, log_dir: str) -> list[dict[str, str]]:
    """The env contract of each of ``nprocs`` local trainers (rank = index) on 127.0.0.1."""
    run_id = f"spawn-{uuid.uuid4().hex[:8]}"
    layout = NodeLayout(
        run_id=run_id,
        num_nodes=1,
        nproc_per_node=nprocs,
        node_rank=0,
        master_addr=_HOST,
        master_port=find_free_port(_HOST),
        trainer_endpoints=tuple(f"{_HOST}:{find_free_port(_HOST)}" for _ in range(nprocs)),
        node_ip=_HOST,
        restart_count=0,
        max_restarts=0,
        backend=backend,
        log_dir=log_dir,
        # Not created here: only a worker using @record that fails writes into it.
        error_dir=os.path.join(log_dir, "errors", run_id),
        job_name="spawn",
    )
    return [make_worker_env(layout, r) for r in range(nprocs)]


def spawn(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = -1,
    join: bool = True,
    daemon: bool = False,
    **options: Any,
) -> SpawnContext:
    """Run ``func(*args)`` in ``nprocs`` new processes, ranks 0..nprocs-1 of one job.

    Each process gets the full env contract (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
    ``PADDLE_TRAINER_ID``, ...) before ``func`` runs; ``func`` calls
    ``collective.init_parallel_env()`` itself. ``func`` and ``args`` must be picklable (``func``
    defined at module level) and the calling script needs an ``if __name__ == "__main__":`` guard,
    as with any ``spawn`` start method.

    ``nprocs=-1``: one per CUDA device, 1 on CPU. ``options``: ``backend`` (auto | gloo | nccl,
    default auto) and ``log_dir`` (where error files of ``@record`` workers go, default ``log``).

    With ``join=True`` waits for all and returns the finished :class:`SpawnContext`; a failing
    child stops the others and raises :class:`WorkerFailedError` with its rank and traceback.
    With ``join=False`` returns the :class:`SpawnContext` at once; call its ``join()``.
    """
    n = _resolve_nprocs(nprocs)
    backend, log_dir = _check_options(options)
    envs = make_spawn_envs(n, backend, log_dir)
    logger.debug("spawn: %d processes of %r, backend %s", n, func, backend)
    raw = tmp.start_processes(
        _run_worker,
        args=(func, tuple(args), envs),
        nprocs=n,
        join=False,
        daemon=daemon,
        start_method="spawn",
    )
    context = SpawnContext(raw)
    if not join:
        return context
    try:
        while not context.join():
            pass
    except BaseException:
        # WorkerFailedError: torch already stopped the rest; KeyboardInterrupt etc.: we do.
        context.terminate()
        raise
    return context


__all__ = ["SpawnContext", "make_spawn_envs", "spawn"]
