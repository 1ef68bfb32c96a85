"""Where a pass's rows live on the trainer (:mod:`fleet.ps.pass_cache`): two stores, one API.

* :class:`KernelRows` (CPU, the built-in SGD / Adagrad / Adam, compiled kernels present): the
  server's own row columns and kernels (:mod:`ps_server.core.kernels`): a
  :class:`~ps_server.core.hash_index.HashIndex` over the pass's keys, the compiled gather, and
  the server's fused push (duplicates summed, the rule, the weight bounds) applied to the local
  columns: a step's update is the server's, bit for bit, without the GIL.
* :class:`TorchRows` (CUDA, or any other rule): torch tensors on the device, a sorted key array
  searched with ``searchsorted``, the rule by :func:`fleet.ps.pass_rules.apply_rule`.

Both start from the rows and optimizer state the servers hold (the rule continues across
passes) and keep both as pulled for the deltas :meth:`delta` gives at the pass's end.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fleet.ps.pass_rules import apply_rule
from ps_server.core import kernels
from ps_server.core.hash_index import HashIndex


def make_rows(
    rule: Any,
    keys: np.ndarray,
    rows: np.ndarray,
    device: torch.device,
    state: np.ndarray | None = None,
) -> Any:
    """The store for a table's pass (``state``: the rows' optimizer state as pulled; None: the
    rule's initial state): :class:`KernelRows` where it applies, else :class:`TorchRows`."""
    if device.type == "cpu" and kernels.ENABLED and kernels.push_hyper(rule) is not None:
        return KernelRows(rule, keys, rows, state)
    return TorchRows(rule, keys, rows, device, state)


def _start_state(rule: Any, n: int, dim: int, state: np.ndarray | None) -> np.ndarray:
    if state is not None:
        return np.array(state, np.float32, order="C")  # a copy: the store trains it in place
    out = np.empty((n, rule.state_dim(dim)), np.float32)
    rule.init_state(out)
    return out


class KernelRows:
    """The pass's rows in the server's columns, updated by the server's compiled push."""

    def __init__(
        self, rule: Any, keys: np.ndarray, rows: np.ndarray, state: np.ndarray | None = None
    ) -> None:
        n, dim = rows.shape
        self.keys = keys
        self.dim = int(dim)
        self.cols = {
            "values": np.ascontiguousarray(rows, np.float32),
            "state": _start_state(rule, n, dim, state),
            "count": np.zeros(n, np.uint32),
            "unseen_days": np.zeros(n, np.uint16),
        }
        self.flags = np.zeros(n, np.uint8)
        self.base = self.cols["values"].copy()
        self.base_state = self.cols["state"].copy()
        self._fused = kernels.push_hyper(rule)
        self._index = HashIndex()
        self._index.insert(keys, np.arange(n, dtype=np.int64), keys)

    @property
    def nbytes(self) -> int:
        arrays = (self.keys, self.base, self.base_state, self.flags, *self.cols.values())
        return sum(a.nbytes for a in arrays) + self._index.memory_bytes

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, found mask) of ``keys``."""
        rows = self._index.lookup(np.ascontiguousarray(keys, np.int64), self.keys)
        return rows, rows >= 0

    def gather(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty((rows.shape[0], self.dim), np.float32)
        kernels.gather(self.cols["values"], rows, out)
        return out

    def gather_tensor(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.gather(rows))

    def grads(self, grads: Any) -> np.ndarray:
        if isinstance(grads, torch.Tensor):
            grads = grads.to("cpu", torch.float32).numpy()
        return np.ascontiguousarray(grads, np.float32)

    def apply(self, pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
        rows = pieces[0][0] if len(pieces) == 1 else np.concatenate([p[0] for p in pieces])
        grads = pieces[0][1] if len(pieces) == 1 else np.concatenate([p[1] for p in pieces])
        kernels.push(self._fused[0], self._fused[1], self.cols, self.flags, rows, grads)

    def delta(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, value deltas, state deltas) of the rows the pass updated."""
        touched = self.cols["count"] > 0
        values = self.cols["values"][touched] - self.base[touched]
        return self.keys[touched], values, self.cols["state"][touched] - self.base_state[touched]


class TorchRows:
    """The pass's rows as torch tensors on ``device``, the rule by ``apply_rule``."""

    def __init__(
        self,
        rule: Any,
        keys: np.ndarray,
        rows: np.ndarray,
        device: torch.device,
        state: np.ndarray | None = None,
    ) -> None:
        n, dim = rows.shape
        self.rule = rule
        self.device = device
        self.dim = int(dim)
        self.keys_np = keys
        self.keys = torch.from_numpy(keys).to(device)
        self.values = torch.from_numpy(np.ascontiguousarray(rows, np.float32)).to(device)
        self.base = self.values.clone()
        self.state = torch.from_numpy(_start_state(rule, n, dim, state)).to(device)
        self.base_state = self.state.clone()
        self.updates = torch.zeros(n, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        tensors = (self.keys, self.values, self.base, self.state, self.base_state, self.updates)
        return sum(t.numel() * t.element_size() for t in tensors)

    def find(self, keys: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """(rows on the device, found mask) of ``keys``."""
        keys = np.ascontiguousarray(keys, np.int64)
        n = self.keys_np.shape[0]
        if n == 0:
            return torch.zeros(keys.shape[0], dtype=torch.int64), np.zeros(keys.shape[0], bool)
        if self.device.type == "cpu":
            pos = np.searchsorted(self.keys_np, keys).clip(max=n - 1)
            return torch.from_numpy(pos), self.keys_np[pos] == keys
        query = torch.from_numpy(keys).to(self.device)
        idx = torch.searchsorted(self.keys, query).clamp_(max=n - 1)
        return idx, (self.keys.index_select(0, idx) == query).cpu().numpy()

    def gather(self, rows: torch.Tensor) -> np.ndarray:
        out = self.values.index_select(0, rows)
        return out.cpu().numpy() if out.device.type != "cpu" else out.numpy()

    def gather_tensor(self, rows: torch.Tensor) -> torch.Tensor:
        return self.values.index_select(0, rows)

    def grads(self, grads: Any) -> torch.Tensor:
        if isinstance(grads, torch.Tensor):
            return grads.to(self.device, torch.float32)
        return torch.from_numpy(np.asarray(grads, np.float32)).to(self.device)

    def apply(self, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(pieces) == 1:
            idx, grads = pieces[0]
        else:  # several lookups in one step: sum per row, as the server sums a push
            idx, inverse = torch.unique(torch.cat([p[0] for p in pieces]), return_inverse=True)
            grads = torch.zeros(idx.shape[0], self.dim, device=self.device)
            grads.index_add_(0, inverse, torch.cat([p[1] for p in pieces]))
        weights = self.values.index_select(0, idx)
        state = self.state.index_select(0, idx)
        self.updates.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
        apply_rule(self.rule, weights, state, grads, self.updates.index_select(0, idx))
        self.values.index_copy_(0, idx, weights)
        if state.shape[1]:
            self.state.index_copy_(0, idx, state)

    def delta(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, value deltas, state deltas) of the rows the pass updated."""
        touched = (self.updates > 0).cpu().numpy()
        delta = (self.values - self.base).cpu().numpy()
        state = (self.state - self.base_state).cpu().numpy()
        return (
            self.keys_np[touched],
            np.ascontiguousarray(delta[touched]),
            np.ascontiguousarray(state[touched]),
        )


__all__ = ["KernelRows", "TorchRows", "make_rows"]
