"""The DDP communication hook a strategy asks for, and :class:`CommCounter` to see what is sent.

torch DDP all-reduces each gradient bucket in float32 unless a communication hook replaces that
(``DistributedDataParallel.register_comm_hook``). The strategy picks at most one hook, all
torch's own except DGC's:

================================  ==========================================================
strategy                          hook (``torch.distributed.algorithms.ddp_comm_hooks``)
================================  ==========================================================
``fp16_allreduce``                ``fp16_compress_hook`` / ``bf16_compress_hook``
                                  (``fp16_allreduce_configs.dtype``): the bucket is cast to
                                  half precision, all-reduced, and copied back into the
                                  float32 gradients — half the bytes
``localsgd``, ``adaptive_localsgd``  ``post_localSGD_hook`` with
                                  ``post_local_gradient_allreduce=False``: all-reduce for
                                  ``begin_step`` steps, then nothing (the optimizer averages
                                  the models); with ``fp16_allreduce`` the warm-up all-reduce
                                  is the compress hook's
``dgc``                           :func:`fleet.meta_optimizers.dgc.dgc_hook`
================================  ==========================================================

:func:`register_comm_hook` is what ``fleet.parallelize.compose`` calls on the DDP model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

from collective.errors import ConfigError
from fleet.meta_optimizers.dgc import DGCState, dgc_hook
from fleet.meta_optimizers.localsgd import localsgd_begin_step
from fleet.strategy import AmpDtype, DistributedStrategy

Hook = Callable[[Any, tdist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class LocalSGDHookState:
    """State of :func:`localsgd_hook`: torch's ``PostLocalSGDState`` and the hook that runs the
    warm-up all-reduce (``allreduce_hook`` or a compress hook)."""

    post: PostLocalSGDState
    """torch's post-local SGD state (its ``iter`` counts the warm-up)."""
    warmup_hook: Hook
    """The hook of the warm-up steps, called with ``post.process_group``."""


def localsgd_hook(state, bucket):  # type: ignore[no-untyped-def]
    """``post_localSGD_hook`` whose warm-up all-reduce is ``state.warmup_hook``'s (so
    ``fp16_allreduce`` halves it), without casting the local gradients afterwards.
    ``state``: :class:`LocalSGDHookState`. (No annotations: DDP checks a hook's at run time, and
    this module's are strings.)"""
    post = state.post
    if post.iter < post.start_localSGD_iter:
        post.maybe_increase_iter(bucket)
        return state.warmup_hook(post.process_group, bucket)
    return post_localSGD_hook(post, bucket)


def bf16_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name unless NCCL >=
    2.10 or XCCL is there, but gloo all-reduces bfloat16 on CPU as well (NCCL jobs are checked
    in :func:`build_comm_hook`)."""
    return bf16_compress_hook(process_group, bucket)


def build_comm_hook(strategy: DistributedStrategy, process_group: Any) -> tuple[Any, Hook] | None:
    """``(state, hook)`` for ``ddp.register_comm_hook``, or None when the strategy keeps DDP's
    own float32 all-reduce."""
    compress: Hook = allreduce_hook
    if strategy.fp16_allreduce:
        low = strategy.fp16_allreduce_configs.dtype
        compress = bf16_hook if low is AmpDtype.BFLOAT16 else fp16_compress_hook
        if (
            low is AmpDtype.BFLOAT16
            and tdist.get_backend(process_group) == "nccl"
            and torch.cuda.nccl.version() < (2, 10)
        ):
            raise ConfigError(
                f"bfloat16 all-reduce needs NCCL >= 2.10, this torch has "
                f"{torch.cuda.nccl.version()}; use 'float16'",
                key="fp16_allreduce_configs.dtype",
            )
    if strategy.dgc:
        return DGCState(strategy.dgc_configs, process_group), dgc_hook
    if strategy.localsgd or strategy.adaptive_localsgd:
        post = PostLocalSGDState(
            process_group=process_group,
            subgroup=None,
            start_localSGD_iter=localsgd_begin_step(strategy),
            post_local_gradient_allreduce=False,
        )
        return LocalSGDHookState(post, compress), localsgd_hook
    if strategy.fp16_allreduce:
        return process_group, compress
    return None


def register_comm_hook(ddp: Any, strategy: DistributedStrategy, process_group: Any) -> Any:
    """Register the strategy's hook on ``ddp``; returns its state (None without one). The state
    is also kept as ``ddp.comm_hook_state`` (DGC's is linked to the optimizer from there)."""
    built = build_comm_hook(strategy, process_group)
    state = None
    if built is not None:
        state, hook = built
        ddp.register_comm_hook(state, hook)
    ddp.comm_hook_state = state
    return state


# ---- counting what is sent -------------------------------------------------------------------

# c10d op -> index of the argument holding what this rank contributes (a tensor or a list).
_INPUT_ARG = {
    "allreduce_": 0,
    "allreduce_coalesced_": 0,
    "broadcast_": 0,
    "reduce_": 0,
    "allgather_": 1,
    "_allgather_base_": 1,
    "allgather_into_tensor_coalesced_": 1,
    "reduce_scatter_": 1,
    "_reduce_scatter_base_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
    "alltoall_": 1,
    "alltoall_base_": 1,
    "send": 0,
    "gather_": 1,
    "scatter_": 1,
}


class CommCounter(TorchDispatchMode):
    """Counts the collectives issued inside a ``with`` block and the bytes this rank hands to
    them (its input tensors: what it puts on the wire, whatever the algorithm then does).

    Sees every collective that goes through torch's dispatcher — ``torch.distributed`` calls,
    DDP's own bucket all-reduces and comm hooks, model averaging — not what a backend does
    outside it. ``calls["allreduce"]``, ``bytes["allgather_base"]``; :attr:`total_bytes`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        """Collective name (``allreduce``, ``_allgather_base``, ...) -> calls."""
        self.bytes: dict[str, int] = defaultdict(int)
        """Collective name -> bytes of this rank's input tensors."""

    @property
    def total_bytes(self) -> int:
        """Bytes handed to every collective."""
        return sum(self.bytes.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        namespace, _, rest = str(func).partition(".")
        if namespace == "c10d":
            op = rest.split(".")[0]
            idx = _INPUT_ARG.get(op, 0)
            name = op.rstrip("_")
            self.calls[name] += 1
            self.bytes[name] += _nbytes(args[idx] if idx < len(args) else None)
        return func(*args, **(kwargs or {}))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


__all__ = [
    "CommCounter",
    "LocalSGDHookState",
    "bf16_hook",
    "build_comm_hook",
    "localsgd_hook",
    "register_comm_hook",
]
