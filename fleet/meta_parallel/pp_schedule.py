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
waited for) and every receive an ``irecv`` posted *ahead of need*: the activation of micro-batch
``i + 1`` as soon as that of ``i`` has arrived (before ``i`` is computed), the gradient of an
activation as soon as the activation is sent (at most two ahead), the loss and the shape message
at the start of the step. gloo moves a message only once both sides have posted it (the side
that comes second triggers the transfer), so a receive posted late adds a notification round
trip to the critical path of every micro-batch; posted early, the data lands while this stage
computes (``torch.distributed.pipelining`` posts its receives just before waiting on them, which
is most of the difference in bench/bench_pipeline.py). gloo's send of an unbound buffer waits
for the peer to post the receive, so blocking sends would deadlock 1F1B (stage 0 sending
activation ``i+1`` while stage 1 sends gradient ``i`` back); asynchronous sends make any
schedule whose receives follow the data dependencies deadlock-free. Each direction of a pair
carries tensors in schedule order on tag 0, which gloo keeps (one ordered channel per peer and
tag, receives matched in the order they were posted); the loss travels on its own tag
(``LOSS_TAG``) so its early receive is not matched by a gradient.

Activation shapes: the sender describes its outputs (count, dtype, requires-grad flag, shape)
once per ``train_batch`` / ``eval_batch`` call, in one 64-integer message before the first
micro-batch; every micro-batch of a call has the same shapes (the batch is split evenly), and a
new call may change them (sequence length, eval batch). Shapes are cached without an extra
round trip: when a call starts, the receiver posts the receive of the description *and* of the
first activation with the previous call's shapes (a guess). The sender, which knows that
guess (it is what it sent last call), sends the description and, when the shapes changed, one
placeholder per guessed tensor before the real activation; the receiver reads the description,
and on a change discards the placeholder and posts the right receive. So in the steady state
(shapes unchanged) the first activation lands as early as any other, and a change costs one
extra message. Gradients travel back with the shapes of the activations they belong to, so
they need no description.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from collective.errors import ConfigError, FleetError
from fleet.strategy.configs import PipelineSchedule

META_INTS = 64
"""Length of the int64 message that describes one stage boundary's tensors."""

GRADS_AHEAD = 2
"""Most gradient receives a stage keeps posted ahead of need (the one awaited and the next)."""

LOSS_TAG = 1
"""Tag of the loss message (the activations and gradients travel on tag 0), so the loss
receive, posted at the start of a step, is not matched by a gradient."""

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
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
        raise ConfigError(
            f"stage {stage} of {p} with {m} micro-batches is impossible", key="pipeline_configs"
        )
    forwards = [Action("F", i) for i in range(m)]
    backwards = [Action("B", i) for i in range(m)]
    if mode is PipelineSchedule.F_THEN_B:
        return forwards + backwards
    warmup = min(p - stage - 1, m)
    actions = forwards[:warmup]
    for i in range(m - warmup):
        actions += [forwards[warmup + i], backwards[i]]
    actions += backwards[m - warmup :]
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
            raise ConfigError(
                f"cannot send a {t.dtype} tensor between pipeline stages; use one "
                f"of {[str(d) for d in _DTYPES]}",
                key="layers",
            )
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
        out.append((dtype, grad, tuple(ints[pos + 3 : pos + 3 + ndim])))
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
    (global ranks; None at the ends of the pipeline) on ``group``.

    Receives are posted ahead of need (see the module docstring): the activation of micro-batch
    ``i + 1`` as soon as that of ``i`` has arrived, and the gradient of an activation as soon as
    the activation is sent (at most ``GRADS_AHEAD`` at a time), so a message arrives while this
    stage computes instead of after it asks. :meth:`new_step` says how many activations a call
    moves, so nothing is posted beyond the call's last message; :attr:`outstanding` is 0
    between calls.
    """

    def __init__(self, group: Any, prev_rank: int | None, next_rank: int | None) -> None:
        self.group = group
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self.recv_meta: list[tuple[torch.dtype, bool, tuple[int, ...]]] | None = None
        self.sent_meta: list[bool] | None = None  # requires-grad flags of what we send forward
        self._num_micro = 0
        self._train = False
        self._fwd_posted = 0  # activations of this call whose receive is posted
        self._fwd_ahead: deque[tuple[list[Any], tuple[torch.Tensor, ...]]] = deque()
        self._bwd_ahead: deque[tuple[list[Any], list[torch.Tensor]]] = deque()
        self._bwd_todo: deque[list[tuple[tuple[int, ...], torch.dtype]]] = deque()
        self._loss_ahead: tuple[Any, torch.Tensor] | None = None
        self._meta_ahead: tuple[Any, torch.Tensor] | None = None
        self._sent_signature: list[tuple[torch.dtype, bool, tuple[int, ...]]] | None = None
        self._recv_cache: list[tuple[torch.dtype, bool, tuple[int, ...]]] | None = None
        self._sent_encoded: torch.Tensor | None = None

    def new_step(self, num_micro: int = 1, train: bool = True, with_loss: bool = False) -> None:
        """Start a call that moves ``num_micro`` activations per boundary (and, when ``train``,
        their gradients back; with ``with_loss``, the loss back from the last stage): post the
        receives of the description, of the first activation (guessing the previous call's
        shapes) and of the loss."""
        if (
            self._fwd_ahead
            or self._bwd_ahead
            or self._bwd_todo
            or self._loss_ahead is not None
            or self._meta_ahead is not None
        ):
            raise FleetError(
                f"pipeline stage transport: {len(self._fwd_ahead)} activation and "
                f"{len(self._bwd_ahead)} gradient receives of the previous call were never "
                "consumed (it stopped part-way); rebuild PipelineParallel after a failed step"
            )
        self.recv_meta = None
        self.sent_meta = None
        self._num_micro = num_micro
        self._train = train
        self._fwd_posted = 0
        if self.prev_rank is not None:  # the description of this call's activations
            works: list[Any] = []
            buf = self._irecv((META_INTS,), torch.int64, self.prev_rank, works)
            self._meta_ahead = (works[0], buf)
            if self._recv_cache is not None:  # and, guessing the last call's shapes, the first
                self._post_forward(self._recv_cache)
        if with_loss and self.next_rank is not None:  # posted now: it arrives during the step
            works = []
            buf = self._irecv((), torch.float32, self.next_rank, works, tag=LOSS_TAG)
            self._loss_ahead = (works[0], buf)

    def _isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        t = t.detach().contiguous()
        self._pending.append((tdist.isend(t, dst=dst, group=self.group, tag=tag), t))
        if len(self._pending) > 64:  # drop completed sends; bounded by the schedule anyway
            self._pending = [(w, b) for w, b in self._pending if not w.is_completed()]

    def _irecv(
        self, shape: tuple[int, ...], dtype: torch.dtype, src: int, works: list[Any], tag: int = 0
    ) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        works.append(tdist.irecv(buf, src=src, group=self.group, tag=tag))
        return buf

    def _post_forward(self, meta: list[tuple[torch.dtype, bool, tuple[int, ...]]]) -> None:
        assert self.prev_rank is not None
        works: list[Any] = []
        bufs = tuple(self._irecv(shape, dtype, self.prev_rank, works) for dtype, _, shape in meta)
        self._fwd_ahead.append((works, bufs))
        self._fwd_posted += 1

    def _post_backward(self) -> None:
        """Post the next gradient receive unless ``GRADS_AHEAD`` are posted already (under
        FThenB all ``m`` activations are sent before the first gradient is needed: posting
        every one at once would hold ``m`` gradient buffers)."""
        assert self.next_rank is not None
        if self._bwd_todo and len(self._bwd_ahead) < GRADS_AHEAD:
            works: list[Any] = []
            grads = [
                self._irecv(shape, dtype, self.next_rank, works)
                for shape, dtype in self._bwd_todo.popleft()
            ]
            self._bwd_ahead.append((works, grads))

    def send_forward(self, outputs: tuple[torch.Tensor, ...]) -> None:
        """Send this stage's outputs to the next stage (its description first, once a call),
        and post the receive of their gradients."""
        assert self.next_rank is not None
        if self.sent_meta is None:
            signature = [(t.dtype, t.requires_grad, tuple(t.shape)) for t in outputs]
            guessed = self._sent_signature  # what the next stage posted for this activation
            if signature != guessed:  # else the previous call's message is reused
                self._sent_signature, self._sent_encoded = signature, encode_meta(outputs)
            assert self._sent_encoded is not None
            self._isend(self._sent_encoded, self.next_rank)
            if guessed is not None and signature != guessed:  # fill the wrong guess, then send
                for dtype, _, shape in guessed:
                    self._isend(torch.empty(shape, dtype=dtype), self.next_rank)
            self.sent_meta = [t.requires_grad for t in outputs]
        for t in outputs:
            self._isend(t, self.next_rank)
        if self._train and any(self.sent_meta):
            self._bwd_todo.append(
                [(tuple(t.shape), t.dtype) for t, grad in zip(outputs, self.sent_meta) if grad]
            )
            self._post_backward()

    def recv_forward(self, requires_grad: bool) -> tuple[torch.Tensor, ...]:
        """The previous stage's outputs; float tensors that needed grad there need it here."""
        assert self.prev_rank is not None
        if self.recv_meta is None:
            assert self._meta_ahead is not None, "new_step() posts the description's receive"
            work, meta = self._meta_ahead
            self._meta_ahead = None
            work.wait()
            self.recv_meta = decode_meta(meta)
            if self._recv_cache is not None and self.recv_meta != self._recv_cache:
                guess_works, _ = self._fwd_ahead.popleft()  # the sender filled it: discard
                for w in guess_works:
                    w.wait()
                self._fwd_posted = 0
            self._recv_cache = self.recv_meta
        if not self._fwd_ahead:
            self._post_forward(self.recv_meta)
        works, bufs = self._fwd_ahead.popleft()
        if self._fwd_posted < self._num_micro:
            self._post_forward(self.recv_meta)  # the next one arrives while this one is computed
        for work in works:
            work.wait()
        if not requires_grad:
            return bufs
        return tuple(
            t.requires_grad_() if grad else t for t, (_, grad, _) in zip(bufs, self.recv_meta)
        )

    def send_backward(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Send the gradients of the received inputs that need one back to the previous stage
        (zeros for an input the stage did not use)."""
        assert self.prev_rank is not None and self.recv_meta is not None
        for t, (_, grad, _) in zip(inputs, self.recv_meta):
            if grad:
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                self._isend(g, self.prev_rank)

    def recv_backward(self, outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Gradients of this stage's outputs that require grad, from the next stage (their
        receive was posted by :meth:`send_forward`, in the same order)."""
        assert self.next_rank is not None and self.sent_meta is not None
        if not any(self.sent_meta):
            return []
        if not self._bwd_ahead:
            self._post_backward()
        works, grads = self._bwd_ahead.popleft()
        self._post_backward()  # the next gradient arrives while this one is used
        for work in works:
            work.wait()
        return grads

    def send_loss(self, loss: torch.Tensor) -> None:
        """Pass the step's loss (a float32 scalar) to the previous stage, if any."""
        if self.prev_rank is not None:
            self._isend(loss, self.prev_rank, tag=LOSS_TAG)

    def recv_loss(self) -> torch.Tensor:
        """The loss from the next stage (its receive was posted by :meth:`new_step`), passed on
        to the previous stage."""
        assert self._loss_ahead is not None, "new_step(with_loss=True) posts the loss receive"
        work, loss = self._loss_ahead
        self._loss_ahead = None
        work.wait()
        self.send_loss(loss)
        return loss

    @property
    def outstanding(self) -> int:
        """Receives posted and not yet consumed plus sends not yet waited for: 0 between calls."""
        return (
            len(self._fwd_ahead)
            + len(self._bwd_ahead)
            + len(self._bwd_todo)
            + len(self._pending)
            + (self._loss_ahead is not None)
            + (self._meta_ahead is not None)
        )

    def wait_all(self) -> None:
        """Block until every send of this step has completed."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


__all__ = [
    "GRADS_AHEAD",
    "LOSS_TAG",
    "META_INTS",
    "P2P",
    "Action",
    "as_tensor_tuple",
    "decode_meta",
    "encode_meta",
    "make_schedule",
    "max_in_flight",
]
