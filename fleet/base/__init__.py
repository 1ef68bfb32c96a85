"""``fleet.base``: the trainer's runtime — what ``fleet.init`` established and the role queries.

Owns the :class:`~fleet.base.runtime.FleetRuntime` state (env contract, strategy, hybrid groups,
wrapped models/optimizers), the role queries (``worker_index``, ``worker_num``, ...), Paddle's
role maker, the hybrid topology (:mod:`fleet.base.topology`), and the trainer's data position
(:mod:`fleet.base.data_position`: passes and steps, what a resumed trainer skips), and async/half-async/GEO
PS trainers meeting through fleetrun's coordinator instead of a gloo group
(:mod:`fleet.base.coordination`: recorded rounds a restarted trainer replays). The error types of fleet are
:mod:`collective.errors`'s, re-exported here. Imports :mod:`fleet.strategy`,
:mod:`fleet.telemetry` and :mod:`collective` only: every other subpackage of fleet sits above it.
"""

from collective.errors import (
    ConfigError,
    FleetError,
    FleetNotImplementedError,
    PSError,
    WorkerFailedError,
)
from fleet.base.role_maker import PaddleCloudRoleMaker
from fleet.base.runtime import (
    FleetRuntime,
    barrier_worker,
    current_runtime,
    get_hybrid_communicate_group,
    get_runtime,
    init_runtime,
    is_first_worker,
    local_rank,
    worker_endpoints,
    worker_index,
    worker_num,
)
from fleet.base.topology import CommunicateTopology, HybridCommunicateGroup, build_topology

__all__ = [
    "CommunicateTopology",
    "ConfigError",
    "FleetError",
    "FleetNotImplementedError",
    "FleetRuntime",
    "HybridCommunicateGroup",
    "PSError",
    "PaddleCloudRoleMaker",
    "WorkerFailedError",
    "barrier_worker",
    "build_topology",
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
