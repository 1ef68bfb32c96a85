"""Shuffles of an in-memory dataset: local permutations, and the global exchange of examples
between the trainers of a job over ``torch.distributed``.

Global shuffle (Paddle sends batches of serialized records between trainers by RPC, throttled by
``fleet_send_batch_size`` / ``fleet_send_sleep_seconds``): here every trainer deals its examples
out evenly and at random -- a random permutation of its examples, example ``k`` of it going to
rank ``(k + r) % world_size`` for a random ``r`` -- then one ``all_to_all_single`` per column
(plus small ones for the counts) moves them, over gloo: each trainer ends with
``sum_over_senders(n_sender / world_size)`` (+-1 per sender) examples, a random share, and the
union over trainers is exactly the input. The received examples are then locally permuted.

The collectives run on the default process group when its backend is gloo, else on a gloo group
over the same ranks made once (the examples are CPU arrays; NCCL takes CUDA tensors only).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as tdist

from fleet.base import coordination
from fleet.data.columns import Columns, locate, take_column
from fleet.data.slots import Slot

_gloo_group: object | None = None


def world() -> tuple[int, int]:
    """(rank, world_size) of the default process group — or of the PS trainers meeting through
    fleetrun's coordinator (:mod:`fleet.base.coordination`); (0, 1) when there is none."""
    client = coordination.active()
    if client is not None:
        return client.rank, client.world
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def cpu_group() -> object | None:
    """A process group that moves CPU tensors: the default one if it is gloo, else a gloo group
    over every rank (made on first use: a collective call, as every caller here is)."""
    global _gloo_group
    if tdist.get_backend() == "gloo":
        return None  # the default group
    if _gloo_group is None:
        _gloo_group = tdist.new_group(backend="gloo")
    return _gloo_group


def sum_over_trainers(value: int) -> int:
    """``value`` summed over every trainer of the job (itself when there is no process group)."""
    client = coordination.active()
    if client is not None:  # builtins' sum: the values of every trainer (a replayable round)
        return int(np.sum(client.gather(int(value), "fleet.data sum_over_trainers")))
    if world()[1] == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    tdist.all_reduce(t, group=cpu_group())
    return int(t.item())


def make_rng(seed: int | None, *streams: int) -> np.random.Generator:
    """A generator for ``(seed, streams...)``; fresh entropy when ``seed`` is None."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed, *streams])


def _a2a(
    values: np.ndarray, send: np.ndarray, recv: np.ndarray, group: object | None
) -> np.ndarray:
    """all_to_all_single of a 1-D array with per-rank element counts ``send`` / ``recv``."""
    out = torch.empty(int(recv.sum()), dtype=torch.from_numpy(values[:0]).dtype)
    tdist.all_to_all_single(
        out,
        torch.from_numpy(np.ascontiguousarray(values)),
        output_split_sizes=recv.tolist(),
        input_split_sizes=send.tolist(),
        group=group,
    )
    return out.numpy()


def _counts(send: np.ndarray, group: object | None) -> np.ndarray:
    """What every rank sends to this one, given what this one sends to every rank."""
    ones = np.ones(send.shape[0], dtype=np.int64)
    return _a2a(send.astype(np.int64), ones, ones, group)


def exchange(chunks: list[Columns], slots: tuple[Slot, ...], rng: np.random.Generator) -> Columns:
    """Deal the examples of ``chunks`` out to every trainer (module docstring); returns this
    trainer's share, in the order of the senders' ranks. A collective: every trainer calls it.

    Column by column, each column of ``chunks`` dropped once sent (``chunks`` ends empty): the
    peak is the data plus one column sent and the columns received.
    """
    if coordination.active() is not None:
        coordination.refuse("InMemoryDataset.global_shuffle")
    size = world()[1]
    if not chunks:  # nothing here: still take part in every collective
        chunks.append(Columns.empty(slots))
    n = sum(c.num_examples for c in chunks)
    dest = (np.arange(n, dtype=np.int64) + int(rng.integers(size))) % size
    order = rng.permutation(n)[np.argsort(dest, kind="stable")]  # random, grouped by rank
    send_counts = np.bincount(dest, minlength=size).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(send_counts)])
    chunk, row = locate(chunks, order)
    del dest, order
    group = cpu_group()
    recv_counts = _counts(send_counts, group)
    total = int(recv_counts.sum())
    data: list = []
    for s, slot in enumerate(slots):
        col = take_column(chunks, s, chunk, row)
        for c in chunks:
            c.data[s] = None  # type: ignore[call-overload]
        if isinstance(col, np.ndarray):
            flat = _a2a(col.reshape(-1), send_counts * slot.dim, recv_counts * slot.dim, group)
            data.append(flat.reshape(total, slot.dim))
            continue
        values, offsets = col
        send_values = offsets[bounds[1:]] - offsets[bounds[:-1]]
        lengths = _a2a(np.diff(offsets), send_counts, recv_counts, group)
        new_values = _a2a(values, send_values, _counts(send_values, group), group)
        new_offsets = np.zeros(total + 1, dtype=np.int64)
        np.cumsum(lengths, out=new_offsets[1:])
        data.append((new_values, new_offsets))
    chunks.clear()
    return Columns(slots, data, total)


def permute_slot(chunks: list[Columns], slot_index: int, rng: np.random.Generator) -> None:
    """Permute one column across the examples of ``chunks`` in place (Paddle's
    ``slots_shuffle``: the slot's values no longer belong to their examples, the rest stay)."""
    n = sum(c.num_examples for c in chunks)
    chunk, row = locate(chunks, rng.permutation(n))
    new, lo = [], 0
    for c in chunks:
        hi = lo + c.num_examples
        new.append(take_column(chunks, slot_index, chunk[lo:hi], row[lo:hi]))
        lo = hi
    for c, col in zip(chunks, new):
        c.data[slot_index] = col


__all__ = ["cpu_group", "exchange", "make_rng", "permute_slot", "sum_over_trainers", "world"]
