"""The strategy's per-model and per-optimizer features — sync batch norm, ASP pruning, AMP,
recompute, LARS/LAMB, gradient clipping — as two entry points that the composition
(``fleet.parallelize.compose``) calls:

* :func:`wrap_model_features` (before the data-parallel/sharding wrapper): BatchNorm layers to
  ``SyncBatchNorm`` over the data-parallel group (``sync_batch_norm``,
  :mod:`fleet.meta_parallel.sync_batch_norm`); eligible Linear/Conv weights pruned to 2:4
  (``asp``, :mod:`fleet.meta_optimizers.asp`; the optimizer side, re-applying the masks, is in
  the composition); names every parameter
  (``fleet_name``, for ``exclude_from_weight_decay``); recompute of the sub-modules named in
  ``recompute_configs.checkpoints`` (their inputs kept in host memory with
  ``recompute_configs.enable_offload``); AMP O2 (``use_pure_fp16``) casts the parameters to the
  low dtype (normalisation layers stay float32; under sharding stage 3 FSDP2's
  ``MixedPrecisionPolicy`` casts instead, see :mod:`fleet.parallelize.compose`); AMP runs the forward under autocast with the custom
  op lists. Forwards are wrapped on the instance, so ``state_dict`` keys do not change.
* :func:`wrap_optimizer_features` (on the user's optimizer, before the gradient-merge wrapper):
  LARS replaces a momentum SGD, LAMB an Adam/AdamW, keeping lr/momentum/betas/eps, as Paddle's
  meta-optimizers do; AMP O2 keeps float32 master weights in the optimizer
  (:class:`fleet.meta_optimizers.amp.MasterWeightOptimizer`); an optimizer carrying ``grad_clip`` (a
  :class:`fleet.meta_optimizers.clip.ClipGradByGlobalNorm`) clips over the hybrid topology before each update.

Both are idempotent (a second call with an already wrapped object returns it unchanged), so a
script may apply them itself and still pass the result to ``fleet.distributed_model`` /
``fleet.distributed_optimizer``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from collective.errors import ConfigError
from fleet.meta_optimizers import asp
from fleet.meta_optimizers.amp import MasterWeightOptimizer, autocast, torch_dtype
from fleet.meta_optimizers.clip import ClipGradByGlobalNorm
from fleet.meta_optimizers.lars_lamb import LAMB, LARS
from fleet.meta_parallel.pipeline_layer import PipelineLayer
from fleet.meta_parallel.recompute import OffloadSavedInputs, recompute
from fleet.meta_parallel.sync_batch_norm import convert_sync_batchnorm
from fleet.strategy import DistributedStrategy, sharding_stage

logger = logging.getLogger(__name__)

_MODEL_MARK = "_fleet_features"
_OPT_MARK = "_fleet_features"
_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


class _WrappedForward:
    """An instance-level ``forward``: ``wrap(module, inner, *args, **kwargs)`` where ``inner`` is
    the forward it replaces. A plain object (not a bound method) so ``deepcopy`` of the module copies
    it along with the module."""

    def __init__(self, module: nn.Module, wrap: Callable[..., Any], inner: Any) -> None:
        self.module, self.wrap, self.inner = module, wrap, inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = (
            self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)
        )
        return self.wrap(self.module, inner, *args, **kwargs)


def _wrap_forward(module: nn.Module, wrap: Callable[..., Any]) -> None:
    inner = module.__dict__.get("forward")
    module.forward = _WrappedForward(module, wrap, inner)  # type: ignore[method-assign]


def _recompute_forward(
    module: nn.Module, inner: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    return recompute(inner, *args, **kwargs)


class _OffloadedRecompute:
    """``recompute_configs.enable_offload``: the recomputed block's inputs (all the checkpoint
    keeps) wait for backward in host memory (:class:`~fleet.meta_parallel.recompute.
    OffloadSavedInputs`). ``offloaded_bytes`` / ``kept_bytes``: totals over every call (moved
    off the device / already on the host)."""

    def __init__(self) -> None:
        self.offloaded_bytes = 0
        self.kept_bytes = 0

    def __call__(
        self, module: nn.Module, inner: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        hooks = OffloadSavedInputs()
        with hooks:
            out = recompute(inner, *args, **kwargs)
        self.offloaded_bytes += hooks.offloaded_bytes
        self.kept_bytes += hooks.kept_bytes
        return out


class _AmpForward:
    """Runs the wrapped forward under the strategy's autocast (a picklable object)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __call__(
        self, module: nn.Module, inner: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        with autocast(self.config, _model_device_type(module)):  # where the model is now
            return inner(*args, **kwargs)


def _model_device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def wrap_model_features(
    model: nn.Module, strategy: DistributedStrategy, sync_bn_group: Any = None
) -> nn.Module:
    """Apply the model-side features of ``strategy`` to ``model``; returns the model to use
    (``model`` itself unless it is a BatchNorm layer that sync batch norm replaces).

    Order: BatchNorm → SyncBatchNorm over ``sync_bn_group`` (``sync_batch_norm``; first, so the
    wrappers below land on the layers that stay) → 2:4 pruning (``asp``, on the float32
    weights) → name parameters → recompute the checkpointed sub-modules → O2 cast → autocast the
    forward (outermost, so recomputed blocks replay under the same autocast state: torch's
    checkpoint records and restores it).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected a torch.nn.Module, got {type(model).__name__}", key="model")
    if getattr(model, _MODEL_MARK, False):
        return model
    if strategy.sync_batch_norm:
        model = convert_sync_batchnorm(model, sync_bn_group)
    if strategy.asp:
        pruned = asp.prune_model(model)
        logger.debug("asp: %d weight(s) pruned to 2:4: %s", len(pruned), list(pruned))
    for name, p in model.named_parameters():
        if not hasattr(p, "fleet_name"):
            p.fleet_name = name
    names = strategy.recompute_configs.checkpoints
    if strategy.recompute and not names and isinstance(model, PipelineLayer):
        # A layer list recomputes entry by entry (what the planner's recompute means): every
        # entry checkpointed unless the PipelineLayer chose its own recompute_interval.
        if model.recompute_interval == 0:
            model.recompute_interval = 1
        logger.debug("recompute every %d entries of the PipelineLayer", model.recompute_interval)
    elif strategy.recompute:
        if not names:
            raise ConfigError(
                "strategy.recompute is on but no sub-module is named; set "
                "strategy.recompute_configs = {'checkpoints': ['layers.0', ...]} (names from "
                "model.named_modules())",
                key="recompute_configs.checkpoints",
            )
        offload = strategy.recompute_configs.enable_offload
        modules = dict(model.named_modules())
        for name in names:
            if name not in modules or name == "":
                children = [n for n, _ in model.named_children()]
                raise ConfigError(
                    f"the model has no sub-module {name!r}; its children are {children} (any "
                    "dotted name from model.named_modules() works)",
                    key="recompute_configs.checkpoints",
                )
            _wrap_forward(modules[name], _OffloadedRecompute() if offload else _recompute_forward)
        logger.debug("recompute on %s%s", list(names), " (inputs offloaded)" if offload else "")
    if strategy.amp:
        cfg = strategy.amp_configs
        if cfg.use_pure_fp16 and sharding_stage(strategy) != 3:
            # (stage 3: FSDP2 keeps the float32 shards as master weights and casts for compute)
            cast_to_low_precision(model, torch_dtype(cfg.dtype))

        _wrap_forward(model, _AmpForward(cfg))
    object.__setattr__(model, _MODEL_MARK, True)
    return model


def cast_to_low_precision(model: nn.Module, dtype: torch.dtype) -> None:
    """AMP O2: floating parameters and buffers to ``dtype`` in place (the Parameter objects stay,
    so an optimizer built earlier still holds them); normalisation layers stay float32."""
    keep = {
        id(t)
        for m in model.modules()
        if isinstance(m, _NORM_TYPES)
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
    }
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and id(p) not in keep:
                p.data = p.data.to(dtype)
        for m in model.modules():
            for name, b in m.named_buffers(recurse=False):
                if b is not None and b.is_floating_point() and id(b) not in keep:
                    setattr(m, name, b.to(dtype))


def _swap_lars_lamb(optimizer: torch.optim.Optimizer, strategy: DistributedStrategy) -> Any:
    if strategy.lars and strategy.lamb:
        raise ConfigError(
            "strategy.lars and strategy.lamb are both on; LARS wraps a momentum "
            "SGD and LAMB an Adam: keep one",
            key="lars",
        )
    groups = [{k: v for k, v in g.items()} for g in optimizer.param_groups]
    if strategy.lars:
        if type(optimizer) is not torch.optim.SGD or not all(g["momentum"] > 0 for g in groups):
            raise ConfigError(
                f"LARS wraps a momentum SGD (Paddle: Momentum), got {optimizer!r}; use "
                "torch.optim.SGD(params, lr=..., momentum=0.9) or set strategy.lars = False",
                key="lars",
            )
        c = strategy.lars_configs
        new_groups = [
            {"params": g["params"], "lr": g["lr"], "momentum": g["momentum"]} for g in groups
        ]
        return LARS(
            new_groups,
            lr=groups[0]["lr"],
            momentum=groups[0]["momentum"],
            lars_coeff=c.lars_coeff,
            lars_weight_decay=c.lars_weight_decay,
            epsilon=c.epsilon,
            exclude_from_weight_decay=c.exclude_from_weight_decay,
        )
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(
            f"LAMB wraps an Adam (Paddle: Adam), got {optimizer!r}; use torch.optim.Adam(params, "
            "lr=...) or set strategy.lamb = False",
            key="lamb",
        )
    c = strategy.lamb_configs
    new_groups = [
        {"params": g["params"], "lr": g["lr"], "betas": g["betas"], "eps": g["eps"]} for g in groups
    ]
    return LAMB(
        new_groups,
        lr=groups[0]["lr"],
        betas=groups[0]["betas"],
        eps=groups[0]["eps"],
        lamb_weight_decay=c.lamb_weight_decay,
        exclude_from_weight_decay=c.exclude_from_weight_decay,
    )


def wrap_optimizer_features(
    optimizer: torch.optim.Optimizer, strategy: DistributedStrategy
) -> torch.optim.Optimizer:
    """Apply the optimizer-side features of ``strategy``; returns the optimizer to use.

    Order: LARS/LAMB swap → O2 master weights → global-norm clip hook on the optimizer that
    really updates (so it clips the float32 master gradients, after unscaling and merging).
    ``optimizer.grad_clip`` (a :class:`~fleet.meta_optimizers.clip.ClipGradByGlobalNorm`) is carried over.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}", key="optimizer"
        )
    if getattr(optimizer, _OPT_MARK, False):
        return optimizer
    grad_clip = getattr(optimizer, "grad_clip", None)
    opt: Any = optimizer
    if strategy.lars or strategy.lamb:
        opt = _swap_lars_lamb(opt, strategy)
        logger.info(
            "strategy %s: %s replaces %s",
            "lars" if strategy.lars else "lamb",
            type(opt).__name__,
            type(optimizer).__name__,
        )
    stepping = opt
    if strategy.amp and strategy.amp_configs.use_pure_fp16 and sharding_stage(strategy) != 3:
        # (stage 3: the optimizer already holds FSDP2's float32 shards, the master weights)
        opt = MasterWeightOptimizer(stepping)
    if grad_clip is not None:
        if not isinstance(grad_clip, ClipGradByGlobalNorm):
            raise ConfigError(
                f"optimizer.grad_clip must be a fleet.ClipGradByGlobalNorm, got {grad_clip!r}",
                key="grad_clip",
            )
        grad_clip.install(stepping)
        object.__setattr__(opt, "grad_clip", grad_clip)
    object.__setattr__(opt, _OPT_MARK, True)
    return opt


__all__ = ["cast_to_low_precision", "wrap_model_features", "wrap_optimizer_features"]
