"""``fleet.DistributedEmbedding``: an embedding whose table lives on the parameter servers.

Forward takes int64 ids (any 64-bit value, no vocabulary size): ``[B, L]`` (one bag of L ids per
row; with ``pooling=None`` the output is ``[B, L, dim]``), or 1-D ``ids`` plus ``offsets`` for
multi-hot slots (bags of different lengths, as ``nn.EmbeddingBag``; pooling required). It
deduplicates the ids, pulls one row per unique id through the job's communicator, and returns a
tensor with autograd. Backward merges the row gradients per unique id (autograd's index
backward does the summing) and hands them to the communicator, which pushes them at
``optimizer.step()`` as the strategy's mode says. The trainer never holds the full table.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from collective.errors import ConfigError
from fleet.ps.runtime import get_communicator, register_table

logger = logging.getLogger(__name__)

_POOLINGS = (None, "sum", "mean")


class _UniqueIds:
    """``np.unique(ids, return_inverse=True)`` of the last few id tensors.

    A model's embeddings often take the same ids (wide & deep: both tables, the same slots), and
    :meth:`DistributedEmbedding.prefetch` deduplicates a batch one step before its forward: with
    this cache each batch is deduplicated once. A tensor is recognised by (data pointer, shape,
    strides, dtype, version counter); the cache keeps a reference to it, so its memory cannot be
    reused by another tensor while the entry lives, and an in-place change bumps the version.
    """

    SIZE = 4

    def __init__(self) -> None:
        self._entries: list[tuple[torch.Tensor, tuple, np.ndarray, torch.Tensor]] = []

    def get(self, ids: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """(sorted unique int64 keys, int64 inverse of ``ids``' flat shape)."""
        key = (ids.data_ptr(), tuple(ids.shape), ids.stride(), ids.dtype, ids._version)
        for _, k, keys, inverse in self._entries:
            if k == key:
                return keys, inverse
        flat = ids.detach().reshape(-1).to(torch.int64).cpu().numpy()
        keys, inv = np.unique(flat, return_inverse=True)
        inverse = torch.from_numpy(inv.reshape(-1).astype(np.int64, copy=False))
        self._entries.append((ids, key, keys, inverse))
        del self._entries[: -self.SIZE]
        return keys, inverse


_UNIQUE = _UniqueIds()


class DistributedEmbedding(torch.nn.Module):
    """A sparse table on the parameter servers, used like ``nn.Embedding`` / ``nn.EmbeddingBag``.

    ``table``: table name (unique per job); ``embedding_dim``: row width; ``optimizer``,
    ``initializer``, ``entry``: the server-side rule objects of :mod:`ps_server`
    (``SGD(0.01)``, ``Uniform(-0.01, 0.01)``, ``CountFilterEntry(n)``...); ``pooling``: None,
    ``"sum"`` or ``"mean"`` over each bag; ``table_options``: more ``SparseTableConfig`` fields
    (``num_shards``, ``seed``, ``nonfinite``, ``max_capacity``).
    """

    def __init__(
        self,
        table: str,
        embedding_dim: int,
        *,
        optimizer: Any = None,
        initializer: Any = None,
        entry: Any = None,
        pooling: str | None = None,
        **table_options: Any,
    ) -> None:
        super().__init__()
        from ps_server import SGD, Uniform

        if pooling not in _POOLINGS:
            raise ConfigError(f"got {pooling!r}; allowed: None, 'sum', 'mean'", key="pooling")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ConfigError(f"must be a positive integer, got {embedding_dim!r}", key="embedding_dim")
        self.table = table
        self.embedding_dim = embedding_dim
        self.pooling = pooling
        self.optimizer = optimizer if optimizer is not None else SGD(0.01)
        self.initializer = initializer if initializer is not None else Uniform(-0.01, 0.01)
        self.entry = entry
        self.table_options = table_options
        register_table(self)

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.embedding_dim}, pooling={self.pooling}"

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Rows for ``ids`` (pooled per bag when ``pooling`` is set)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"ids must be int64, got {ids.dtype}", key=f"{self.table}.ids")
        if offsets is not None and (ids.dim() != 1 or self.pooling is None):
            raise ConfigError("offsets need 1-D ids and pooling='sum' or 'mean'", key=f"{self.table}.offsets")
        if offsets is None and ids.dim() != 2:
            raise ConfigError(f"ids must be [batch, bag_len] (or 1-D with offsets), got shape "
                              f"{tuple(ids.shape)}", key=f"{self.table}.ids")
        comm = get_communicator()
        keys, inverse = _UNIQUE.get(ids)
        rows = torch.from_numpy(np.ascontiguousarray(comm.pull_sparse(self.table, keys)))
        rows.requires_grad_(self.training and torch.is_grad_enabled())
        if rows.requires_grad:
            table = self.table

            def push_hook(grad: torch.Tensor) -> None:
                comm.record_sparse(table, keys, grad.detach().to(torch.float32).numpy().copy())

            rows.register_hook(push_hook)
        if offsets is not None:
            return F.embedding_bag(inverse, rows, offsets.to(torch.int64), mode=self.pooling)
        out = F.embedding(inverse.view(ids.shape), rows)
        if self.pooling == "sum":
            return out.sum(dim=1)
        if self.pooling == "mean":
            return out.mean(dim=1)
        return out

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start pulling the rows of ``ids`` (the next batch's, same shape rules as forward) in
        the background, so the next :meth:`forward` with these ids does not wait for the
        servers. Async / half-async modes only; sync and GEO ignore it (a sync pull must see
        the last step's update). The rows may miss updates still queued: async semantics."""
        comm = get_communicator()
        if comm.prefetches:
            comm.prefetch(self.table, _UNIQUE.get(ids)[0])

    def table_config(self) -> Any:
        """The :class:`ps_server.SparseTableConfig` this module's table is created with."""
        from ps_server import SparseTableConfig

        return SparseTableConfig(self.table, dim=self.embedding_dim, optimizer=self.optimizer,
                                 initializer=self.initializer, entry=self.entry, **self.table_options)
