"""``fleet.init``: the entry point that brings a trainer (or a PS process) up.

The top of fleet with the facade: it composes :mod:`fleet.base` (env contract, process group,
strategy, hybrid groups) and :mod:`fleet.ps` (the parameter-server roles), which must not know
each other.
"""

from __future__ import annotations

from fleet.base.role_maker import PaddleCloudRoleMaker
from fleet.base.runtime import FleetRuntime, init_runtime
from fleet.ps.runtime import start_ps
from fleet.strategy import DistributedStrategy


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
    from fleet.planner.auto import apply_to_runtime  # lazy: auto jobs only

    apply_to_runtime(runtime)


__all__ = ["init"]
