"""``fleet.init``: the entry point that brings a trainer (or a PS process) up.

The top of fleet with the facade: it composes :mod:`fleet.base` (env contract, process group,
strategy, hybrid groups) and :mod:`fleet.ps` (the parameter-server roles), which must not know
each other.
"""

from __future__ import annotations

import dataclasses

from fleet.base.role_maker import PaddleCloudRoleMaker
from fleet.base.runtime import FleetRuntime, init_runtime
from fleet.base.topology import HybridCommunicateGroup, build_topology
from fleet.ps.runtime import start_ps
from fleet.strategy import DistributedStrategy, check_strategy_supported


def init(
    is_collective: bool | PaddleCloudRoleMaker = True,
    strategy: DistributedStrategy | None = None,
    role_maker: PaddleCloudRoleMaker | None = None,
) -> None:
    """Initialise fleet: parse the env contract, bring up the process group, keep the strategy.

    ``is_collective``: True for collective (data/hybrid-parallel) training; False for
    parameter-server mode (the process is a server or a trainer as fleetrun started it). A role
    maker passed positionally (Paddle's ``fleet.init(role)``) is accepted as ``role_maker``.
    ``strategy``: the :class:`DistributedStrategy`; None uses the job's strategy file
    (the ``strategy:`` of a fleetrun job file, FLEET_STRATEGY in the env contract) or the defaults.
    ``role_maker``: a :class:`~fleet.base.role_maker.PaddleCloudRoleMaker`; default reads the env.

    Calling it again re-validates and replaces the strategy (the process group stays up).

    ``strategy.auto``: once the process group is up, the planner's pick for
    ``strategy.auto_configs`` (:func:`fleet.planner.auto.resolve`) is written into the strategy
    object and the hybrid topology is built for it.
    """
    runtime = init_runtime(is_collective, strategy, role_maker)
    if not runtime.is_collective:
        start_ps(runtime.env, runtime.strategy)
    elif runtime.strategy.auto:
        _apply_auto(runtime)


def _apply_auto(runtime: FleetRuntime) -> None:
    """Resolve ``auto`` on every rank and rebuild what :func:`init_runtime` derived from the
    strategy (the data-parallel degree, the hybrid groups). The resolved keys are set on the
    strategy object itself, so the script's object, the runtime's and the job's later
    ``distributed_model`` / ``distributed_optimizer`` calls see the same strategy."""
    from fleet.planner.auto import remember_resolved, resolve, was_resolved  # auto jobs only

    if was_resolved(runtime.strategy):
        # fleet.init again with the strategy object an earlier call resolved: init_runtime
        # has built the groups of its (planned) degrees already
        return
    env = runtime.env
    resolved = resolve(runtime.strategy, env.num_nodes, env.local_world_size)
    check_strategy_supported(resolved, "fleet.init (strategy.auto)")
    for f in dataclasses.fields(resolved):
        setattr(runtime.strategy, f.name, getattr(resolved, f.name))
    remember_resolved(runtime.strategy)
    hybrid = runtime.strategy.hybrid_configs
    runtime.dp_degree = hybrid.resolve_dp_degree(env.world_size)
    runtime.hcg = (
        None
        if hybrid.mp_degree == hybrid.pp_degree == hybrid.sharding_degree == 1
        else HybridCommunicateGroup(build_topology(hybrid, env.world_size))
    )


__all__ = ["init"]
