"""``heter_configs``: the strategy section of heterogeneous parameter-server jobs (:mod:`fleet.heter`).

Separate from :mod:`fleet.strategy.configs` only to keep files short; it is a section like the
others (typed keys, checked values, ``strategy.heter_configs = {"max_in_flight": 4}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from collective.typed_config import require
from fleet.strategy.configs import StrategySection


@dataclass(frozen=True)
class HeterConfig(StrategySection):
    """``heter_configs``: how CPU trainers and heter workers exchange micro-batches."""

    SECTION: ClassVar[str] = "heter_configs"

    max_in_flight: int = 0
    """The staleness bound: micro-batches a CPU trainer may have at its heter worker beyond the
    current one (async, ``a_sync=True``). 0 = each step waits for its gradients (the only value
    sync mode takes: the math then equals one process running both halves)."""
    recovery_timeout_s: float = 60.0
    """How long a CPU trainer retries the micro-batches in flight against a heter worker that
    is gone (fleetrun restarts it on its endpoint) before it fails naming the worker."""
    dense_pull_interval: int = 8
    """Async: a heter worker applies each gradient to its own copy of the dense parameters with
    the optimizer's rule, pushes it to the servers in the background, and pulls the servers'
    values (the other heter workers' updates) every this many pushes (Paddle's
    ``min_send_grad_num_before_recv``). Sync mode pulls after every round."""
    intra_op_threads: int = 0
    """Intra-op threads of a heter worker whose device is the CPU; 0 = the CPUs it may use
    (its affinity, capped by a container CPU quota), overriding the ``OMP_NUM_THREADS=1`` that
    fleetrun sets when processes share a node. A GPU heter worker keeps torch's default."""
    start_timeout_s: float = 300.0
    """How long a CPU trainer waits for its heter worker to serve at its first micro-batch
    (then an error naming the worker); and a heter worker's process that has not called
    ``fleet.run_heter_worker`` this long after ``fleet.init`` exits with an error (the script
    has no heter-worker branch)."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(
            self.max_in_flight >= 0, f"{p}.max_in_flight", f"must be >= 0, got {self.max_in_flight}"
        )
        require(
            self.dense_pull_interval >= 1,
            f"{p}.dense_pull_interval",
            f"must be >= 1 push, got {self.dense_pull_interval}",
        )
        require(
            self.intra_op_threads >= 0,
            f"{p}.intra_op_threads",
            f"must be >= 0 (0 = the CPUs the worker may use), got {self.intra_op_threads}",
        )
        for name in ("recovery_timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            require(value > 0, f"{p}.{name}", f"must be > 0 seconds, got {value}")


__all__ = ["HeterConfig"]
