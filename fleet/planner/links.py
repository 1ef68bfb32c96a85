"""Alpha-beta fits of the collectives on the job's own process groups.

:func:`measure_links` runs on every rank of a running process group. For every group size
``k > 1`` dividing the world it splits the ranks into groups of ``k`` (consecutive ranks, within
a node; and, on several nodes, strided groups that span nodes) and runs each of
:data:`~fleet.planner.types.LINK_OPS` at a few message sizes in ALL groups at once, because
that is what the real job does: the groups share the machine and its links. A figure is the
slowest rank's median of a few repetitions (run back to back after a world barrier), and
``alpha + beta * bytes`` is fitted by least squares on the relative error, both kept >= 0.

Message size ``n`` (bytes) is what each rank contributes: ``all_reduce``/``broadcast`` of an
``n``-byte tensor, ``all_gather`` of an ``n``-byte shard per rank (``k * n`` out),
``reduce_scatter`` of an ``n``-byte input (``n / k`` out), ``send_recv`` one ``n``-byte message
between two ranks (pairs ``i <-> i + k/2`` of each group, both directions at once).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as tdist

from fleet.planner.types import LINK_OPS, LinkFit, link_key

DEFAULT_SIZES = (16 << 10, 256 << 10, 2 << 20, 16 << 20)
"""Message sizes in bytes (16 KiB .. 16 MiB)."""

MIN_SIZES = 3
"""Sizes every fit measures whatever the time budget (latency and bandwidth both need some)."""


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> LinkFit:
    """``t = alpha + beta * n`` through ``(n, t)`` points by least squares on the relative
    error (weights ``1 / t**2``, so the small messages' latency counts as much as the large
    ones' bandwidth), alpha and beta kept >= 0."""
    pts = [(float(x), float(y)) for x, y in points if y > 0]
    if not pts:
        return LinkFit(0.0, 0.0)
    w = [1.0 / (y * y) for _, y in pts]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, pts)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, pts)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, pts))
    beta = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, pts)) / sxx if sxx > 0 else 0.0
    alpha = my - beta * mx
    if beta < 0:
        return LinkFit(max(0.0, my), 0.0)
    if alpha < 0:
        sxx0 = sum(wi * x * x for wi, (x, _) in zip(w, pts))
        sxy0 = sum(wi * x * y for wi, (x, y) in zip(w, pts))
        return LinkFit(0.0, sxy0 / sxx0 if sxx0 else 0.0)
    return LinkFit(alpha, beta)


def group_layouts(
    world: int, nnodes: int, nproc_per_node: int
) -> list[tuple[int, bool, list[list[int]]]]:
    """``(k, spans_nodes, groups)`` for every measured shape: consecutive groups of ``k``
    within a node, and strided groups of ``k`` (stride ``world / k``) that span nodes."""
    out = []
    for k in range(2, world + 1):
        if world % k:
            continue
        if nproc_per_node % k == 0:
            out.append((k, False, [list(range(s, s + k)) for s in range(0, world, k)]))
        if nnodes > 1:
            stride = world // k
            groups = [[s + i * stride for i in range(k)] for s in range(stride)]
            nodes = {r // nproc_per_node for r in groups[0]}
            if len(nodes) > 1:
                out.append((k, True, groups))
    return out


def _mine(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


def _op(
    name: str, group: Any, ranks: list[int], rank: int, nbytes: int, device: torch.device
) -> Callable[[], None]:
    numel = max(1, nbytes // 4)
    k = len(ranks)
    x = torch.ones(numel, device=device)
    if name == "all_reduce":
        return lambda: tdist.all_reduce(x, group=group)
    if name == "broadcast":
        return lambda: tdist.broadcast(x, src=ranks[0], group=group)
    if name == "all_gather":
        out = torch.empty(numel * k, device=device)
        return lambda: tdist.all_gather_into_tensor(out, x, group=group)
    if name == "reduce_scatter":
        per = max(1, numel // k)
        xin = torch.ones(per * k, device=device)
        out = torch.empty(per, device=device)
        return lambda: tdist.reduce_scatter_tensor(out, xin, group=group)
    if name == "send_recv":
        i = ranks.index(rank)
        half = k // 2
        peer = ranks[i + half] if i < half else ranks[i - half]
        buf = torch.empty(numel, device=device)

        def send_recv() -> None:
            reqs = [tdist.isend(x, peer), tdist.irecv(buf, peer)]
            for r in reqs:
                r.wait()

        return send_recv
    raise ValueError(f"unknown collective {name!r}; known: {LINK_OPS}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _world_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t.item())


def measure_links(
    world: int,
    nnodes: int,
    nproc_per_node: int,
    sizes: Sequence[int] = DEFAULT_SIZES,
    groups: dict[tuple[int, bool], Any] | None = None,
    reps: int = 3,
    budget_s: float = 0.25,
    device: torch.device | None = None,
) -> dict[str, LinkFit]:
    """Fits of every op of LINK_OPS per group shape (see the module docstring); collective:
    every rank of the default group calls it with the same arguments.

    ``groups``: ``(k, spans_nodes) -> this rank's process group`` already made with
    :func:`group_layouts`'s groups (others are made here; every rank makes every group).
    ``budget_s``: after :data:`MIN_SIZES` sizes, an op stops growing its message when the
    next size would take longer than this (its runs, extrapolated from the last size's slowest rank), so a slow machine
    measures fewer sizes.
    """
    rank = tdist.get_rank()
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if tdist.get_backend() == "nccl"
            else torch.device("cpu")
        )
    groups = dict(groups or {})
    fits: dict[str, LinkFit] = {}
    for k, spans, layout in group_layouts(world, nnodes, nproc_per_node):
        if (k, spans) not in groups:
            made = None
            for ranks in layout:
                g = tdist.new_group(ranks)
                if rank in ranks:
                    made = g
            groups[(k, spans)] = made
        group = groups[(k, spans)]
        ranks = _mine(layout, rank)
        for name in LINK_OPS:
            if name == "send_recv" and k != 2:
                continue  # a pipeline's messages go between two ranks
            points: list[tuple[float, float]] = []
            for nbytes in sorted(sizes):
                if len(points) >= MIN_SIZES:
                    n0, t0 = points[-1]
                    if t0 * nbytes / n0 * (reps + 1) > budget_s:
                        break  # the next size would take too long: fit what we have
                run = _op(name, group, ranks, rank, nbytes, device)
                times = []
                tdist.barrier()  # every group starts together; then back to back
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    for rep in range(reps + 1):
                        _sync(device)
                        start = time.perf_counter()
                        run()
                        _sync(device)
                        if rep:
                            times.append(time.perf_counter() - start)
                points.append((float(nbytes), _world_max(statistics.median(times), device)))
            fits[link_key(name, k, spans)] = fit_alpha_beta(points)
    return fits


__all__ = ["DEFAULT_SIZES", "fit_alpha_beta", "group_layouts", "measure_links"]
