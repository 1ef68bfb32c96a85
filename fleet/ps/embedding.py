"""``fleet.DistributedEmbedding``: an embedding whose table lives on the parameter servers.

Forward takes int64 ids (any 64-bit value, no vocabulary size): ``[B, L]`` (one bag of L ids per
row; with ``pooling=None`` the output is ``[B, L, dim]``), or 1-D ``ids`` plus ``offsets`` for
multi-hot slots (bags of different lengths, as ``nn.EmbeddingBag``; pooling required), or a
sparse slot of a :mod:`fleet.data` batch (any object with ``values`` and ``offsets`` ``[B+1]``,
the jagged layout of TorchRec), or a list / dict of such slots: then every slot's ids are pulled
in one request per table and the result is one pooled ``[B, dim]`` tensor per slot, in the same
list / dict shape. It deduplicates the ids, pulls one row per unique id through the job's
communicator, and returns tensors with autograd. Backward merges the row gradients per unique id (autograd's index
backward does the summing) and hands them to the communicator, which pushes them at
``optimizer.step()`` as the strategy's mode says. The trainer never holds the full table.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from collective.errors import ConfigError
from fleet.ps.runtime import get_communicator, register_table
from ps_server import SGD, SparseTableConfig, Uniform

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
        self._entries: list[tuple[tuple[torch.Tensor, ...], tuple, np.ndarray, torch.Tensor]] = []

    def get(self, *tensors: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """(sorted unique int64 keys, int64 inverse of the tensors' flat ids, concatenated in
        order): several slots deduplicated together, for one pull per table."""
        key = tuple(
            (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version) for t in tensors
        )
        for _, k, keys, inverse in self._entries:
            if k == key:
                return keys, inverse
        flats = [t.detach().reshape(-1).to(torch.int64).cpu().numpy() for t in tensors]
        flat = flats[0] if len(flats) == 1 else np.concatenate(flats)
        keys, inv = np.unique(flat, return_inverse=True)
        inverse = torch.from_numpy(inv.reshape(-1).astype(np.int64, copy=False))
        self._entries.append((tensors, key, keys, inverse))
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
        if pooling not in _POOLINGS:
            raise ConfigError(f"got {pooling!r}; allowed: None, 'sum', 'mean'", key="pooling")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ConfigError(
                f"must be a positive integer, got {embedding_dim!r}", key="embedding_dim"
            )
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

    def forward(self, ids: Any, offsets: torch.Tensor | None = None) -> Any:
        """Rows for ``ids`` (pooled per bag when ``pooling`` is set); see the module docstring
        for the accepted forms. A list / dict of sparse slots gives a list / dict of
        ``[B, dim]`` tensors, all pulled in one request."""
        if isinstance(ids, Mapping):
            return dict(zip(ids.keys(), self._forward_slots(list(ids.values()), "dict")))
        if isinstance(ids, Sequence) and not isinstance(ids, torch.Tensor):
            return self._forward_slots(list(ids), "list")
        if _is_slot(ids):
            if offsets is not None:
                raise ConfigError(
                    "a sparse slot carries its own offsets; do not pass offsets=",
                    key=f"{self.table}.offsets",
                )
            return self._forward_slots([ids], "slot")[0]
        if ids.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"ids must be int64, got {ids.dtype}", key=f"{self.table}.ids")
        if offsets is not None and (ids.dim() != 1 or self.pooling is None):
            raise ConfigError(
                "offsets need 1-D ids and pooling='sum' or 'mean'", key=f"{self.table}.offsets"
            )
        if offsets is None and ids.dim() != 2:
            raise ConfigError(
                f"ids must be [batch, bag_len] (or 1-D with offsets), got shape {tuple(ids.shape)}",
                key=f"{self.table}.ids",
            )
        keys, inverse = _UNIQUE.get(ids)
        rows = self._pull(keys)
        if offsets is not None:
            return F.embedding_bag(inverse, rows, offsets.to(torch.int64), mode=self.pooling)
        out = F.embedding(inverse.view(ids.shape), rows)
        if self.pooling == "sum":
            return out.sum(dim=1)
        if self.pooling == "mean":
            return out.mean(dim=1)
        return out

    def _pull(self, keys: np.ndarray) -> torch.Tensor:
        """One pull of ``keys``' rows, with a hook that records their gradient for the push."""
        comm = get_communicator()
        rows = torch.from_numpy(np.ascontiguousarray(comm.pull_sparse(self.table, keys)))
        rows.requires_grad_(self.training and torch.is_grad_enabled())
        if rows.requires_grad:
            table = self.table

            def push_hook(grad: torch.Tensor) -> None:
                comm.record_sparse(table, keys, grad.detach().to(torch.float32).numpy().copy())

            rows.register_hook(push_hook)
        return rows

    def _forward_slots(self, slots: list[Any], form: str) -> list[torch.Tensor]:
        """Pooled ``[B_i, dim]`` per jagged slot, from one deduplicated pull of all their ids."""
        if self.pooling is None:
            raise ConfigError(
                "sparse slots are bags of ids: set pooling='sum' or 'mean' on this "
                "DistributedEmbedding",
                key=f"{self.table}.pooling",
            )
        if not slots:
            raise ConfigError(f"got an empty {form} of slots", key=f"{self.table}.ids")
        values, starts, counts = [], [], []
        base = 0
        for i, slot in enumerate(slots):
            if not _is_slot(slot):
                raise ConfigError(
                    f"{form} item {i} is a {type(slot).__name__}; expected a sparse slot with "
                    "values and offsets [B+1] (a fleet.data batch's sparse slot)",
                    key=f"{self.table}.ids",
                )
            v, off = _slot_arrays(slot, self.table, i)
            values.append(v)
            starts.append(off[:-1] + base)
            counts.append(off.shape[0] - 1)
            base += v.shape[0]
        keys, inverse = _UNIQUE.get(*values)
        rows = self._pull(keys)
        pooled = F.embedding_bag(inverse, rows, torch.cat(starts), mode=self.pooling)
        return list(pooled.split(counts))

    def prefetch(self, ids: Any) -> None:
        """Start pulling the rows of ``ids`` (the next batch's, same shape rules as forward) in
        the background, so the next :meth:`forward` with these ids does not wait for the
        servers. Async / half-async modes only; sync and GEO ignore it (a sync pull must see
        the last step's update). The rows may miss updates still queued: async semantics."""
        comm = get_communicator()
        if not comm.prefetches:
            return
        if isinstance(ids, Mapping):
            ids = list(ids.values())
        if isinstance(ids, Sequence) and not isinstance(ids, torch.Tensor):
            keys = _UNIQUE.get(*(_slot_arrays(s, self.table, i)[0] for i, s in enumerate(ids)))[0]
        elif _is_slot(ids):
            keys = _UNIQUE.get(_slot_arrays(ids, self.table, 0)[0])[0]
        else:
            keys = _UNIQUE.get(ids)[0]
        comm.prefetch(self.table, keys)

    def table_config(self) -> Any:
        """The :class:`ps_server.SparseTableConfig` this module's table is created with."""
        return SparseTableConfig(
            self.table,
            dim=self.embedding_dim,
            optimizer=self.optimizer,
            initializer=self.initializer,
            entry=self.entry,
            **self.table_options,
        )


def _is_slot(obj: Any) -> bool:
    """A jagged sparse slot: ``values`` (all ids) and ``offsets`` (``[B+1]``, from 0)."""
    return hasattr(obj, "values") and hasattr(obj, "offsets") and not isinstance(obj, torch.Tensor)


def _slot_arrays(slot: Any, table: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 values, int64 offsets [B+1]) of a slot, checked."""
    values, offsets = slot.values, slot.offsets
    if callable(values):  # a dict-like or torchrec-like object whose values is a method
        values = values()
    if callable(offsets):
        offsets = offsets()
    values, offsets = torch.as_tensor(values), torch.as_tensor(offsets)
    if values.dim() != 1 or values.dtype not in (torch.int64, torch.int32):
        raise ConfigError(
            f"slot {index}: values must be 1-D int64 ids, got {values.dtype} {tuple(values.shape)}",
            key=f"{table}.ids",
        )
    if (
        offsets.dim() != 1
        or offsets.shape[0] < 1
        or int(offsets[0]) != 0
        or int(offsets[-1]) != values.shape[0]
    ):
        raise ConfigError(
            f"slot {index}: offsets must be [B+1] from 0 to len(values)={values.shape[0]}, got "
            f"{offsets.tolist()[:8]}{'...' if offsets.shape[0] > 8 else ''}",
            key=f"{table}.offsets",
        )
    return values, offsets.to(torch.int64)
