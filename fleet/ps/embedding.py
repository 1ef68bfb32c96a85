"""``fleet.DistributedEmbedding``: an embedding whose table lives on the parameter servers.

Forward takes int64 ids (any 64-bit value, no vocabulary size): ``[B, L]`` (one bag of L ids per
row; with ``pooling=None`` the output is ``[B, L, dim]``), or 1-D ``ids`` plus ``offsets`` for
multi-hot slots (bags of different lengths, as ``nn.EmbeddingBag``; pooling required), or a
sparse slot of a :mod:`fleet.data` batch (any object with ``values`` and ``offsets`` ``[B+1]``,
the jagged layout of TorchRec), or a list / dict of such slots: then every slot's ids are pulled
in one request per table and the result is one pooled ``[B, dim]`` tensor per slot, in the same
list / dict shape. It deduplicates the ids, pulls one row per unique id through the job's
communicator, and returns tensors with autograd. Backward merges the row gradients per unique
id (one ``[U, dim]`` gradient per forward, however many slots it took) and hands them to the
communicator, which pushes them at ``optimizer.step()`` as the strategy's mode says. The trainer
never holds the full table.

The rows come back on the module's device (``model.to("cuda")`` moves it; ids may be on either
device): pulled rows are copied there and their gradient back to the host for the push, while
the rows of an open pass held on that device (:mod:`fleet.ps.pass_cache` on CUDA) are read and
trained there without a copy.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from collective.errors import ConfigError
from fleet.ps import auto_prefetch, pass_cache, threads
from fleet.ps.runtime import get_communicator, register_table
from ps_server import SGD, SparseTableConfig, Uniform
from ps_server.core.batch_ops import distinct

logger = logging.getLogger(__name__)

_POOLINGS = (None, "sum", "mean")


class _UniqueIds:
    """The distinct ids (in order of first occurrence) and the inverse of the last few id
    tensors, by the servers' compiled dedup (``ps_server.core.batch_ops.distinct``: a hash
    pass, about 4x faster than ``np.unique``'s sort at a CTR batch's 13 k ids).

    A model's embeddings often take the same ids (wide & deep: both tables, the same slots), and
    :meth:`DistributedEmbedding.prefetch` deduplicates a batch one step before its forward: with
    this cache each batch is deduplicated once. A tensor is recognised by (data pointer, shape,
    strides, dtype, version counter); the cache keeps a reference to it, so its memory cannot be
    reused by another tensor while the entry lives, and an in-place change bumps the version.
    """

    SIZE = 4

    def __init__(self) -> None:
        self._entries: list[tuple[tuple[torch.Tensor, ...], tuple, np.ndarray, torch.Tensor]] = []
        self._lock = threading.Lock()  # training threads share the cache

    def get(self, *tensors: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """(distinct int64 keys, int64 inverse of the tensors' flat ids, concatenated in
        order): several slots deduplicated together, for one pull per table."""
        key = tuple(
            (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version) for t in tensors
        )
        with self._lock:
            for _, k, keys, inverse in self._entries:
                if k == key:
                    return keys, inverse
        flats = [t.detach().reshape(-1).to(torch.int64).cpu().numpy() for t in tensors]
        flat = flats[0] if len(flats) == 1 else np.concatenate(flats)
        keys, inv, _ = distinct(np.ascontiguousarray(flat, dtype=np.int64))
        inverse = torch.from_numpy(inv.reshape(-1).astype(np.int64, copy=False))
        with self._lock:
            self._entries.append((tensors, key, keys, inverse))
            del self._entries[: -self.SIZE]
        return keys, inverse


_UNIQUE = _UniqueIds()


class DistributedEmbedding(torch.nn.Module):
    """A sparse table on the parameter servers, used like ``nn.Embedding`` / ``nn.EmbeddingBag``.

    ``table``: table name (unique per job); ``embedding_dim``: row width; ``optimizer``,
    ``initializer``, ``entry``: the server-side rule objects of :mod:`ps_server`
    (``SGD(0.01)``, ``Uniform(-0.01, 0.01)``, ``CountFilterEntry(n)``...); ``pooling``: None,
    ``"sum"`` or ``"mean"`` over each bag; ``cache``: ``"pass"`` trains each pass against a
    trainer-local copy of the pass's rows (:mod:`fleet.ps.pass_cache`), ``cache_slots``: the
    dataset slots whose ids this table reads (default: every sparse slot); ``table_options``:
    more ``SparseTableConfig`` fields (``num_shards``, ``seed``, ``nonfinite``, ``max_capacity``).
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
        cache: str | None = None,
        cache_slots: Sequence[str] | None = None,
        **table_options: Any,
    ) -> None:
        super().__init__()
        if cache not in (None, "pass"):
            raise ConfigError(f"got {cache!r}; allowed: None, 'pass'", key=f"{table}.cache")
        self.cache = cache
        self.cache_slots = None if cache_slots is None else tuple(cache_slots)
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
        # forward's rows go to the module's device: model.to(...) moves this empty buffer
        self.register_buffer("_device_anchor", torch.empty(0), persistent=False)
        register_table(self)

    @property
    def device(self) -> torch.device:
        """Where forward returns its rows: the device the module was moved to (CPU by default)."""
        return self._device_anchor.device

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
        auto_prefetch.seen(self, [ids], single=True)
        keys, inverse = _UNIQUE.get(ids)
        rows = self._pull(keys)
        inverse = inverse.to(rows.device)
        if offsets is not None:
            return F.embedding_bag(
                inverse, rows, offsets.to(rows.device, torch.int64), mode=self.pooling
            )
        # index_select, not F.embedding: the same rows, and its backward (index_add_ into the
        # [U, dim] gradient, the ids in batch order) gives the same sums as embedding's dense
        # backward at a fraction of its cost on CPU (which sorts the ids of a large batch)
        out = rows.index_select(0, inverse.reshape(-1)).view(*ids.shape, rows.shape[1])
        if self.pooling == "sum":
            return out.sum(dim=1)
        if self.pooling == "mean":
            return out.mean(dim=1)
        return out

    def _pull(self, keys: np.ndarray) -> torch.Tensor:
        """One pull of ``keys``' rows on the module's device, with a hook that records their
        gradient for the push."""
        comm = get_communicator()
        device = self._device_anchor.device
        local = pass_cache.local_table(comm, self.table, device)
        t0 = time.perf_counter()
        if local is not None:  # the open pass holds these rows on this device
            rows = local.pull_tensor(keys)
        else:
            rows = torch.from_numpy(np.ascontiguousarray(comm.pull_sparse(self.table, keys)))
            if device.type != "cpu":
                rows = rows.to(device)
        threads.add_pull_wait(time.perf_counter() - t0)
        rows.requires_grad_(self.training and torch.is_grad_enabled())
        if rows.requires_grad:
            table = self.table

            def push_hook(grad: torch.Tensor) -> None:
                # no copy on the CPU: the gradient is a fresh tensor of this backward that
                # nothing writes afterwards (the rows are a leaf of this step only)
                if local is not None:
                    local.record_tensor(keys, grad.detach())
                else:
                    comm.record_sparse(table, keys, grad.detach().to("cpu", torch.float32).numpy())

            rows.register_hook(push_hook)
        return rows

    def _forward_slots(self, slots: list[Any], form: str) -> list[torch.Tensor]:
        """Pooled ``[B_i, dim]`` per jagged slot, from one deduplicated pull of all their ids.

        The fused lookup (:class:`_KeyedSlots`): the slots are laid out once per batch
        (values concatenated, offsets checked with vectorised tests, the layout cached for
        the prefetch and for other tables reading the same slots), deduplicated once, pulled
        once and pooled by one ``embedding_bag`` over all bags; backward merges the gradient
        once per unique key (``[U, dim]``, one push). It equals calling the module once per
        slot: the same rows summed per bag in the same order (forward bit for bit); a key
        used by several slots gets its gradient summed here instead of on the server, which
        differs only in float32 summation order."""
        if self.pooling is None:
            raise ConfigError(
                "sparse slots are bags of ids: set pooling='sum' or 'mean' on this "
                "DistributedEmbedding",
                key=f"{self.table}.pooling",
            )
        if not slots:
            raise ConfigError(f"got an empty {form} of slots", key=f"{self.table}.ids")
        auto_prefetch.seen(self, slots, single=form == "slot")
        layout = _KEYED.get(slots, self.table, form)
        return layout.pool(self._pull(layout.keys), self.pooling)

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
            keys = _KEYED.get(list(ids), self.table, "list").keys
        elif _is_slot(ids):
            keys = _KEYED.get([ids], self.table, "slot").keys
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


_ID_DTYPES = (torch.int64, torch.int32)


class _KeyedSlots:
    """The slots of one lookup in one layout (TorchRec's ``KeyedJaggedTensor``): all ids
    concatenated slot after slot and deduplicated once (``keys``: the unique ids in order of
    first occurrence, ``inverse``: each id's row in ``keys``), the bags of all slots numbered
    in order.

    :meth:`pool` is one ``embedding_bag`` over all bags (a bag's rows summed in the order of
    its ids); its backward (:class:`_PoolBags`) merges the gradient of each unique key once,
    ``[U, dim]``, summing its ids' bag gradients in the order the ids come in the batch.
    """

    __slots__ = (
        "_divisor",
        "_moved",
        "bag_of_sorted",
        "counts",
        "inverse",
        "key_starts",
        "keys",
        "lengths",
        "starts",
    )

    def __init__(
        self, flat: np.ndarray, lengths: np.ndarray, counts: list[int], one_id: bool
    ) -> None:
        # the compiled hash dedup, then the ids grouped by key with a stable sort of their key
        # index (a radix sort when it fits 16 bits): ~2x faster than a stable argsort of the
        # int64 ids at a CTR batch's 13 k ids
        keys, inverse, occurrences = distinct(np.ascontiguousarray(flat, dtype=np.int64))
        inverse = inverse.reshape(-1)
        index = inverse.astype(np.uint16) if keys.shape[0] <= 1 << 16 else inverse
        order = np.argsort(index, kind="stable")  # equal ids keep their batch order
        key_starts = np.zeros(keys.shape[0], dtype=np.int64)
        np.cumsum(occurrences[:-1], out=key_starts[1:])
        self.keys = keys
        """Unique ids in order of first occurrence: the rows pulled."""
        self.inverse = torch.from_numpy(inverse)
        """Each id's row in ``keys``."""
        self.key_starts = torch.from_numpy(key_starts)
        """Where each key's ids start in the ids grouped by key."""
        bags = order if one_id else np.repeat(np.arange(lengths.shape[0]), lengths)[order]
        self.bag_of_sorted = torch.from_numpy(bags)
        """The bag of each id, ids grouped by key (stable)."""
        self.lengths = lengths
        """Ids per bag, all slots' bags in order."""
        self.starts = None if one_id else torch.from_numpy(np.cumsum(lengths) - lengths)
        """Each bag's first id (``embedding_bag``'s offsets); None when every bag holds one id."""
        self.counts = counts
        """``B_i``: bags per slot."""
        self._divisor: torch.Tensor | None = None
        self._moved: _KeyedSlots | None = None

    def on(self, device: torch.device) -> _KeyedSlots:
        """This layout with its index tensors on ``device`` (itself on the CPU; the last
        device's copy is kept, for the other tables reading the same slots)."""
        if device.type == "cpu":
            return self
        moved = self._moved
        if moved is None or moved.inverse.device != device:
            moved = copy.copy(self)
            for name in ("inverse", "key_starts", "bag_of_sorted", "starts"):
                t = getattr(self, name)
                setattr(moved, name, None if t is None else t.to(device))
            divisor = self.divisor()
            moved._divisor = None if divisor is None else divisor.to(device)
            moved._moved = None
            self._moved = moved
        return moved

    def divisor(self) -> torch.Tensor | None:
        """float32 ``[bags, 1]``: ids per bag (1 for an empty bag), for mean pooling; None
        when every bag holds one id."""
        if self._divisor is None and self.starts is not None:
            self._divisor = torch.from_numpy(np.maximum(self.lengths, 1).astype(np.float32))[
                :, None
            ]
        return self._divisor

    def pool(self, rows: torch.Tensor, mode: str) -> list[torch.Tensor]:
        """``[B_i, dim]`` per slot: ``mode`` (``"sum"`` / ``"mean"``) of each bag's rows, an
        empty bag pooling to zeros."""
        return list(_PoolBags.apply(rows, self.on(rows.device), mode).split(self.counts))


class _PoolBags(torch.autograd.Function):
    """Rows ``[U, dim]`` -> pooled bags ``[bags, dim]`` of a :class:`_KeyedSlots`, and back.

    Forward: one ``embedding_bag`` (or one gather when every bag holds one id). Backward: the
    gradient of key ``k`` is the sum of its ids' bag gradients (divided by the bag length for
    mean pooling): one ``embedding_bag`` over the bag gradients with the ids grouped by key,
    instead of autograd's sort-based scatter of ``embedding_bag``'s own backward.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, layout: _KeyedSlots, mode: str) -> torch.Tensor:
        ctx.layout, ctx.mode = layout, mode
        if layout.starts is None:  # one id per bag: its row is the sum and the mean
            return rows.index_select(0, layout.inverse)
        if layout.inverse.shape[0] == 0:
            return rows.new_zeros(layout.lengths.shape[0], rows.shape[1])
        return F.embedding_bag(layout.inverse, rows, layout.starts, mode=mode)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        layout: _KeyedSlots = ctx.layout
        if layout.keys.shape[0] == 0:
            return grad.new_zeros(0, grad.shape[1]), None, None
        if ctx.mode == "mean" and layout.starts is not None:
            grad = grad / layout.divisor()
        merged = F.embedding_bag(
            layout.bag_of_sorted, grad.contiguous(), layout.key_starts, mode="sum"
        )
        return merged, None, None


class _KeyedCache:
    """The :class:`_KeyedSlots` of the last few slot lists, so that a batch is laid out and
    deduplicated once for its prefetch and every table that reads the same slots.

    A slot is recognised by its values and offsets tensors (object, version counter, shape);
    the cache holds them, so no other tensor can take their identity while the entry lives,
    and an in-place change bumps the version.
    """

    SIZE = 4

    def __init__(self) -> None:
        self._entries: list[tuple[list[torch.Tensor], tuple, _KeyedSlots]] = []
        self._lock = threading.Lock()  # training threads share the cache

    def get(self, slots: list[Any], table: str, form: str) -> _KeyedSlots:
        """The layout of ``slots`` (sparse slots; ``form`` and ``table`` name them in errors)."""
        tensors = []
        for i, slot in enumerate(slots):
            if not _is_slot(slot):
                raise ConfigError(
                    f"{form} item {i} is a {type(slot).__name__}; expected a sparse slot with "
                    "values and offsets [B+1] (a fleet.data batch's sparse slot)",
                    key=f"{table}.ids",
                )
            values, offsets = slot.values, slot.offsets
            if callable(values):  # a dict-like or torchrec-like object whose values is a method
                values = values()
            if callable(offsets):
                offsets = offsets()
            if not isinstance(values, torch.Tensor):
                values = torch.as_tensor(values)
            if not isinstance(offsets, torch.Tensor):
                offsets = torch.as_tensor(offsets)
            tensors.append(values)
            tensors.append(offsets)
        key = tuple((id(t), t._version, t.shape) for t in tensors)
        with self._lock:
            for _, k, layout in self._entries:
                if k == key:
                    return layout
        layout = _lay_out(tensors[0::2], tensors[1::2], table)
        with self._lock:
            self._entries.append((tensors, key, layout))
            del self._entries[: -self.SIZE]
        return layout


_KEYED = _KeyedCache()


def _lay_out(values: list[torch.Tensor], offsets: list[torch.Tensor], table: str) -> _KeyedSlots:
    """Check the slots and lay them out: one concatenation, vectorised offset checks (each
    slot's offsets start at 0, never decrease and end at its number of ids), one sort."""
    for i, (v, off) in enumerate(zip(values, offsets)):
        if v.dim() != 1 or v.dtype not in _ID_DTYPES:
            raise ConfigError(
                f"slot {i}: values must be 1-D int64 ids, got {v.dtype} {tuple(v.shape)}",
                key=f"{table}.ids",
            )
        if off.dim() != 1 or off.shape[0] < 1 or off.dtype not in _ID_DTYPES:
            raise _offsets_error(
                i, v, off, table, f"1-D int64 [B+1], got {off.dtype} {tuple(off.shape)}"
            )
    counts = [off.shape[0] - 1 for off in offsets]
    flat = values[0] if len(values) == 1 else torch.cat(values)
    cat = offsets[0] if len(offsets) == 1 else torch.cat(offsets)
    flat = flat.to("cpu", torch.int64).numpy()
    cat = cat.to("cpu", torch.int64).numpy()
    lasts = np.fromiter(accumulate(c + 1 for c in counts), np.int64, len(counts)) - 1
    firsts = lasts - np.array(counts, np.int64)
    totals = np.fromiter((v.shape[0] for v in values), np.int64, len(values))
    lengths = np.diff(cat)  # bag lengths, and at lasts[:-1] the step from a slot to the next
    lengths[lasts[:-1]] = 0
    if cat[firsts].any() or not np.array_equal(cat[lasts], totals) or lengths.min(initial=0) < 0:
        raise _first_bad_offsets(values, offsets, table)
    if len(counts) > 1:
        lengths = np.delete(lengths, lasts[:-1])
    one_id = flat.shape[0] == lengths.shape[0] and bool((lengths == 1).all())
    return _KeyedSlots(flat, lengths, counts, one_id)


def _first_bad_offsets(
    values: list[torch.Tensor], offsets: list[torch.Tensor], table: str
) -> ConfigError:
    """The error naming the first slot whose offsets are not a jagged layout of its ids."""
    for i, (v, off) in enumerate(zip(values, offsets)):
        off = off.to("cpu", torch.int64)
        if int(off[0]) != 0 or int(off[-1]) != v.shape[0]:
            return _offsets_error(i, v, off, table, f"[B+1] from 0 to len(values)={v.shape[0]}")
        if bool((off.diff() < 0).any()):
            return _offsets_error(i, v, off, table, "non-decreasing (bag lengths >= 0)")
    raise AssertionError("no slot with bad offsets")  # the vectorised check said there is one


def _offsets_error(
    index: int, values: torch.Tensor, offsets: torch.Tensor, table: str, what: str
) -> ConfigError:
    shown = offsets.reshape(-1).tolist()
    return ConfigError(
        f"slot {index}: offsets must be {what}, got {shown[:8]}{'...' if len(shown) > 8 else ''}",
        key=f"{table}.offsets",
    )
