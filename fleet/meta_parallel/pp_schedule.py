"""Pipeline schedules (pure) and the point-to-point transport between neighbouring stages.

Schedules are plain data: :func:`make_schedule` returns, for one stage, the ordered list of
``Action("F", i)`` (forward of micro-batch ``i``) and ``Action("B", i)`` (its backward):

* ``1F1B`` (PipeDream-flush / Megatron): stage ``s`` of ``p`` runs ``min(p - s - 1, m)``
  warm-up forwards, then alternates one forward and one backward, then drains the backwards.
  At most ``p - s`` micro-batches are in flight on stage ``s``, so the activations kept for
  backward are bounded by the number of stages, not by the number of micro-batches ``m``.
* ``FThenB`` (GPipe): all ``m`` forwards, then all backwards; ``m`` micro-batches in flight.

Both have the same bubble, ``(p - 1) / (m + p - 1)`` of the step.

Transport (:class:`P2P`): every send is ``isend`` (kept until the end of the step, when it is
waited for) and every receive a blocking ``irecv().wait()``. gloo's send of an unbound buffer
waits for the peer to post the receive, so blocking sends would deadlock 1F1B (stage 0 sending
activation ``i+1`` while stage 1 sends gradient ``i`` back); asynchronous sends make any
schedule whose receives follow the data dependencies deadlock-free, and overlap the transfer
with the next compute. Each direction of a pair carries tensors in schedule order, which gloo
keeps (one ordered channel per peer and tag).

Activation shapes: the sender describes its outputs (count, dtype, requires-grad flag, shape)
once per ``train_batch`` / ``eval_batch`` call, in one 64-integer message before the first
micro-batch; every micro-batch of a call has the same shapes (the batch is split evenly), and a
new call may change them (sequence length, eval batch). Gradients travel back with the shapes
of the activations they belong to, so they need no description. One small message per step
per stage boundary costs about one gloo round trip (measured in bench/bench_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from collective.errors import ConfigError
from fleet.strategy_configs import PipelineSchedule

META_INTS = 64
"""Length of the int64 message that describes one stage boundary's tensors."""

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of
    micro-batch ``micro_batch``."""

    kind: str
    micro_batch: int


def make_schedule(
    mode: PipelineSchedule | str, num_stages: int, stage: int, num_micro_batches: int
) -> list[Action]:
    """The ordered actions of ``stage`` for one training step (see the module docstring)."""
    mode = PipelineSchedule(mode)
    p, m = num_stages, num_micro_batches
    if not 0 <= stage < p or m < 1:
        raise ConfigError(f"stage {stage} of {p} with {m} micro-batches is impossible",
                          key="pipeline_configs")
    forwards = [Action("F", i) for i in range(m)]
    backwards = [Action("B", i) for i in range(m)]
    if mode is PipelineSchedule.F_THEN_B:
        return forwards + backwards
    warmup = min(p - stage - 1, m)
    actions = forwards[:warmup]
    for i in range(m - warmup):
        actions += [forwards[warmup + i], backwards[i]]
    actions += backwards[m - warmup:]
    return actions


def max_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches forwarded but not yet backwarded at any point of ``actions``."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def encode_meta(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The int64 description of ``tensors`` (see the module docstring)."""
    ints = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise ConfigError(f"cannot send a {t.dtype} tensor between pipeline stages; use one "
                              f"of {[str(d) for d in _DTYPES]}", key="layers")
        ints += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    if len(ints) > META_INTS:
        raise ConfigError(
            f"a stage's output of {len(tensors)} tensors with shapes "
            f"{[tuple(t.shape) for t in tensors]} is too large to describe in {META_INTS} "
            "integers; pass fewer tensors between stages",
            key="layers",
        )
    return torch.tensor(ints + [0] * (META_INTS - len(ints)), dtype=torch.int64)


def decode_meta(meta: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    """(dtype, requires_grad, shape) of every tensor described by ``meta``."""
    ints = meta.tolist()
    out, pos = [], 1
    for _ in range(ints[0]):
        dtype, grad, ndim = _DTYPES[ints[pos]], bool(ints[pos + 1]), ints[pos + 2]
        out.append((dtype, grad, tuple(ints[pos + 3:pos + 3 + ndim])))
        pos += 3 + ndim
    return out


def as_tensor_tuple(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    """A stage's output as a tuple of tensors; ConfigError for anything else."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise ConfigError(
            f"{what} must be a tensor or a tuple of tensors to travel between pipeline stages, "
            f"got {type(value).__name__}",
            key="layers",
        )
    return tuple(items)


class P2P:
    """Sends and receives between this stage and its neighbours ``prev_rank`` / ``next_rank``
    (global ranks; None at the ends of the pipeline) on ``group``."""

    def __init__(self, group: Any, prev_rank: int | None, next_rank: int | None) -> None:
        self.group = group
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self.recv_meta: list[tuple[torch.dtype, bool, tuple[int, ...]]] | None = None
        self.sent_meta: list[bool] | None = None  # requires-grad flags of what we send forward

    def new_step(self) -> None:
        """Forget the shapes of the previous call (they are sent again once)."""
        self.recv_meta = None
        self.sent_meta = None

    def _isend(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        self._pending.append((tdist.isend(t, dst=dst, group=self.group), t))
        if len(self._pending) > 64:  # drop completed sends; bounded by the schedule anyway
            self._pending = [(w, b) for w, b in self._pending if not w.is_completed()]

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        tdist.irecv(buf, src=src, group=self.group).wait()
        return buf

    def send_forward(self, outputs: tuple[torch.Tensor, ...]) -> None:
        """Send this stage's outputs to the next stage (its description first, once a call)."""
        assert self.next_rank is not None
        if self.sent_meta is None:
            self._isend(encode_meta(outputs), self.next_rank)
            self.sent_meta = [t.requires_grad for t in outputs]
        for t in outputs:
            self._isend(t, self.next_rank)

    def recv_forward(self, requires_grad: bool) -> tuple[torch.Tensor, ...]:
        """The previous stage's outputs; float tensors that needed grad there need it here."""
        assert self.prev_rank is not None
        if self.recv_meta is None:
            meta = self._recv((META_INTS,), torch.int64, self.prev_rank)
            self.recv_meta = decode_meta(meta)
        tensors = []
        for dtype, grad, shape in self.recv_meta:
            t = self._recv(shape, dtype, self.prev_rank)
            tensors.append(t.requires_grad_() if grad and requires_grad else t)
        return tuple(tensors)

    def send_backward(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Send the gradients of the received inputs that need one back to the previous stage
        (zeros for an input the stage did not use)."""
        assert self.prev_rank is not None and self.recv_meta is not None
        for t, (_, grad, _) in zip(inputs, self.recv_meta):
            if grad:
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                self._isend(g, self.prev_rank)

    def recv_backward(self, outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Gradients of this stage's outputs that require grad, from the next stage."""
        assert self.next_rank is not None and self.sent_meta is not None
        return [self._recv(tuple(t.shape), t.dtype, self.next_rank)
                for t, grad in zip(outputs, self.sent_meta) if grad]

    def wait_all(self) -> None:
        """Block until every send of this step has completed."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


__all__ = [
    "META_INTS",
    "P2P",
    "Action",
    "as_tensor_tuple",
    "decode_meta",
    "encode_meta",
    "make_schedule",
    "max_in_flight",
]
