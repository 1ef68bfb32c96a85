"""ASP — automatic n:m structured sparsity (2:4 by default), Paddle's ``strategy.asp`` and its
``sparsity`` helpers (``paddle.static.sparsity`` / ``paddle.incubate.asp``).

A weight is eligible when it belongs to an ``nn.Linear`` or an ``nn.Conv1d/2d/3d`` and its input
dimension (``in_features``, or ``in_channels / groups`` for a convolution, i.e. ``weight.shape[1]``)
divides by ``m``. Pruning keeps, in every group of ``m`` consecutive weights along that input
dimension (for a convolution: per output channel and kernel position), the ``n`` of largest
``|w|`` and zeroes the rest — the layout sparse tensor cores run (2:4).

::

    from fleet.meta_optimizers import asp
    asp.set_excluded_layers(model, ["head.weight"])   # optional: parameter names kept dense
    masks = asp.prune_model(model)                      # {name: mask}; weights now 2:4
    optimizer = asp.decorate(optimizer)                 # masks re-applied after every step
    asp.calculate_density(model[0].weight)              # 0.5

With ``strategy.asp = True``, ``fleet.distributed_model`` prunes (:func:`prune_model`) and
``fleet.distributed_optimizer`` decorates. Masks are kept per parameter object (not in
``state_dict``, whose keys stay the model's own); :func:`decorate` re-applies them after every
real update, so the stored weights stay n:m sparse (Paddle's ``OptimizerWithSparsityGuarantee``).

Where we differ from Paddle: Paddle's ``strategy.asp`` only decorates the optimizer and the script
calls ``prune_model`` itself; fleet also prunes at ``distributed_model`` (calling
:func:`prune_model` again changes nothing: pruned weights keep their masks). Only the greedy 1-D
mask (Paddle's ``mask_1d``) is offered.

Why not ``torch.ao.pruning``: its ``WeightNormSparsifier(sparse_block_shape=(1, 4),
zeros_per_block=2)`` computes the same mask for a Linear weight, but blocks run along the
*last* dimension (the kernel width of a convolution, not its input channels), and it keeps masks
as parametrizations — the stored weight stays dense, every forward multiplies by the mask, and
``state_dict`` keys change to ``parametrizations.weight.original``. Paddle's model (plain sparse
weights, masks re-applied after the step) is a topk over a reshaped view, written here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from collective.errors import ConfigError
from fleet.meta_optimizers.base import DelegatingOptimizer

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Keyed by object identity (tensors compare elementwise, so no plain weak dict).
_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_EXCLUDED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def calculate_density(x: torch.Tensor) -> float:
    """Fraction of non-zero entries of ``x`` (Paddle's ``calculate_density``)."""
    return float((x != 0).sum()) / max(x.numel(), 1)


def _grouped(weight: torch.Tensor, m: int) -> torch.Tensor:
    """``weight`` as rows of ``m`` consecutive entries along its input dimension (dim 1):
    ``[out, in]`` as is, ``[out, in, *kernel]`` as ``[out, *kernel, in]``."""
    return weight.movedim(1, -1).reshape(-1, m)


def create_mask(weight: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """The n:m mask of ``weight`` (same shape, dtype of ``weight``): in every ``m`` consecutive
    entries along dim 1 the ``n`` of largest ``|w|`` are 1."""
    _check_nm(n, m)
    if weight.dim() < 2 or weight.shape[1] % m:
        raise ConfigError(
            f"a weight of shape {tuple(weight.shape)} has no input dimension divisible by {m}",
            key="asp",
        )
    rows = _grouped(weight.detach(), m)
    keep = rows.abs().topk(n, dim=1).indices
    mask_rows = torch.zeros_like(rows).scatter_(1, keep, 1.0)
    return mask_rows.reshape(weight.movedim(1, -1).shape).movedim(-1, 1).contiguous()


def check_sparsity(weight: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """True when every ``m`` consecutive entries of ``weight`` along dim 1 hold at most ``n``
    non-zeros (Paddle's ``check_sparsity`` with ``mask_1d``)."""
    _check_nm(n, m)
    if weight.dim() < 2 or weight.shape[1] % m:
        return False
    rows = _grouped(weight.detach(), m)
    return bool(((rows != 0).sum(dim=1) <= n).all())


def set_excluded_layers(model: nn.Module, param_names: Iterable[str]) -> None:
    """Keep these parameters of ``model`` dense (names from ``model.named_parameters()``;
    Paddle's ``set_excluded_layers``, which names parameters as well). Adds to earlier calls."""
    names = {str(n) for n in param_names}
    known = {name for name, _ in model.named_parameters()}
    unknown = sorted(names - known)
    if unknown:
        raise ConfigError(
            f"the model has no parameter {unknown}; names come from model.named_parameters(), "
            f"e.g. {sorted(known)[:4]}",
            key="asp",
        )
    _EXCLUDED.setdefault(model, set()).update(names)


def reset_excluded_layers(model: nn.Module | None = None) -> None:
    """Forget the exclusions of ``model`` (every model's when None)."""
    if model is None:
        _EXCLUDED.clear()
    else:
        _EXCLUDED.pop(model, None)


def eligible_weights(model: nn.Module, m: int = 4) -> list[tuple[str, nn.Parameter]]:
    """``(name, weight)`` of every Linear/Conv weight of ``model`` that :func:`prune_model`
    would prune (input dimension divisible by ``m``, not excluded)."""
    excluded = _EXCLUDED.get(model, set())
    out = []
    for mod_name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, *_CONV)):
            continue
        weight = module.weight
        name = f"{mod_name}.weight" if mod_name else "weight"
        if weight.dim() >= 2 and weight.shape[1] % m == 0 and name not in excluded:
            out.append((name, weight))
    return out


def prune_model(
    model: nn.Module, n: int = 2, m: int = 4, with_mask: bool = True
) -> dict[str, torch.Tensor]:
    """Prune every eligible weight of ``model`` to n:m in place; returns ``{name: mask}``.

    ``with_mask``: keep the masks so :func:`decorate`'s optimizer re-applies them after each step
    (Paddle's argument). A weight pruned before keeps its mask (pruning again changes nothing).
    """
    _check_nm(n, m)
    masks = {}
    with torch.no_grad():
        for name, weight in eligible_weights(model, m):
            mask = _MASKS.get(weight)
            if mask is None:
                mask = create_mask(weight, n, m)
            weight.mul_(mask)
            if with_mask:
                _MASKS[weight] = mask
            masks[name] = mask
    return masks


def mask_of(param: torch.Tensor) -> torch.Tensor | None:
    """The mask :func:`prune_model` keeps for ``param``, or None."""
    return _MASKS.get(param)


class OptimizerWithSparsityGuarantee(DelegatingOptimizer):
    """Paddle's ``OptimizerWithSparsityGuarantee``: the wrapped optimizer's step, then every
    pruned parameter it updates multiplied by its mask again (:func:`decorate` builds it)."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The wrapped step, then the masks re-applied."""
        loss = self._inner.step(closure)
        with torch.no_grad():
            for group in self._inner.param_groups:
                for p in group["params"]:
                    mask = _MASKS.get(p)
                    if mask is not None:
                        p.mul_(mask)
        return loss


def decorate(optimizer: torch.optim.Optimizer) -> OptimizerWithSparsityGuarantee:
    """``optimizer`` keeping the pruned weights n:m sparse after every step (Paddle's
    ``sparsity.decorate``)."""
    if isinstance(optimizer, OptimizerWithSparsityGuarantee):
        return optimizer
    return OptimizerWithSparsityGuarantee(optimizer)


def _check_nm(n: int, m: int) -> None:
    if not 0 < n <= m:
        raise ConfigError(f"need 0 < n <= m, got n={n}, m={m}", key="asp")


__all__ = [
    "OptimizerWithSparsityGuarantee",
    "calculate_density",
    "check_sparsity",
    "create_mask",
    "decorate",
    "eligible_weights",
    "mask_of",
    "prune_model",
    "reset_excluded_layers",
    "set_excluded_layers",
]
