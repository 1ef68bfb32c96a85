"""The trainer's runtime state: what ``fleet.init`` established, and the role queries over it.

:func:`init_runtime` (called by :func:`fleet.init`, which adds the parameter-server start) parses the env contract (through :mod:`collective.env` only), brings up the default
process group (:func:`collective.group.init_parallel_env`) and keeps what later calls need in a
:class:`FleetRuntime`: the parsed :class:`~collective.env.WorkerEnv`, the active
:class:`~fleet.strategy.DistributedStrategy`, and weak references to the models and optimizers
that :func:`fleet.distributed_model` / :func:`fleet.distributed_optimizer` wrapped (so the two
can share gradient-merge state whatever order they are called in).

Every API function other than ``fleet.init`` raises :class:`~collective.errors.FleetError` before
it. Strategies that ask for a feature that has not landed yet raise
:class:`~collective.errors.FleetNotImplementedError` naming the strategy key
(:func:`fleet.strategy.check_strategy_supported`), at ``init`` and again where the strategy is
used.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as tdist

import fleet.telemetry as telemetry
from collective.comm import barrier
from collective.env import TrainingRole, WorkerEnv, find_free_port, read_worker_env
from collective.errors import ConfigError, FleetError
from collective.group import init_parallel_env
from fleet.base import coordination
from fleet.base.role_maker import PaddleCloudRoleMaker
from fleet.base.topology import HybridCommunicateGroup, build_topology
from fleet.strategy import DistributedStrategy, check_strategy_supported, require_strategy

logger = logging.getLogger(__name__)


@dataclass
class FleetRuntime:
    """What :func:`init` established for this process."""

    env: WorkerEnv
    """The parsed env contract (rank, world size, endpoints, ...)."""
    strategy: DistributedStrategy
    """The active strategy (the object the user passed; later changes to it are seen)."""
    dp_degree: int
    """Resolved data-parallel degree (world size / mp_degree)."""
    is_collective: bool = True
    """False in parameter-server mode (``fleet.init(is_collective=False)``)."""
    hcg: Any = None
    """The :class:`~fleet.base.topology.HybridCommunicateGroup` when any of ``mp_degree``,
    ``pp_degree``, ``sharding_degree`` is > 1, else None."""
    models: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    """Models wrapped by ``distributed_model`` that are still alive."""
    optimizers: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    """Optimizers wrapped by ``distributed_optimizer`` that are still alive."""


_runtime: FleetRuntime | None = None


def get_runtime(api: str) -> FleetRuntime:
    """The runtime state, or FleetError naming ``api`` when :func:`init` has not run."""
    if _runtime is None:
        raise FleetError(
            f"fleet.{api} was called before fleet.init(); call fleet.init(is_collective=True) "
            "(optionally with strategy=...) at the start of the training script"
        )
    return _runtime


def current_runtime() -> FleetRuntime | None:
    """The runtime state, or None before ``fleet.init`` (for code that also runs without it)."""
    return _runtime


def init_runtime(
    is_collective: bool | PaddleCloudRoleMaker = True,
    strategy: DistributedStrategy | None = None,
    role_maker: PaddleCloudRoleMaker | None = None,
) -> FleetRuntime:
    """``fleet.init`` up to the parameter-server start: parse the env contract, bring up the
    process group (collective: every trainer; PS mode: the trainers' gloo group, none on
    servers), keep the strategy. Returns the new :class:`FleetRuntime`; in PS mode
    (``is_collective=False``) :func:`fleet.init` then starts the PS side (:mod:`fleet.ps`).

    ``is_collective``: True for collective (data/hybrid-parallel) training; False (parameter
    server mode) raises FleetNotImplementedError until PS mode lands. A role maker passed
    positionally (Paddle's ``fleet.init(role)``) is accepted as ``role_maker``.
    ``strategy``: the :class:`DistributedStrategy`; None uses the job's strategy file
    (the ``strategy:`` of a fleetrun job file, FLEET_STRATEGY in the env contract) or the defaults.
    ``role_maker``: a :class:`~fleet.base.role_maker.PaddleCloudRoleMaker`; default reads the env.

    Calling it again re-validates and replaces the strategy (the process group stays up).
    """
    global _runtime
    if isinstance(is_collective, PaddleCloudRoleMaker):
        if role_maker is not None:
            raise ConfigError("given twice: positionally and as role_maker=", key="role_maker")
        role_maker, is_collective = is_collective, is_collective.is_collective
    elif not isinstance(is_collective, bool):
        raise ConfigError(f"expected True or False, got {is_collective!r}", key="is_collective")
    if role_maker is not None and not isinstance(role_maker, PaddleCloudRoleMaker):
        raise ConfigError(
            f"expected a fleet.base.role_maker.PaddleCloudRoleMaker, got {type(role_maker).__name__}",
            key="role_maker",
        )
    if role_maker is not None and role_maker.is_collective != is_collective:
        raise ConfigError(
            f"role_maker.is_collective={role_maker.is_collective} but "
            f"is_collective={is_collective}; make them agree",
            key="is_collective",
        )

    env = role_maker.worker_env() if role_maker is not None else read_worker_env()
    telemetry.start_from_env(env)  # /metrics when the launcher gave a port (fleet/telemetry.py)
    if is_collective and env.training_role is TrainingRole.PSERVER:
        raise ConfigError(
            "this process was started as a parameter server (TRAINING_ROLE=PSERVER) but the script "
            "called fleet.init(is_collective=True); use fleet.init(is_collective=False)",
            key="is_collective",
        )
    strategy = _resolve_strategy(strategy, env)
    check_strategy_supported(strategy, "fleet.init")
    if not is_collective:
        return _init_ps(env, strategy)
    if strategy.a_sync:
        raise ConfigError(
            "strategy.a_sync is a parameter-server setting but fleet.init(is_collective=True) "
            "was called; use fleet.init(is_collective=False) or set strategy.a_sync = False",
            key="a_sync",
        )
    dp_degree = strategy.hybrid_configs.resolve_dp_degree(env.world_size)

    if env.master_port == 0:
        # Standalone run (world of one): pick the rendezvous port here so that
        # worker_endpoints() can name it.
        env = _replace_port(env, find_free_port(env.master_addr))
    env = init_parallel_env(env=env)
    if tdist.get_world_size() != env.world_size or tdist.get_rank() != env.rank:
        raise ConfigError(
            f"the process group was already initialised as rank {tdist.get_rank()} of "
            f"{tdist.get_world_size()}, but the environment says rank {env.rank} of "
            f"{env.world_size}; do not call init_process_group yourself before fleet.init",
            key="world_size",
        )
    _runtime = FleetRuntime(
        env=env, strategy=strategy, dp_degree=dp_degree, hcg=_build_hybrid_group(strategy, env)
    )
    if env.rank == 0:
        logger.info(
            "fleet initialised: %d worker(s), data-parallel degree %d\n%s",
            env.world_size,
            dp_degree,
            strategy,
        )
    return _runtime


def _build_hybrid_group(strategy: DistributedStrategy, env: WorkerEnv) -> Any:
    """The hybrid topology's process groups when a tensor, pipeline or sharding degree is > 1,
    else None (pure data parallel needs no sub-groups). Collective: every rank builds every
    group."""
    hybrid = strategy.hybrid_configs
    if hybrid.mp_degree == 1 and hybrid.pp_degree == 1 and hybrid.sharding_degree == 1:
        return None
    return HybridCommunicateGroup(build_topology(hybrid, env.world_size))


def _init_ps(env: WorkerEnv, strategy: DistributedStrategy) -> FleetRuntime:
    """Parameter-server mode: trainers form a gloo group among themselves (barriers, metrics) —
    or, async/half-async/GEO under fleetrun with automatic checkpoints, meet through fleetrun's
    coordinator (:mod:`fleet.base.coordination`); servers have none. The PS state itself lives in :mod:`fleet.ps.runtime`."""
    global _runtime
    if not env.launched or not env.pserver_endpoints:
        raise ConfigError(
            "parameter-server mode needs servers: start the script with fleetrun --server_num S "
            "--worker_num W (PADDLE_PSERVERS_IP_PORT_LIST is not set)",
            key="is_collective",
        )
    if coordination.wanted(env, strategy):
        coordination.start(env)  # async/half-async/GEO under fleetrun with checkpoints: no gloo, so
        # a dead trainer can be restarted alone (fleet.base.coordination)
    elif env.training_role is TrainingRole.TRAINER:
        env = init_parallel_env(backend="gloo", env=env)
    _runtime = FleetRuntime(
        env=env, strategy=strategy, dp_degree=env.world_size, is_collective=False
    )
    return _runtime


def _resolve_strategy(strategy: DistributedStrategy | None, env: WorkerEnv) -> DistributedStrategy:
    """The explicit strategy, else the job's strategy file, else the defaults. When both are
    given they must agree — one silently overriding the other would drop what was asked for."""
    from_file = DistributedStrategy.from_yaml(env.strategy_file) if env.strategy_file else None
    if strategy is None:
        return from_file if from_file is not None else DistributedStrategy()
    require_strategy(strategy)
    if from_file is not None and from_file.to_dict() != strategy.to_dict():
        raise ConfigError(
            f"the job's strategy file {env.strategy_file!r} and the strategy passed to fleet.init "
            f"differ (file: {from_file!r}; script: {strategy!r}); keep one of them",
            key="strategy",
        )
    return strategy


def _replace_port(env: WorkerEnv, port: int) -> WorkerEnv:
    endpoint = env.current_endpoint or f"{env.master_addr}:{port}"
    return replace(env, master_port=port, current_endpoint=endpoint)


def worker_index() -> int:
    """This trainer's global rank (0 .. worker_num()-1)."""
    return get_runtime("worker_index()").env.rank


def worker_num() -> int:
    """Number of trainers in the job."""
    return get_runtime("worker_num()").env.world_size


def is_first_worker() -> bool:
    """True on the trainer of rank 0 (the one that should log and save)."""
    return get_runtime("is_first_worker()").env.rank == 0


def local_rank() -> int:
    """This trainer's rank on its node (use it to pick the GPU)."""
    return get_runtime("local_rank()").env.local_rank


def worker_endpoints(to_string: bool = False) -> list[str] | str:
    """``ip:port`` of every trainer by rank; joined with commas when ``to_string``.

    Known from the Paddle family of the env contract (fleetrun sets it); a standalone process
    reports its own rendezvous endpoint. A torchrun launch of more than one process does not
    name the trainers' endpoints, which raises FleetError.
    """
    env = get_runtime("worker_endpoints()").env
    if env.trainer_endpoints:
        endpoints = list(env.trainer_endpoints)
    elif env.world_size == 1:
        endpoints = [env.current_endpoint or f"{env.master_addr}:{env.master_port}"]
    else:
        raise FleetError(
            "worker endpoints are unknown: the launcher did not set PADDLE_TRAINER_ENDPOINTS "
            "(torchrun does not); start the job with fleetrun"
        )
    return ",".join(endpoints) if to_string else endpoints


def barrier_worker() -> None:
    """Block until every trainer has reached this call."""
    get_runtime("barrier_worker()")
    client = coordination.active()
    if client is not None:
        client.barrier("barrier_worker")
        return
    barrier()


def get_hybrid_communicate_group() -> HybridCommunicateGroup:
    """The :class:`HybridCommunicateGroup` that ``fleet.init`` built.

    FleetError before ``fleet.init`` or when the strategy asked for no hybrid axis
    (``mp_degree``, ``pp_degree`` and ``sharding_degree`` all 1: pure data parallel needs no
    sub-groups).
    """
    hcg = get_runtime("get_hybrid_communicate_group()").hcg
    if hcg is None:
        raise FleetError(
            "fleet.init built no hybrid topology: the strategy's hybrid_configs has mp_degree, "
            "pp_degree and sharding_degree all 1 (pure data parallel); set one of them > 1, e.g. "
            "strategy.hybrid_configs = {'mp_degree': 2}"
        )
    return hcg


__all__ = [
    "FleetRuntime",
    "barrier_worker",
    "current_runtime",
    "get_hybrid_communicate_group",
    "get_runtime",
    "init_runtime",
    "is_first_worker",
    "local_rank",
    "worker_endpoints",
    "worker_index",
    "worker_num",
]
