"""Deep Gradient Compression (Lin et al., "Deep Gradient Compression: Reducing the Communication
Bandwidth for Distributed Training", ICLR 2018): Paddle's ``strategy.dgc`` on torch DDP.

What each rank does with the gradient ``g`` of a compressed tensor, every step from
``dgc_configs.rampup_begin_step`` on (before it: DDP's dense all-reduce and the optimizer's own
momentum, as Paddle):

1. *weight decay and local clipping* — ``g += weight_decay * p`` (the optimizer's weight decay
   moves here so it goes through momentum, as Paddle's ``regular_coeff``); with
   ``local_grad_clip_norm`` the local ``g`` is clipped to ``clip * sqrt(world_size)`` (the
   paper's ``N^-1/2`` rescaling, for gradients that are averaged rather than summed);
2. *momentum correction and local accumulation* — ``u = m * u + g; v = v + u`` (Nesterov:
   ``u = m * (u + g); v = v + u + g``); ``u`` starts from the optimizer's momentum buffer;
3. *top-k* — the ``k = int(numel * (1 - sparsity))`` entries of largest ``|v|`` (at least one)
   are sent; ``u`` and ``v`` are zeroed there (momentum factor masking), the rest waits;
4. *sparse exchange* — values and indices of every compressed tensor of a DDP bucket travel in
   one ``all_gather`` over the data-parallel group (float32 values and int32 indices packed in
   one float32 message: ``8 * k`` bytes instead of ``4 * numel``); the gradient applied is the
   sum of every rank's sparse vector divided by the world size;
5. *update* — :class:`DGCMomentumOptimizer` applies that gradient with plain SGD (the momentum
   is already in it), as Paddle's ``dgc_momentum`` op does after the ramp-up.

``sparsity`` is a warm-up schedule: step ``t`` after the start uses
``sparsity[min(t * len(sparsity) // rampup_step, len(sparsity) - 1)]`` (Paddle's
``get_period_sparcity``). Tensors under :data:`DGC_MIN_NUMEL` elements or not float32 are
all-reduced densely and keep the optimizer's momentum (Paddle's ``_is_use_dgc``).

Built as a DDP communication hook (:func:`dgc_hook`, the way torch ships PowerSGD), so the
exchange of a bucket overlaps the rest of backward; the per-tensor state lives in
:class:`DGCState` keyed by parameter, so DDP's bucket rebuild after the first step does not
disturb it. The optimizer side is :class:`DGCMomentumOptimizer`; ``fleet.parallelize.compose``
links the two (:meth:`DGCMomentumOptimizer.attach`).

Where we differ from Paddle: Paddle's DGC needs CUDA and static graphs; this runs on any device
and backend that has ``all_gather``. Paddle accepts ``paddle.optimizer.Momentum`` only; we accept
``torch.optim.SGD`` with ``momentum > 0`` (optionally Nesterov and weight decay; no dampening, no
``maximize``) and refuse every other optimizer naming ``dgc``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist

from collective.errors import ConfigError
from fleet.meta_optimizers.base import DelegatingOptimizer
from fleet.strategy.configs import DGCConfig

DGC_MIN_NUMEL = 16384
"""Tensors with fewer elements are all-reduced densely (Paddle's ``_is_use_dgc`` threshold)."""


# ---- the math, pure functions (unit-tested in one process) -----------------------------------


def sparsity_at(steps_since_begin: int, rampup_step: int, schedule: Sequence[float]) -> float:
    """The sparsity of the warm-up ``schedule`` at ``steps_since_begin`` (>= 0) steps after
    ``rampup_begin_step``: ``schedule[min(t * len // rampup_step, len - 1)]``."""
    idx = steps_since_begin * len(schedule) // rampup_step
    return float(schedule[min(idx, len(schedule) - 1)])


def top_k_count(numel: int, sparsity: float) -> int:
    """How many entries of a ``numel``-element tensor are sent: ``int(numel * (1 - sparsity))``,
    at least 1."""
    return max(1, int(numel * (1.0 - sparsity)))


def accumulate_(
    u: torch.Tensor, v: torch.Tensor, g: torch.Tensor, momentum: float, nesterov: bool
) -> None:
    """Momentum correction and local accumulation, in place: ``u = m*u + g; v += u``
    (Nesterov: ``u = m*(u + g); v += u + g``)."""
    if nesterov:
        u.add_(g).mul_(momentum)
        v.add_(u).add_(g)
    else:
        u.mul_(momentum).add_(g)
        v.add_(u)


def select_top_k_(u: torch.Tensor, v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of largest ``|v|``: ``(values, indices)``; ``u`` and ``v`` are zeroed
    there (momentum factor masking)."""
    indices = v.abs().topk(k, sorted=False).indices
    values = v[indices]
    v[indices] = 0
    u[indices] = 0
    return values, indices


def scatter_mean(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """The mean over ranks of the sparse vectors ``(values[r], indices[r])`` (both
    ``[world, k]``), as a dense ``numel``-element tensor."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    out.index_add_(0, indices.reshape(-1), values.reshape(-1))
    return out.div_(values.shape[0])


def is_compressed(p: torch.Tensor) -> bool:
    """True when DGC compresses ``p``'s gradient (float32, at least :data:`DGC_MIN_NUMEL`)."""
    return p.dtype == torch.float32 and p.numel() >= DGC_MIN_NUMEL


# ---- the state shared by the hook and the optimizer ------------------------------------------


@dataclass
class _Hyper:
    momentum: float
    nesterov: bool
    weight_decay: float


@dataclass
class DGCState:
    """What :func:`dgc_hook` keeps between steps (one per DDP model)."""

    config: DGCConfig
    """The strategy's ``dgc_configs``."""
    process_group: Any = None
    """The data-parallel group (None: the default group)."""
    iter: int = 0
    """Backward passes seen (the step counter of the warm-up schedule)."""
    u: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    """Momentum-corrected velocity per compressed parameter."""
    v: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    """Accumulated unsent gradient per compressed parameter."""
    sparse_params: list[torch.Tensor] = field(default_factory=list)
    """Parameters whose gradient of the last backward came through the sparse exchange."""
    sparse_iter: int = -1
    """The ``iter`` that ``sparse_params`` belong to."""
    hyper: dict[torch.Tensor, _Hyper] = field(default_factory=dict)
    """Momentum, Nesterov and weight decay per parameter, from the attached optimizer."""
    optimizer_state: Any = None
    """The attached optimizer's ``state`` (its momentum buffers seed ``u``)."""

    def world_size(self) -> int:
        """Ranks of the data-parallel group."""
        return tdist.get_world_size(self.process_group)

    def buffers(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(u, v)`` of ``p`` (flat), created at first use: ``u`` from the optimizer's momentum
        buffer when it has one (Paddle reuses the velocity), ``v`` zero."""
        if p not in self.u:
            buf = (self.optimizer_state or {}).get(p, {}).get("momentum_buffer")
            self.u[p] = (
                buf.detach().reshape(-1).clone()
                if buf is not None
                else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            )
            self.v[p] = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        return self.u[p], self.v[p]


# ---- the DDP communication hook --------------------------------------------------------------


def dgc_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook of DGC: dense all-reduce before ``rampup_begin_step``, then the
    sparse exchange of the module docstring (register with
    ``ddp.register_comm_hook(state, dgc_hook)``). ``state``: :class:`DGCState`; ``bucket``: a
    ``GradBucket``; returns a future of the bucket's averaged gradient. (No annotations: DDP
    checks a hook's at run time, and this module's are strings.)"""
    step = state.iter
    if bucket.is_last():  # the last bucket of this backward (torch's post-local SGD habit)
        state.iter += 1
    cfg = state.config
    buffer, group = bucket.buffer(), state.process_group
    world = state.world_size()
    if step < cfg.rampup_begin_step:
        return _all_reduce_mean(buffer, group, world)
    if state.sparse_iter != step:
        state.sparse_iter, state.sparse_params = step, []
    sparsity = sparsity_at(step - cfg.rampup_begin_step, cfg.rampup_step, cfg.sparsity)
    sparse: list[tuple[torch.Tensor, int, int, int]] = []  # (param, offset, numel, k)
    dense: list[tuple[int, int]] = []
    offset = 0
    for p in bucket.parameters():
        n = p.numel()
        if is_compressed(p):
            sparse.append((p, offset, n, top_k_count(n, sparsity)))
        else:
            dense.append((offset, n))
        offset += n
    futures: list[torch.futures.Future[Any]] = []
    if sparse:
        message = torch.cat(
            [_compress(state, p, buffer[o : o + n], k, world) for p, o, n, k in sparse]
        )
        gathered = torch.empty(world * message.numel(), dtype=message.dtype, device=message.device)
        futures.append(
            tdist.all_gather_single(gathered, message, group=group, async_op=True).get_future()
        )
        state.sparse_params.extend(p for p, _, _, _ in sparse)
    if dense:
        flat = torch.cat([buffer[o : o + n] for o, n in dense]).div_(world)
        futures.append(tdist.all_reduce(flat, group=group, async_op=True).get_future())

    def decode(_: Any) -> torch.Tensor:
        if sparse:
            rows = gathered.view(world, -1)
            base = 0
            for _p, o, n, k in sparse:
                values = rows[:, base : base + k]
                indices = rows[:, base + k : base + 2 * k].contiguous().view(torch.int32).long()
                buffer[o : o + n].copy_(scatter_mean(values, indices, n))
                base += 2 * k
        if dense:
            parts = flat.split([n for _, n in dense])
            for (o, n), part in zip(dense, parts):
                buffer[o : o + n].copy_(part)
        return buffer

    return torch.futures.collect_all(futures).then(decode)


def _compress(
    state: DGCState, p: torch.Tensor, grad: torch.Tensor, k: int, world: int
) -> torch.Tensor:
    """Steps 1-3 for one tensor; its part of the message: ``k`` values, then ``k`` int32
    indices reinterpreted as float32."""
    hyper = state.hyper.get(p)
    if hyper is None:
        raise ConfigError(
            "strategy.dgc compresses this model's gradients but no DGC optimizer is attached; "
            "wrap the optimizer with fleet.distributed_optimizer(torch.optim.SGD(..., "
            "momentum=0.9)) before the first backward",
            key="dgc",
        )
    g = grad
    if hyper.weight_decay:
        g = g + hyper.weight_decay * p.detach().reshape(-1)
    clip = state.config.local_grad_clip_norm
    if clip > 0:
        limit = clip * math.sqrt(world)
        norm = float(g.norm())
        if norm > limit:
            g = g * (limit / norm)
    u, v = state.buffers(p)
    accumulate_(u, v, g, hyper.momentum, hyper.nesterov)
    values, indices = select_top_k_(u, v, k)
    return torch.cat([values, indices.to(torch.int32).view(torch.float32)])


def _all_reduce_mean(
    buffer: torch.Tensor, group: Any, world: int
) -> torch.futures.Future[torch.Tensor]:
    buffer.div_(world)
    work = tdist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# ---- the optimizer side ----------------------------------------------------------------------


def check_dgc_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """ConfigError naming ``dgc`` unless ``optimizer`` is a momentum SGD DGC can correct."""
    ok = type(optimizer) is torch.optim.SGD and all(
        g["momentum"] > 0 and g["dampening"] == 0 and not g.get("maximize", False)
        for g in optimizer.param_groups
    )
    if not ok:
        raise ConfigError(
            f"DGC's momentum correction needs a momentum SGD (Paddle: Momentum), got "
            f"{optimizer!r}; use torch.optim.SGD(params, lr=..., momentum=0.9) (dampening 0, "
            "Nesterov and weight decay allowed) or set strategy.dgc = False",
            key="dgc",
        )


class DGCMomentumOptimizer(DelegatingOptimizer):
    """Paddle's ``DGCMomentumOptimizer`` around a ``torch.optim.SGD`` with momentum.

    Steps where the gradients came densely (before ``rampup_begin_step``, and for tensors DGC
    does not compress) are the wrapped SGD's own, momentum and weight decay included. For the
    compressed tensors of a sparse step the exchanged gradient already holds momentum and weight
    decay: they get ``p -= lr * grad`` and the wrapped SGD skips them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        check_dgc_optimizer(optimizer)
        super().__init__(optimizer)
        self.dgc_state: DGCState | None = None

    def attach(self, state: DGCState) -> None:
        """Share ``state`` with the model's :func:`dgc_hook`: it learns momentum, Nesterov and
        weight decay per parameter, and the momentum buffers that seed ``u``."""
        for group in self._inner.param_groups:
            hyper = _Hyper(group["momentum"], bool(group["nesterov"]), group["weight_decay"])
            for p in group["params"]:
                state.hyper[p] = hyper
        state.optimizer_state = self._inner.state
        self.dgc_state = state

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update: the wrapped SGD for dense gradients, plain SGD for the sparse ones."""
        state = self.dgc_state
        sparse = (
            state.sparse_params if state is not None and state.sparse_iter == state.iter - 1 else []
        )
        if not sparse:
            return self._inner.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr = {p: g["lr"] for g in self._inner.param_groups for p in g["params"]}
        grads = [(p, p.grad) for p in sparse if p.grad is not None]
        for p, _ in grads:
            p.grad = None  # the wrapped SGD skips parameters without a gradient
        try:
            self._inner.step()
        finally:
            with torch.no_grad():
                for p, g in grads:
                    p.grad = g
                    p.add_(g, alpha=-lr[p])
        state.sparse_params = []  # type: ignore[union-attr]
        return loss


def find_dgc_optimizer(optimizer: Any) -> DGCMomentumOptimizer | None:
    """The :class:`DGCMomentumOptimizer` inside a chain of fleet optimizer wrappers, or None."""
    while optimizer is not None:
        if isinstance(optimizer, DGCMomentumOptimizer):
            return optimizer
        optimizer = optimizer.__dict__.get("_inner")
    return None


__all__ = [
    "DGC_MIN_NUMEL",
    "DGCMomentumOptimizer",
    "DGCState",
    "accumulate_",
    "check_dgc_optimizer",
    "dgc_hook",
    "find_dgc_optimizer",
    "is_compressed",
    "scatter_mean",
    "select_top_k_",
    "sparsity_at",
    "top_k_count",
]
