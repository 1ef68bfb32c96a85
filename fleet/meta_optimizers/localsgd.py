"""Local SGD and adaptive local SGD: Paddle's ``strategy.localsgd`` / ``adaptive_localsgd`` on
torch's post-local SGD.

torch ships the algorithm: DDP's ``post_localSGD_hook`` all-reduces gradients for the first
``start_localSGD_iter`` steps and then hands each rank its own gradients, and
``PostLocalSGDOptimizer(optim, averager)`` averages the parameters after the local step whenever
the ``ModelAverager`` says so. fleet maps the strategy onto it:

* ``localsgd_configs = {k_steps: K, begin_step: B}`` — ``PostLocalSGDState(start_localSGD_iter=B,
  post_local_gradient_allreduce=False)`` on the model and
  ``PeriodicModelAverager(period=K, warmup_steps=B)``: B ordinary data-parallel steps, then one
  parameter all-reduce every K steps and none in between (Paddle's ``LocalSGDOptimizer``;
  ``fleet.parallelize.compose`` registers the hook);
* ``adaptive_localsgd_configs = {init_k_steps: K0, begin_step: B}`` — the same hook and
  :class:`AdaptiveModelAverager`, whose interval follows the loss (:func:`next_k_steps`).

Both are :class:`LocalSGDOptimizer`, a fleet optimizer wrapper whose step is torch's
``PostLocalSGDOptimizer.step`` and whose ``state_dict`` carries the averager's step (torch's).

Where we differ from Paddle: Paddle averages the parameters every step during the warm-up; torch
(and we) all-reduce the gradients then, which keeps the replicas equal just the same. Paddle
allows only SGD/Momentum under local SGD; torch's wrapper takes any optimizer, so we do too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.algorithms.model_averaging import utils as averaging_utils
from torch.distributed.algorithms.model_averaging.averagers import (
    ModelAverager,
    PeriodicModelAverager,
)

from collective.errors import ConfigError
from fleet.meta_optimizers.base import DelegatingOptimizer
from fleet.strategy.configs import ADAPTIVE_LOCALSGD_MAX_K_STEPS

MIN_K_STEPS = 1
"""Lower bound of the adaptive interval (Paddle's ``min_local_steps``)."""


def next_k_steps(
    init_k_steps: int, lr_0: float, loss_0: float, lr_now: float, loss_now: float
) -> int:
    """Paddle's adaptive local SGD interval (``AdaptiveLocalSGDOptimizer``)::

        k = ceil(sqrt(lr_0 * loss_now / (lr_now * loss_0) * init_k_steps)), clipped to [1, 16]

    ``lr_0`` / ``loss_0``: learning rate and (rank-averaged) loss of the first step; ``lr_now`` /
    ``loss_now``: those of the step that averages. The interval grows as the loss falls
    relative to the learning rate, following AdaComm (Wang & Joshi, 2019; the paper scales
    ``init_k_steps`` outside the square root, Paddle inside — we keep Paddle's). A ratio that is
    not a finite non-negative number (a zero first loss, a NaN) gives the smallest interval.
    """
    ratio = (lr_0 * loss_now) / (lr_now * loss_0) if lr_now * loss_0 != 0 else math.nan
    value = ratio * init_k_steps
    if not math.isfinite(value) or value < 0:
        return MIN_K_STEPS
    return max(MIN_K_STEPS, min(ADAPTIVE_LOCALSGD_MAX_K_STEPS, math.ceil(math.sqrt(value))))


class AdaptiveModelAverager(ModelAverager):
    """A torch ``ModelAverager`` with Paddle's adaptive interval.

    Averages at step ``warmup_steps`` (as ``PeriodicModelAverager``), then every ``k`` steps,
    ``k`` recomputed by :func:`next_k_steps` at each averaging from the loss averaged over the
    ranks — carried in the same all-reduce as the parameters. The loss is needed at the first
    step (averaged over the ranks once: one scalar all-reduce) and at every averaging step;
    simplest is :meth:`set_loss` before every ``step()`` (or ``step(closure)``). A step that needs
    it without one raises ConfigError naming ``adaptive_localsgd``.
    """

    def __init__(self, init_k_steps: int, warmup_steps: int, process_group: Any = None) -> None:
        super().__init__(process_group)
        self.init_k_steps = init_k_steps
        self.warmup_steps = warmup_steps
        self.k_steps = init_k_steps
        """The current interval."""
        self.next_average = warmup_steps
        """The step that averages next."""
        self.lr_0: float | None = None
        self.loss_0: float | None = None
        self._loss: torch.Tensor | None = None
        self.history: list[tuple[int, int]] = []
        """``(step, k_steps chosen there)`` of every averaging, for logs and tests."""

    def set_loss(self, loss: torch.Tensor | float) -> None:
        """The loss of the coming step (a tensor or a float)."""
        self._loss = torch.as_tensor(loss).detach().reshape(1).to(torch.float64)

    def average_parameters(self, params: Iterable[Any]) -> None:
        """Average ``params`` (parameter groups) if this step is due, then count the step."""
        groups = list(params)
        lr_now = float(groups[0]["lr"])
        if self.lr_0 is None:
            loss = self._take_loss()
            tdist.all_reduce(loss, group=self.process_group)
            self.lr_0, self.loss_0 = lr_now, float(loss) / tdist.get_world_size(self.process_group)
        if self.step == self.next_average:
            loss = self._take_loss().to(groups[0]["params"][0].dtype)
            tensors = [p for g in groups for p in g["params"]] + [loss]
            averaging_utils.average_parameters(iter(tensors), self.process_group)
            self.k_steps = next_k_steps(
                self.init_k_steps, self.lr_0, self.loss_0 or 0.0, lr_now, float(loss)
            )
            self.next_average = self.step + self.k_steps
            self.history.append((self.step, self.k_steps))
        self._loss = None
        self.step += 1

    def _take_loss(self) -> torch.Tensor:
        if self._loss is None:
            raise ConfigError(
                "adaptive local SGD needs the loss of the step that averages: call "
                "optimizer.set_loss(loss) before optimizer.step(), or pass a closure that "
                "returns the loss: optimizer.step(closure)",
                key="adaptive_localsgd",
            )
        return self._loss.clone()


class LocalSGDOptimizer(DelegatingOptimizer):
    """Paddle's ``LocalSGDOptimizer`` / ``AdaptiveLocalSGDOptimizer``: torch's
    ``PostLocalSGDOptimizer`` as a fleet optimizer wrapper (``param_groups``, ``state``,
    ``defaults`` and hooks are the wrapped optimizer's; see :mod:`fleet.meta_optimizers.base`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, averager: ModelAverager) -> None:
        super().__init__(optimizer)
        self.averager = averager
        # torch.distributed.optim loads FSDP, DTensor and sympy (~1.5 s): only when localsgd is on.
        from torch.distributed.optim import PostLocalSGDOptimizer

        self.post_local = PostLocalSGDOptimizer(optimizer, averager)

    def set_loss(self, loss: torch.Tensor | float) -> None:
        """The loss of the coming step, for adaptive local SGD's interval (ignored by plain
        local SGD)."""
        if isinstance(self.averager, AdaptiveModelAverager):
            self.averager.set_loss(loss)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The local step, then the parameter averaging when it is due. A ``closure`` is called
        once (with gradients enabled) and its loss kept for the adaptive interval."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.set_loss(loss)
        self.post_local.step()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict plus the averager's ``step`` (torch's format)."""
        return self.post_local.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load the wrapped optimizer's state and the averager's step."""
        self.post_local.load_state_dict(state_dict)


def build_localsgd_optimizer(
    optimizer: torch.optim.Optimizer, strategy: Any, process_group: Any = None
) -> LocalSGDOptimizer:
    """The :class:`LocalSGDOptimizer` of ``strategy.localsgd`` or ``adaptive_localsgd`` over
    ``process_group`` (the data-parallel group)."""
    if strategy.localsgd:
        cfg = strategy.localsgd_configs
        averager: ModelAverager = PeriodicModelAverager(
            period=cfg.k_steps, warmup_steps=cfg.begin_step, process_group=process_group
        )
    else:
        acfg = strategy.adaptive_localsgd_configs
        averager = AdaptiveModelAverager(acfg.init_k_steps, acfg.begin_step, process_group)
    return LocalSGDOptimizer(optimizer, averager)


def localsgd_begin_step(strategy: Any) -> int:
    """The warm-up length of whichever local SGD ``strategy`` turns on."""
    cfg = strategy.localsgd_configs if strategy.localsgd else strategy.adaptive_localsgd_configs
    return int(cfg.begin_step)


__all__ = [
    "MIN_K_STEPS",
    "AdaptiveModelAverager",
    "LocalSGDOptimizer",
    "build_localsgd_optimizer",
    "localsgd_begin_step",
    "next_k_steps",
]
