"""Activation recompute (``fleet.utils.recompute``): torch's non-reentrant
``torch.utils.checkpoint`` that also replays the tensor-parallel RNG tracker.

torch's checkpoint restores the *global* CPU/CUDA generator before recomputing, but the named
states of :func:`fleet.meta_parallel.get_rng_state_tracker` live outside torch: dropout run under
``tracker.rng_state()`` during the recompute would draw from where the forward left the state and
produce a different mask (wrong gradients, silently). :func:`recompute` snapshots the tracker's
states when the forward runs and, through checkpoint's ``context_fn``, swaps the snapshot in for
the recompute and the live states back afterwards.

Only the non-reentrant implementation is offered (``use_reentrant=True`` raises): it supports
``context_fn``, keyword arguments and inputs that do not require grad.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Self

import torch
from torch.utils.checkpoint import checkpoint

from collective.errors import ConfigError
from fleet.meta_parallel.random import get_rng_state_tracker


@contextlib.contextmanager
def _tracker_states(states: dict[str, torch.Tensor]) -> Iterator[None]:
    tracker = get_rng_state_tracker()
    live = tracker.get_states_tracker()
    tracker.set_states_tracker(states)
    try:
        yield
    finally:
        tracker.set_states_tracker(live)


def recompute(
    function: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    use_reentrant: bool = False,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its intermediate activations; backward
    runs it again to rebuild them (Paddle's ``fleet.utils.recompute``).

    ``preserve_rng_state``: replay the same random numbers in the recompute — torch's global
    generators and the tensor-parallel tracker states — so dropout masks match. Without grad
    (``torch.no_grad()`` / eval) the function simply runs.
    """
    if use_reentrant:
        raise ConfigError(
            "only the non-reentrant recompute is supported (it replays the tensor-parallel RNG "
            "tracker through checkpoint's context_fn); drop use_reentrant=True",
            key="use_reentrant",
        )
    if not callable(function):
        raise ConfigError(
            f"expected a callable (module or function), got {function!r}", key="function"
        )
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if preserve_rng_state:
        snapshot = get_rng_state_tracker().get_states_tracker()

        def context_fn() -> tuple[Any, Any]:
            return contextlib.nullcontext(), _tracker_states(snapshot)
    else:

        def context_fn() -> tuple[Any, Any]:
            return contextlib.nullcontext(), contextlib.nullcontext()

    return checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        **kwargs,
    )


class OffloadSavedInputs(torch.autograd.graph.saved_tensors_hooks):
    """Keep the tensors autograd saves in the block on the host until backward needs them
    (``recompute_configs.enable_offload``): around :func:`recompute` those are the block's
    inputs (the non-reentrant checkpoint saves its inputs under the caller's hooks and nothing
    else), so the device holds no activation of the block between forward and backward.

    torch's ``torch.autograd.graph.save_on_cpu`` with one difference: a tensor already in host
    memory is kept as it is (save_on_cpu copies it too, which on a CPU model doubles what it
    saves). ``pin_memory`` defaults to True when CUDA is there (asynchronous copies back).
    ``offloaded_bytes`` counts what was moved off the device.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.offloaded_bytes = 0
        self.kept_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        if t.device.type == "cpu":
            self.kept_bytes += t.numel() * t.element_size()
            return t.device, t
        host = torch.empty(
            t.size(), dtype=t.dtype, layout=t.layout, pin_memory=self.pin and not t.is_sparse
        )
        host.copy_(t)
        self.offloaded_bytes += t.numel() * t.element_size()
        return t.device, host

    @staticmethod
    def _unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, t = packed
        return t if t.device == device else t.to(device, non_blocking=True)


class SavedTensorBytes:
    """Counts the bytes autograd saves for backward inside the block (``saved_tensors_hooks``);
    how the memory recompute saves is measured. Tensors saved twice count twice."""

    def __init__(self) -> None:
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)  # type: ignore[arg-type]


__all__ = ["OffloadSavedInputs", "SavedTensorBytes", "recompute"]
