"""The communication API: paddle.distributed-style functions over ``torch.distributed``.

Every function delegates straight to the matching ``torch.distributed`` call on the caller's
tensor: no copies, no extra synchronisation, no wrapper objects on the hot path (the benchmark
``bench/bench_allreduce.py`` holds us to >= 0.97 of torch's bus bandwidth). What this module adds
is Paddle's calling convention:

* ``sync_op=True`` (default) blocks like torch's ``async_op=False`` and returns None;
  ``sync_op=False`` returns the torch ``Work`` (``.wait()``, ``.is_completed()``).
* :class:`ReduceOp` has Paddle's names and values (``SUM=0, MAX=1, MIN=2, PROD=3, AVG=4``);
  torch's own ``torch.distributed.ReduceOp`` members are accepted as well.
* ``ReduceOp.AVG`` works on every backend: NCCL on CUDA tensors does it natively; elsewhere (gloo
  has no AVG) it is a SUM followed by an in-place divide by the group size (truncating for integer
  tensors, as NCCL does).
* ``all_gather`` / ``all_gather_object`` fill an empty output list (Paddle appends to it).
* ``scatter`` takes ``tensor_list`` on every rank and ignores it off the source rank.

``src`` and ``dst`` are **global** ranks, as in Paddle and torch, also when ``group`` is a
sub-group. Malformed arguments raise :class:`collective.errors.ConfigError` naming the argument
and the value; communication failures are torch's own errors, unchanged.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.distributed as tdist

from collective.errors import ConfigError

logger = logging.getLogger(__name__)

Group = tdist.ProcessGroup | None
"""A process group from :func:`collective.new_group`; None is the default (world) group."""


class ReduceOp:
    """Reduction of :func:`all_reduce` and :func:`reduce`: Paddle's names and (int) values.

    Plain int constants as in Paddle, not an ``Enum``: reading an Enum member costs ~0.3 us per
    call on Python 3.11, which this thin API does not add to every collective.
    """

    SUM = 0
    MAX = 1
    MIN = 2
    PROD = 3
    AVG = 4


REDUCE_OP_NAMES: dict[int, str] = {0: "SUM", 1: "MAX", 2: "MIN", 3: "PROD", 4: "AVG"}
"""Name of each :class:`ReduceOp` value."""

_RedOpType = type(tdist.ReduceOp.SUM)
_TORCH_AVG = tdist.ReduceOp.AVG
_BY_VALUE: dict[int, tuple[Any, bool]] = {
    ReduceOp.SUM: (tdist.ReduceOp.SUM, False),
    ReduceOp.MAX: (tdist.ReduceOp.MAX, False),
    ReduceOp.MIN: (tdist.ReduceOp.MIN, False),
    ReduceOp.PROD: (tdist.ReduceOp.PRODUCT, False),
    ReduceOp.AVG: (tdist.ReduceOp.AVG, True),
}
_TORCH_MEMBERS = [getattr(tdist.ReduceOp, n) for n in tdist.ReduceOp.RedOpType.__members__]
# Hot path: one dict lookup by object identity (the keys are kept alive here, so a hit is exact).
# ReduceOp's values are CPython's cached small ints, so Paddle-style ``op=0`` hits as well.
# torch's RedOpType compares equal to ints (RedOpType.AVG == 1 == ReduceOp.MAX): keying by value
# would confuse the two families.
_BY_ID: dict[int, tuple[Any, bool]] = {id(k): v for k, v in _BY_VALUE.items()}
_BY_ID.update({id(m): (m, m == _TORCH_AVG) for m in _TORCH_MEMBERS})


def _resolve_op(op: Any) -> tuple[Any, bool]:
    """(torch op, is AVG) for ``op``; the slow path of the identity lookup."""
    if isinstance(op, _RedOpType):
        return op, op == _TORCH_AVG
    if not isinstance(op, bool):
        try:
            return _BY_VALUE[operator.index(op)]
        except (KeyError, TypeError):
            pass
    allowed = ", ".join(f"ReduceOp.{n}" for n in REDUCE_OP_NAMES.values())
    raise ConfigError(f"{op!r} is not a reduce operation; use one of {allowed}", key="op")


def to_torch_op(op: int | Any) -> Any:
    """The ``torch.distributed.ReduceOp`` for ``op`` (a :class:`ReduceOp` value, or a torch
    ``ReduceOp`` member, returned as is). Anything else raises :class:`ConfigError`."""
    return (_BY_ID.get(id(op)) or _resolve_op(op))[0]


def _native_avg(tensor: torch.Tensor, group: Group) -> bool:
    """True when the backend reduces with AVG itself (NCCL on CUDA tensors)."""
    return tensor.is_cuda and "nccl" in str(tdist.get_backend(group))


def _divide_(tensor: torch.Tensor, divisor: int) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(divisor)
    else:
        tensor.div_(divisor, rounding_mode="trunc")


class _DivideOnWait:
    """Task of an emulated AVG with ``sync_op=False``: the SUM's Work, then the divide on wait."""

    def __init__(self, work: Any, tensor: torch.Tensor, divisor: int | None) -> None:
        self._work = work
        self._tensor = tensor
        self._divisor = divisor  # None: this rank only takes part (reduce off dst)

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the SUM, then divide in place (once)."""
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        if self._divisor is not None:
            _divide_(self._tensor, self._divisor)
            self._divisor = None
        return bool(done) if done is not None else True

    def is_completed(self) -> bool:
        """True when the SUM has finished and :meth:`wait` has applied the divide."""
        return self._work.is_completed() and self._divisor is None


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, sync_op: bool = True) -> Any:
    """Send ``tensor`` of global rank ``src`` to every rank of ``group``, in place.

    Returns None, or the torch ``Work`` when ``sync_op=False``.
    """
    return tdist.broadcast(tensor, src, group, not sync_op)


def all_reduce(
    tensor: torch.Tensor,
    op: int | Any = ReduceOp.SUM,
    group: Group = None,
    sync_op: bool = True,
) -> Any:
    """Reduce ``tensor`` across ``group`` with ``op``; every rank gets the result in place.

    Returns None, or a task with ``.wait()`` when ``sync_op=False`` (the torch ``Work``, or for an
    emulated AVG a task that divides when waited on).
    """
    top, avg = _BY_ID.get(id(op)) or _resolve_op(op)
    if avg and not _native_avg(tensor, group):
        n = tdist.get_world_size(group)
        work = tdist.all_reduce(tensor, tdist.ReduceOp.SUM, group, not sync_op)
        if not sync_op:
            return _DivideOnWait(work, tensor, n)
        _divide_(tensor, n)
        return None
    return tdist.all_reduce(tensor, top, group, not sync_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: int | Any = ReduceOp.SUM,
    group: Group = None,
    sync_op: bool = True,
) -> Any:
    """Reduce ``tensor`` across ``group`` with ``op`` into ``tensor`` of global rank ``dst``.

    Other ranks' ``tensor`` may be used as scratch space by the backend (as in torch).
    Returns None, or a task with ``.wait()`` when ``sync_op=False``.
    """
    top, avg = _BY_ID.get(id(op)) or _resolve_op(op)
    if avg and not _native_avg(tensor, group):
        n = tdist.get_world_size(group) if tdist.get_rank() == dst else None
        work = tdist.reduce(tensor, dst, tdist.ReduceOp.SUM, group, not sync_op)
        if not sync_op:
            return _DivideOnWait(work, tensor, n)
        if n is not None:
            _divide_(tensor, n)
        return None
    return tdist.reduce(tensor, dst, top, group, not sync_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Group = None,
    sync_op: bool = True,
) -> Any:
    """Gather ``tensor`` of every rank of ``group`` into ``tensor_list`` (by group rank).

    ``tensor_list`` is either empty (new tensors like ``tensor`` are appended, as in Paddle) or
    holds exactly one tensor per rank of the group, filled in place.
    Returns None, or the torch ``Work`` when ``sync_op=False``.
    """
    n = tdist.get_world_size(group)
    if not tensor_list:
        tensor_list.extend(torch.empty_like(tensor) for _ in range(n))
    elif len(tensor_list) != n:
        raise ConfigError(
            f"got {len(tensor_list)} tensors but the group has {n} ranks; pass an "
            f"empty list or one tensor per rank",
            key="tensor_list",
        )
    return tdist.all_gather(tensor_list, tensor, group, not sync_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Group = None) -> None:
    """Gather the picklable ``obj`` of every rank of ``group`` into ``object_list``.

    ``object_list`` is either empty (filled by appending, as in Paddle) or has one slot per rank,
    overwritten. Blocking. Objects are pickled: only use it with trusted peers.
    """
    n = tdist.get_world_size(group)
    if not object_list:
        object_list.extend([None] * n)
    elif len(object_list) != n:
        raise ConfigError(
            f"got {len(object_list)} entries but the group has {n} ranks; pass an "
            "empty list or one slot per rank",
            key="object_list",
        )
    tdist.all_gather_object(object_list, obj, group)


def scatter(
    tensor: torch.Tensor,
    tensor_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Group = None,
    sync_op: bool = True,
) -> Any:
    """Global rank ``src`` sends ``tensor_list[i]`` to group rank ``i``, received into ``tensor``.

    ``tensor_list`` must hold one tensor per rank of the group on ``src``; on other ranks it is
    ignored (Paddle lets every rank pass it). Returns None, or the torch ``Work`` when
    ``sync_op=False``.
    """
    if tdist.get_rank() != src:
        return tdist.scatter(tensor, None, src, group, not sync_op)
    n = tdist.get_world_size(group)
    if tensor_list is None or len(tensor_list) != n:
        seen = None if tensor_list is None else f"{len(tensor_list)} tensors"
        raise ConfigError(
            f"got {seen} on source rank {src}, but it needs one tensor per rank of the group ({n})",
            key="tensor_list",
        )
    return tdist.scatter(tensor, list(tensor_list), src, group, not sync_op)


def barrier(group: Group = None) -> None:
    """Block until every rank of ``group`` has reached this call."""
    tdist.barrier(group)


def send(tensor: torch.Tensor, dst: int, group: Group = None, sync_op: bool = True) -> Any:
    """Send ``tensor`` to global rank ``dst``.

    Returns None, or the torch ``Work`` when ``sync_op=False`` (same as :func:`isend`).
    """
    if sync_op:
        tdist.send(tensor, dst, group)
        return None
    return tdist.isend(tensor, dst, group)


def recv(tensor: torch.Tensor, src: int, group: Group = None, sync_op: bool = True) -> Any:
    """Receive into ``tensor`` from global rank ``src``.

    Returns None, or the torch ``Work`` when ``sync_op=False`` (same as :func:`irecv`).
    """
    if sync_op:
        tdist.recv(tensor, src, group)
        return None
    return tdist.irecv(tensor, src, group)


def isend(tensor: torch.Tensor, dst: int, group: Group = None) -> Any:
    """Start sending ``tensor`` to global rank ``dst``; returns a task (torch ``Work``).

    Do not modify ``tensor`` before the task's ``.wait()`` returns.
    """
    return tdist.isend(tensor, dst, group)


def irecv(tensor: torch.Tensor, src: int, group: Group = None) -> Any:
    """Start receiving into ``tensor`` from global rank ``src``; returns a task (torch ``Work``).

    ``tensor`` holds the data once the task's ``.wait()`` returns.
    """
    return tdist.irecv(tensor, src, group)


def wait(task: Any) -> None:
    """Wait for a task returned by ``sync_op=False``, :func:`isend` or :func:`irecv`.

    ``None`` (what a ``sync_op=True`` call returns) is accepted and returns at once.
    """
    if task is None:
        return
    waiter = getattr(task, "wait", None)
    if waiter is None:
        raise ConfigError(
            f"{task!r} is not a communication task (it has no .wait()); pass what "
            "isend/irecv or a sync_op=False call returned",
            key="task",
        )
    waiter()


__all__ = [
    "REDUCE_OP_NAMES",
    "ReduceOp",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "scatter",
    "send",
    "to_torch_op",
    "wait",
]
