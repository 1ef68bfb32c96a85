"""Global-norm gradient clipping that is correct under hybrid parallelism.

``torch.nn.utils.clip_grad_norm_`` sees only this rank's tensors. Under tensor parallelism a
split parameter (marked ``param.is_distributed = True`` by the layers of
:mod:`fleet.meta_parallel.tensor_parallel`, Paddle's attribute) holds one shard per mp rank, so
its contribution must be summed over the model-parallel group, while a replicated parameter
(a RowParallelLinear bias, a LayerNorm) must count once, not ``mp_degree`` times. Pipeline stages
hold disjoint layers (summed over the pipe group); sharding ranks that own disjoint parameter
partitions (ZeRO stage 1/2 optimizers clip their own partition: ``sharded_partition``) are
summed over the sharding group (stage 3: FSDP2's DTensor gradients, this rank's shard of each); data-parallel replicas hold equal gradients after the all-reduce and are not reduced.
The result equals ``clip_grad_norm_`` on the single-device model.

Use it directly::

    total_norm = fleet.clip_grad_norm_(model.parameters(), max_norm=1.0)

or, Paddle-style, attach a :class:`ClipGradByGlobalNorm` to the optimizer before
``fleet.distributed_optimizer`` (``optimizer.grad_clip = fleet.ClipGradByGlobalNorm(1.0)``):
:func:`fleet.parallelize.features.wrap_optimizer_features` then clips before every real update
(after loss-scale unscaling and gradient-merge averaging). Every rank must call it (collective).

Tied parameters shared by several pipeline stages (``SharedLayerDesc``) are counted once per
stage that holds them; exclude the duplicates (pass the parameters of one stage only) if that
matters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as tdist

from collective.errors import ConfigError
from fleet.base.runtime import current_runtime

DISTRIBUTED_ATTR = "is_distributed"
"""Parameter attribute: True when the tensor is this rank's shard of a tensor-parallel split."""


def is_distributed(p: torch.Tensor) -> bool:
    """True when ``p`` is marked as a tensor-parallel shard. (``torch.Tensor`` has a method of
    the same name, so the mark is the instance attribute set to exactly True.)"""
    return getattr(p, DISTRIBUTED_ATTR, False) is True


def _hcg_or_none() -> Any:
    runtime = current_runtime()
    return runtime.hcg if runtime is not None else None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's sharded gradients), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _collective_device() -> torch.device:
    """Where a rank without gradients (a sharding rank owning nothing) keeps its partial sums:
    the current GPU under NCCL, else the host."""
    if tdist.is_initialized() and tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(value: torch.Tensor, group: Any, op: Any) -> torch.Tensor:
    if group is not None and tdist.is_initialized() and tdist.get_world_size(group) > 1:
        tdist.all_reduce(value, op=op, group=group)
    return value


@torch.no_grad()
def get_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2.0,
    hcg: Any = None,
    sharded_partition: bool = False,
) -> torch.Tensor:
    """The global ``norm_type``-norm of the gradients of the whole (hybrid-parallel) model.

    ``hcg``: the :class:`~fleet.base.topology.HybridCommunicateGroup`; None uses the one ``fleet.init``
    built (none: this rank's gradients only, as ``clip_grad_norm_``). ``sharded_partition``: the
    given parameters are this rank's partition of the sharding group (sum over it).
    Returns a float32 scalar tensor on the gradients' device, equal on every rank.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ConfigError(f"must be > 0 or inf, got {norm_type}", key="norm_type")
    grads = [(p.grad, is_distributed(p)) for p in parameters if p.grad is not None]
    hcg = hcg if hcg is not None else _hcg_or_none()
    device = grads[0][0].device if grads else _collective_device()
    is_inf = math.isinf(norm_type)
    # [replicated, distributed] partial sums of |g|^p (or maxima for inf)
    parts = torch.zeros(2, dtype=torch.float32, device=device)
    for g, dist in grads:
        g = _local(g).detach().float()
        if is_inf:
            parts[int(dist)] = torch.maximum(parts[int(dist)], g.abs().max())
        else:
            parts[int(dist)] += (g.abs() ** norm_type).sum() if norm_type != 2.0 else (g * g).sum()
    op = tdist.ReduceOp.MAX if is_inf else tdist.ReduceOp.SUM
    if hcg is not None:
        dist_part = _reduce(parts[1:2].clone(), hcg.get_model_parallel_group(), op)
        total = parts[0:1].maximum(dist_part) if is_inf else parts[0:1] + dist_part
        total = _reduce(total, hcg.get_pipe_parallel_group(), op)
        if sharded_partition:
            total = _reduce(total, hcg.get_sharding_parallel_group(), op)
        total = total[0]
    else:
        total = parts.max() if is_inf else parts.sum()
    return total if is_inf else total ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    hcg: Any = None,
    sharded_partition: bool = False,
) -> torch.Tensor:
    """Scale the gradients so that their global norm (:func:`get_grad_norm`) is at most
    ``max_norm``; returns the norm before clipping (``torch.nn.utils.clip_grad_norm_``'s
    contract, including its ``max_norm / (norm + 1e-6)`` coefficient)."""
    if not max_norm > 0:
        raise ConfigError(f"must be > 0, got {max_norm}", key="max_norm")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = get_grad_norm(params, norm_type, hcg, sharded_partition)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            g = _local(p.grad)
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total


class ClipGradByGlobalNorm:
    """Paddle's ``ClipGradByGlobalNorm(clip_norm)``: put it on an optimizer as ``grad_clip`` and
    :func:`fleet.parallelize.features.wrap_optimizer_features` clips before each update."""

    def __init__(self, clip_norm: float) -> None:
        if not clip_norm > 0:
            raise ConfigError(f"must be > 0, got {clip_norm}", key="clip_norm")
        self.clip_norm = float(clip_norm)
        self.sharded_partition = False
        """True when the optimizer it clips holds one partition of a sharding group (set by
        ``fleet.distributed_optimizer`` under sharding stage 1/2): the norm sums over it."""
        self.last_norm: torch.Tensor | None = None
        """The global norm measured before the latest clip."""

    def __call__(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """Clip ``params`` in place over the fleet topology; returns the norm before."""
        self.last_norm = clip_grad_norm_(
            params, self.clip_norm, sharded_partition=self.sharded_partition
        )
        return self.last_norm

    def install(self, optimizer: torch.optim.Optimizer) -> Any:
        """Clip the parameters of ``optimizer`` before each of its steps (a step pre-hook);
        returns the hook handle."""

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self([p for group in opt.param_groups for p in group["params"]])

        return optimizer.register_step_pre_hook(hook)

    def __repr__(self) -> str:
        return f"ClipGradByGlobalNorm(clip_norm={self.clip_norm})"


__all__ = [
    "DISTRIBUTED_ATTR",
    "ClipGradByGlobalNorm",
    "clip_grad_norm_",
    "get_grad_norm",
    "is_distributed",
]
