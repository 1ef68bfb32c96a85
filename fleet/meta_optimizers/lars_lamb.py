"""LARS and LAMB as ``torch.optim.Optimizer`` subclasses, with Paddle's update formulas.

torch ships neither, so they are written here (a per-parameter loop; the norms need one
reduction per tensor anyway). Both take ``exclude_from_weight_decay``: substrings of parameter
*names*. Names come from ``(name, parameter)`` pairs passed as ``params`` (what
``model.named_parameters()`` yields), or from the ``fleet_name`` attribute that
:func:`fleet.parallelize.features.wrap_model_features` puts on every parameter of the model it wraps;
a parameter with no known name is never excluded.

LARS (Paddle's ``LarsMomentumOptimizer`` / ``lars_momentum`` kernel), per parameter ``p`` with
gradient ``g``, velocity ``v``, learning rate ``lr``, momentum ``mu``, ``wd = lars_weight_decay``
(0 for excluded parameters)::

    local_lr = lr * lars_coeff * ||p|| / (||g|| + wd * ||p|| + epsilon)
               if wd > 0 and ||p|| > 0 and ||g|| > 0, else lr
    v = mu * v + local_lr * (g + wd * p)
    p = p - v

LAMB (You et al. 2019; Paddle's ``Lamb`` / ``lamb`` kernel), step ``t`` (from 1), ``wd =
lamb_weight_decay`` (0 for excluded parameters)::

    m = beta1 * m + (1 - beta1) * g            v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** t)               v_hat = v / (1 - beta2 ** t)
    r = m_hat / (sqrt(v_hat) + eps) + wd * p
    trust = ||p|| / ||r||  if ||p|| > 0 and ||r|| > 0, else 1
    p = p - lr * trust * r

Norms are of this rank's tensor: for a tensor-parallel shard (``is_distributed``) they are the
shard's norms, as in Paddle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from collective.errors import ConfigError

NAME_ATTR = "fleet_name"
"""Parameter attribute holding its qualified name in the model (set by wrap_model_features)."""


def _split_named(params: Iterable[Any]) -> tuple[list[Any], dict[int, str]]:
    """Parameters (or param-group dicts) and the names of those passed as (name, param) pairs."""
    names: dict[int, str] = {}
    items = list(params)
    out: list[Any] = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            names[id(item[1])] = item[0]
            out.append(item[1])
        elif isinstance(item, dict) and "params" in item:
            group = dict(item)
            plist, sub = _split_named(
                group["params"]
                if not isinstance(group["params"], torch.Tensor)
                else [group["params"]]
            )
            names.update(sub)
            group["params"] = plist
            out.append(group)
        else:
            out.append(item)
    return out, names


class _NamedOptimizer(torch.optim.Optimizer):
    """Shared name lookup for ``exclude_from_weight_decay``."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        plist, self._param_names = _split_named(params)
        super().__init__(plist, defaults)

    def param_name(self, p: torch.Tensor) -> str:
        """The name of ``p``: given with it, else its ``fleet_name`` attribute, else ``""``."""
        return self._param_names.get(id(p)) or getattr(p, NAME_ATTR, "")

    def excluded(self, p: torch.Tensor, patterns: tuple[str, ...]) -> bool:
        """True when a substring in ``patterns`` occurs in the name of ``p``."""
        name = self.param_name(p)
        return bool(name) and any(pat in name for pat in patterns)


def _check_lr(lr: float) -> None:
    if not lr >= 0:
        raise ConfigError(f"must be >= 0, got {lr}", key="lr")


class LARS(_NamedOptimizer):
    """Layer-wise adaptive rate scaling on momentum SGD (Paddle's ``LarsMomentumOptimizer``).

    ``params``: parameters, ``(name, parameter)`` pairs or param groups. ``lr``, ``momentum``:
    as SGD. ``lars_coeff``: trust coefficient. ``lars_weight_decay``: weight decay inside LARS.
    ``epsilon``: added to the trust-ratio denominator. ``exclude_from_weight_decay``: name
    substrings whose parameters get no decay and no trust ratio (plain momentum).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.001,
        momentum: float = 0.9,
        lars_coeff: float = 0.001,
        lars_weight_decay: float = 0.0005,
        epsilon: float = 0.0,
        exclude_from_weight_decay: Iterable[str] = (),
    ) -> None:
        _check_lr(lr)
        if not momentum >= 0:
            raise ConfigError(f"must be >= 0, got {momentum}", key="momentum")
        if not lars_coeff > 0:
            raise ConfigError(f"must be > 0, got {lars_coeff}", key="lars_configs.lars_coeff")
        if not lars_weight_decay >= 0:
            raise ConfigError(
                f"must be >= 0, got {lars_weight_decay}", key="lars_configs.lars_weight_decay"
            )
        if not epsilon >= 0:
            raise ConfigError(f"must be >= 0, got {epsilon}", key="lars_configs.epsilon")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "lars_coeff": lars_coeff,
            "lars_weight_decay": lars_weight_decay,
            "epsilon": epsilon,
            "exclude_from_weight_decay": tuple(exclude_from_weight_decay),
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LARS update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                wd = (
                    0.0
                    if self.excluded(p, group["exclude_from_weight_decay"])
                    else group["lars_weight_decay"]
                )
                p_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
                if wd > 0:
                    trust = group["lars_coeff"] * p_norm / (g_norm + wd * p_norm + group["epsilon"])
                    use = (p_norm > 0) & (g_norm > 0)
                    local_lr = torch.where(use, lr * trust, torch.full_like(trust, lr))
                else:
                    local_lr = torch.tensor(lr, dtype=p.dtype, device=p.device)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                v = state["momentum_buffer"]
                v.mul_(mu).add_((g + wd * p) * local_lr)
                p.sub_(v)
        return loss


class LAMB(_NamedOptimizer):
    """Layer-wise adaptive moments (Paddle's ``Lamb``): Adam's direction plus decoupled weight
    decay, scaled per parameter by the trust ratio ``||p|| / ||r||``.

    ``params``: parameters, ``(name, parameter)`` pairs or param groups. ``lr``, ``betas``,
    ``eps``: as Adam (Paddle's default eps 1e-6). ``lamb_weight_decay``: decoupled decay.
    ``exclude_from_weight_decay``: name substrings whose parameters get no decay.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.001,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        lamb_weight_decay: float = 0.01,
        exclude_from_weight_decay: Iterable[str] = (),
    ) -> None:
        _check_lr(lr)
        b1, b2 = betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ConfigError(f"both must be in [0, 1), got {betas}", key="betas")
        if not eps >= 0:
            raise ConfigError(f"must be >= 0, got {eps}", key="eps")
        if not lamb_weight_decay >= 0:
            raise ConfigError(
                f"must be >= 0, got {lamb_weight_decay}", key="lamb_configs.lamb_weight_decay"
            )
        defaults = {
            "lr": lr,
            "betas": (b1, b2),
            "eps": eps,
            "lamb_weight_decay": lamb_weight_decay,
            "exclude_from_weight_decay": tuple(exclude_from_weight_decay),
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LAMB update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                wd = (
                    0.0
                    if self.excluded(p, group["exclude_from_weight_decay"])
                    else group["lamb_weight_decay"]
                )
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat = m / (1 - b1**t)
                v_hat = v / (1 - b2**t)
                r = m_hat / (v_hat.sqrt() + eps)
                if wd:
                    r.add_(p, alpha=wd)
                p_norm, r_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(r)
                trust = torch.where(
                    (p_norm > 0) & (r_norm > 0), p_norm / r_norm, torch.ones_like(p_norm)
                )
                p.sub_(r * (lr * trust))
        return loss


__all__ = ["LAMB", "LARS", "NAME_ATTR"]
