"""Gradient merge: the torch optimizer wrapper that ``fleet.distributed_optimizer`` returns.

Without ``strategy.gradient_merge`` the wrapper is a transparent pass-through: ``step``,
``zero_grad``, ``state_dict``, ``load_state_dict``, ``param_groups``, ``state`` all act on the
wrapped optimizer (and it is a ``torch.optim.Optimizer``, so LR schedulers and ``GradScaler``
accept it).

With ``gradient_merge_configs = {k_steps: K, avg: A}`` the user's loop stays
``loss.backward(); opt.step(); opt.zero_grad()``:

* micro-steps 1..K-1: ``step()`` only counts, ``zero_grad()`` does nothing, so gradients add up;
* micro-step K: the summed gradient is divided by K when ``avg``, the wrapped optimizer steps,
  and the next ``zero_grad()`` clears the gradients.

With data parallel the wrapper and the :class:`~fleet.parallelize.data_parallel.DataParallel` model that owns
its parameters share one :class:`GradientMergeState`, and the model skips DDP's gradient
all-reduce on micro-steps 1..K-1 (DDP's ``no_sync``): K micro-steps cost one all-reduce.

``fleet.distributed_optimizer`` (:mod:`fleet.parallelize.optimizer`) validates its argument
and hands it to :func:`fleet.parallelize.compose.parallelize` (features -> sharding -> this
wrapper, in that order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

import fleet.telemetry as telemetry
from collective.errors import ConfigError
from fleet.base.runtime import FleetRuntime
from fleet.meta_optimizers.base import DelegatingOptimizer

logger = logging.getLogger(__name__)


@dataclass
class GradientMergeState:
    """Micro-step counter shared by a gradient-merging optimizer and the model it trains."""

    k_steps: int
    """Micro-steps per optimizer update."""
    avg: bool
    """Divide the summed gradient by ``k_steps`` before the update."""
    micro_step: int = 0
    """Micro-steps taken since the last update (0 .. k_steps-1)."""

    def sync_this_step(self) -> bool:
        """True when the coming backward is the last of the cycle (gradients must be reduced)."""
        return self.micro_step + 1 >= self.k_steps


class DistributedOptimizer(DelegatingOptimizer):
    """What :func:`distributed_optimizer` returns: ``optimizer`` plus optional gradient merge.

    ``param_groups``, ``state``, ``defaults`` and the hook tables are the wrapped optimizer's own
    objects (:class:`~fleet.meta_optimizers.base.DelegatingOptimizer`), so an LR scheduler, a
    ``GradScaler``, a checkpoint or a step hook sees one optimizer; with gradient merge a step
    hook registered on the wrapper runs once per K micro-steps.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, grad_merge: GradientMergeState | None = None
    ) -> None:
        super().__init__(optimizer)
        self.grad_merge = grad_merge

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update the parameters — with gradient merge, only on every ``k_steps``-th call."""
        telemetry.on_step()  # a step ends here (fleet/telemetry.py)
        gm = self.grad_merge
        if gm is None:
            return self._inner.step(closure)
        if closure is not None:
            raise ConfigError(
                "optimizer.step(closure) cannot be combined with gradient_merge (the closure "
                "would re-evaluate the loss on a partial gradient); call step() without one",
                key="closure",
            )
        gm.micro_step += 1
        if gm.micro_step < gm.k_steps:
            return None
        gm.micro_step = 0
        if gm.avg:
            # Every parameter's gradient, not only param_groups': under sharding stage 2 the
            # optimizer lists only its owned parameters but reduces all gradients.
            all_params = getattr(self._inner, "all_params", None)
            params = (
                all_params()
                if callable(all_params)
                else [p for group in self._inner.param_groups for p in group["params"]]
            )
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(gm.k_steps)
        return self._inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients — with gradient merge, only right after an update."""
        if self.grad_merge is None or self.grad_merge.micro_step == 0:
            self._inner.zero_grad(set_to_none=set_to_none)

    def param_ids(self) -> set[int]:
        """``id()`` of every parameter this optimizer updates (with sharding: of every
        parameter it was built with, owned by this rank or not)."""
        inner_ids = getattr(self._inner, "param_ids", None)
        if callable(inner_ids):
            return set(inner_ids())
        return {id(p) for group in self._inner.param_groups for p in group["params"]}

    def __repr__(self) -> str:
        gm = self.grad_merge
        merge = f", gradient_merge(k_steps={gm.k_steps}, avg={gm.avg})" if gm else ""
        return f"DistributedOptimizer({self._inner!r}{merge})"


def link_gradient_merge(runtime: FleetRuntime) -> None:
    """Give every wrapped model the gradient-merge state of the optimizer that updates its
    parameters, so the model knows which backward passes may skip the all-reduce."""
    for opt in list(runtime.optimizers):
        if opt.grad_merge is None:
            continue
        ids = opt.param_ids()
        for model in list(runtime.models):
            if any(id(p) in ids for p in model.parameters()):
                model.grad_merge = opt.grad_merge


__all__ = [
    "DistributedOptimizer",
    "GradientMergeState",
    "link_gradient_merge",
]
