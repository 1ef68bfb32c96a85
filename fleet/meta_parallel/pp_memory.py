"""Activation-memory accounting that works on CPU: bytes of the tensors autograd keeps for
backward, counted through ``torch.autograd.graph.saved_tensors_hooks``.

:class:`SavedActivationMeter` adds a tensor's bytes when autograd saves it and subtracts them
when autograd frees it (after the backward that used it, or when its graph dies), and keeps the
peak. Parameters (and views of them, such as the transposed weight a linear layer saves) are not
activations and are skipped; a tensor saved twice is counted once (by address and size); a
view counts its own bytes, not its storage's. This is how
the pipeline tests and bench/bench_pipeline.py show that 1F1B's peak is bounded by the number of
stages while FThenB's grows with the number of micro-batches.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

import torch


class _Saved:
    """A saved tensor plus the bookkeeping that releases its bytes when autograd drops it."""

    __slots__ = ("__weakref__", "key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: SavedActivationMeter, key: Any) -> None:
        self.tensor = tensor
        self.meter = meter
        self.key = key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


class SavedActivationMeter:
    """Context manager measuring the live and peak bytes of saved activations.

    ``params``: tensors not to count (default: none); pass ``model.parameters()``.
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}
        self._live: dict[tuple[int, int], list[int]] = {}  # (ptr, bytes) -> [bytes, refcount]
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().data_ptr() in self._param_storages or nbytes == 0:
            return _Saved(t, self, None)
        # the view's own bytes (a micro-batch of the input is a view of the whole batch)
        key = (t.data_ptr(), nbytes)
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = [nbytes, 1]
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            else:
                entry[1] += 1
        return _Saved(t, self, key)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor

    def _release(self, ptr: tuple[int, int]) -> None:
        with self._lock:
            entry = self._live.get(ptr)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._live[ptr]
                self.live_bytes -= entry[0]

    def __enter__(self) -> Self:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)


__all__ = ["SavedActivationMeter"]
