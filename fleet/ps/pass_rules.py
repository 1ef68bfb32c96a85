"""The server's optimizer rules applied to a pass's rows on the trainer (:mod:`fleet.ps.pass_cache`).

On CPU the rule's own ``update`` (:mod:`ps_server.core.optimizers`) runs on numpy views of the
gathered rows: the same float32 arithmetic as the server, bit for bit. On CUDA SGD, Adagrad and
Adam run as torch operations in the same order (float32, the Adam step size in float64 as on
the server); any other registered rule round-trips through the CPU and its own ``update``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ps_server.core.optimizers import SGD, Adagrad, Adam, RowsMeta


def apply_rule(
    rule: Any,
    weights: torch.Tensor,
    state: torch.Tensor,
    grads: torch.Tensor,
    updates: torch.Tensor,
) -> None:
    """Update ``weights`` and ``state`` (``[n, dim]``, ``[n, state_dim]`` float32) in place from
    ``grads`` by ``rule``; ``updates``: int32 ``[n]`` updates of each row this pass, the current
    one included (the rule's ``RowsMeta.count``)."""
    if weights.device.type == "cpu" or type(rule) not in _TORCH_RULES:
        _numpy_update(rule, weights, state, grads, updates)
        return
    _TORCH_RULES[type(rule)](rule, weights, state, grads)
    if rule.weight_bounds is not None:
        weights.clamp_(rule.weight_bounds[0], rule.weight_bounds[1])


def _numpy_update(
    rule: Any,
    weights: torch.Tensor,
    state: torch.Tensor,
    grads: torch.Tensor,
    updates: torch.Tensor,
) -> None:
    cpu = weights.device.type == "cpu"
    w = weights.numpy() if cpu else weights.cpu().numpy()
    s = state.numpy() if cpu else state.cpu().numpy()
    g = grads.contiguous().cpu().numpy()
    n = w.shape[0]
    meta = RowsMeta(
        count=updates.cpu().numpy().astype(np.uint32), unseen_days=np.zeros(n, np.uint16)
    )
    rule.update(w, s, g, meta)
    if not cpu:
        weights.copy_(torch.from_numpy(w))
        state.copy_(torch.from_numpy(s))


def _sgd(rule: SGD, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
    weights.sub_(grads * float(np.float32(rule.lr)))


def _adagrad(
    rule: Adagrad, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor
) -> None:
    state.add_(grads * grads)
    std = state.sqrt().add_(float(np.float32(rule.eps)))
    weights.sub_((grads / std) * float(np.float32(rule.lr)))


def _adam(rule: Adam, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
    dim = weights.shape[1]
    b1, b2 = rule.betas
    m = state[:, :dim]
    v = state[:, dim : 2 * dim]
    step = state[:, 2 * dim]
    m.add_((grads - m) * float(np.float32(1.0 - b1)))
    v.mul_(float(np.float32(b2))).add_((grads * grads) * float(np.float32(1.0 - b2)))
    step.add_(1.0)
    t = step.to(torch.float64)
    step_size = (rule.lr / (1.0 - b1**t)).to(torch.float32)[:, None]
    bc2_sqrt = torch.sqrt(1.0 - b2**t).to(torch.float32)[:, None]
    denom = (v.sqrt() / bc2_sqrt).add_(float(np.float32(rule.eps)))
    weights.sub_(step_size * (m / denom))


_TORCH_RULES = {SGD: _sgd, Adagrad: _adagrad, Adam: _adam}
"""Rules with a torch form on CUDA (the rest round-trip through the CPU)."""


__all__ = ["apply_rule"]
