"""``fleet.train_from_dataset``: the short training loop over a :mod:`fleet.data` dataset.

Paddle's ``exe.train_from_dataset(program, dataset, fetch_list=..., print_period=...)`` runs a
static program over a dataset's batches. On torch the program is a model, an optimizer and a
loss function::

    dataset = fleet.InMemoryDataset()
    dataset.init(batch_size=512, thread_num=2, use_var=slots)
    dataset.set_filelist(fleet.util.get_file_shard(files)); dataset.load_into_memory()
    stats = fleet.train_from_dataset(model, opt, dataset, torch.nn.BCEWithLogitsLoss(),
                                     label="click", print_period=100)

Each batch is a mapping slot name → tensor (dense slots) or jagged sparse slot; ``model`` gets
the mapping without the ``label`` slot and returns logits (or whatever ``loss_fn`` takes), then
``loss_fn(output, label_tensor)``, ``backward``, ``optimizer.step()``, ``zero_grad()``. Every
``print_period`` batches one line shows progress (a bar when the dataset knows its size),
examples/s, the mean loss, this trainer's AUC (binary labels; ``sigmoid`` of the output when
``output_is_logits``) and the ``fetch`` values, and a second line where the step time went:
the share of each phase (data, pull wait, forward, backward, push/optimizer, other; see
:data:`fleet.telemetry.PHASES`), timed by a few ``perf_counter`` reads per step with or without
metrics, observed in ``fleet_trainer_phase_seconds`` when metrics are on, totalled in
:attr:`TrainStats.phase_seconds`. The AUC over every trainer
(:func:`fleet.metrics.auc`) is computed once at the end, when all trainers have finished their
shard: a collective in the middle of the loop would hang trainers whose shards differ in length.
Where we differ from Paddle: no program or scope; ``fetch`` takes callables, not variable names.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
import torch.distributed as tdist

import fleet.metrics as metrics
import fleet.telemetry as telemetry
from collective.errors import ConfigError
from fleet.base import lookahead
from fleet.base.runtime import current_runtime
from fleet.heter.model import HeterModel
from fleet.ps import runtime as ps_runtime
from fleet.ps import threads as ps_threads
from fleet.ps.auto_prefetch import PREFETCHER

logger = logging.getLogger(__name__)

Fetch = Callable[[Any, Mapping[str, Any], torch.Tensor], Any]
"""``fetch`` value: called as ``f(output, batch, loss)`` at a print step; its result is printed."""


@dataclass(frozen=True)
class TrainStats:
    """What :func:`train_from_dataset` measured on this trainer (``auc`` over every trainer)."""

    steps: int
    """Batches trained."""
    examples: int
    """Examples trained (sum of batch sizes)."""
    seconds: float
    """Wall time of the loop."""
    mean_loss: float
    """Mean of the per-batch losses (nan without batches)."""
    local_auc: float
    """AUC of this trainer's predictions (nan when ``auc`` is off or one class is missing)."""
    auc: float
    """AUC over every trainer of the job (:func:`fleet.metrics.auc`; nan when off)."""
    phase_seconds: Mapping[str, float] = field(default_factory=dict)
    """Seconds of the pass spent in each step phase (:data:`fleet.telemetry.LOOP_PHASES`:
    data, pull_wait, forward, backward, push_optimizer, other); they add up to the time of
    the steps."""

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else math.nan


def train_from_dataset(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Iterable[Mapping[str, Any]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    label: str = "label",
    print_period: int = 100,
    fetch: Mapping[str, Fetch] | None = None,
    auc: bool = True,
    output_is_logits: bool = True,
    max_steps: int | None = None,
    out: TextIO | None = None,
    thread_num: int | None = None,
) -> TrainStats:
    """Train ``model`` one pass over ``dataset``; print a line every ``print_period`` batches.

    ``label``: the slot holding the target (removed from the model's input). ``fetch``: extra
    values for the progress line, name → ``f(output, batch, loss)``. ``auc``: keep the
    4096-bucket AUC histograms (binary labels). ``max_steps``: stop early (e.g. smoke runs).
    ``out``: where the progress lines go (default stderr, rank 0 of the trainers only).
    ``thread_num``: training threads (Paddle's name; None = the dataset's ``thread_num``, 1
    when it has none): in async, half-async and GEO mode each thread takes whole batches and
    runs forward, backward and the step on a copy of the model sharing its parameters
    (hogwild, :mod:`fleet.ps.threads`); sync mode and jobs without parameter servers train
    with one thread. The counts, losses, AUC and step-time phases add up over the threads.
    A :class:`fleet.heter.HeterModel` trains by ``model.train_step(inputs, label, optimizer)``
    (the heter worker computes the loss; ``optimizer`` may be None when ``cpu_part`` has no
    dense parameters) on one thread; in async mode the stats count the micro-batches whose
    gradients came back, not the last ``max_in_flight`` flushed at the end.
    Returns the :class:`TrainStats`; every trainer must call it (the final AUC is a collective).
    """
    if not isinstance(print_period, int) or print_period < 1:
        raise ConfigError(f"must be a positive integer, got {print_period!r}", key="print_period")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 0):
        raise ConfigError(f"must be None or an integer >= 0, got {max_steps!r}", key="max_steps")
    comm = ps_runtime.current_communicator()
    n_threads = ps_threads.resolve(thread_num, dataset, comm.mode if comm is not None else None)
    if n_threads > 1:
        from fleet.ps import pass_cache

        busy = ps_runtime.lookup_source_in_force() or pass_cache.in_pass()
        n_threads = ps_threads.check_shareable(n_threads, optimizer, comm, busy)
    if isinstance(model, HeterModel) and n_threads > 1:
        raise ConfigError(
            f"a fleet.heter.HeterModel trains on one thread (got thread_num={n_threads}); its "
            "micro-batches in flight overlap the heter worker's work (heter_configs.max_in_flight)",
            key="thread_num",
        )
    rank = _trainer_rank()
    run = _Pass(
        loss_fn,
        label,
        print_period,
        dict(fetch or {}),
        metrics.AucState() if auc else None,
        output_is_logits,
        max_steps,
        _dataset_size(dataset),
        out if out is not None else (sys.stderr if rank == 0 else None),
    )
    model.train()
    opened_pass = _begin_pass(dataset, label)  # pass-cached PS embeddings: fleet.ps.pass_cache
    with run.timer:
        batches = iter(dataset if lookahead.looks_ahead(dataset) else lookahead.batches(dataset))
        run.start = run.period_start = time.perf_counter()
        if n_threads == 1:
            run.train(batches, model, optimizer, None, threaded=False)
        else:
            _train_threads(run, batches, model, optimizer, comm, n_threads)
        run.timer.total[-1] += run.printing
    if opened_pass:
        _end_pass()
    seconds = time.perf_counter() - run.start
    steps, examples, state = run.steps, run.examples, run.state
    local_auc = _local_auc(state)
    global_auc = _global_auc(state) if state is not None else math.nan
    stats = TrainStats(
        steps,
        examples,
        seconds,
        run.loss_sum / steps if steps else math.nan,
        local_auc,
        global_auc,
        dict(zip(telemetry.LOOP_PHASES, run.timer.total)),
    )
    stream = run.stream
    if stream is not None:
        threads_note = f" on {n_threads} threads" if n_threads > 1 else ""
        stream.write(
            f"[train] done: {steps} batches, {examples} examples in {seconds:.1f} s{threads_note} "
            f"({stats.examples_per_second:.0f} ex/s), mean loss {stats.mean_loss:.5f}, "
            f"auc {global_auc:.5f} (all trainers)\n"
        )
        if steps:
            stream.write(
                f"[train] step-time (whole pass): {format_shares(run.timer.total, steps)}\n"
            )
        stream.flush()
    return stats


def _train_threads(
    run: _Pass,
    batches: Iterator[Mapping[str, Any]],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    comm: Any,
    n_threads: int,
) -> None:
    """``n_threads`` hogwild threads over the shared iterator, each on its own model copy."""
    copies = []
    for _ in range(n_threads):
        replica, aliases = ps_threads.replicate(model)
        dense = [aliases.get(id(p), p) for p in comm.dense]
        copies.append((replica, dense))
    take = threading.Lock()
    run.read_ahead = n_threads
    run.prefetching = PREFETCHER.active()
    depth, stale = comm.prefetch_depth, comm.stale_steps
    comm.prefetch_depth = max(depth, 2 * n_threads + 1)
    comm.stale_steps = max(stale, n_threads - 1)

    def work(index: int, stop: threading.Event) -> None:
        replica, dense = copies[index]
        ps_threads.set_dense(dense)
        try:
            run.train(batches, replica, optimizer, (take, stop), threaded=True)
        finally:
            ps_threads.set_dense(None)

    try:
        ps_threads.Workers(n_threads, work).run()
    finally:
        comm.prefetch_depth, comm.stale_steps = depth, stale


class _Pass:
    """One pass of :func:`train_from_dataset`: the counts and sums every training thread adds
    to (under :attr:`lock`), and the step loop each thread runs (:meth:`train`)."""

    def __init__(
        self,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        label: str,
        print_period: int,
        fetch: dict[str, Fetch],
        state: metrics.AucState | None,
        output_is_logits: bool,
        max_steps: int | None,
        total: int | None,
        stream: TextIO | None,
    ) -> None:
        self.loss_fn, self.label, self.print_period, self.fetch = (
            loss_fn,
            label,
            print_period,
            fetch,
        )
        self.state, self.output_is_logits, self.max_steps = state, output_is_logits, max_steps
        self.total, self.stream = total, stream
        self.lock = threading.Lock()
        self.timer = telemetry.PhaseTimer()
        self.taken = self.steps = self.examples = 0
        self.loss_sum = self.period_loss = 0.0
        self.period_examples = 0
        self.start = self.period_start = 0.0
        self.printing = 0.0
        self.ahead: deque[Mapping[str, Any]] = deque()
        """Training threads: batches read and not yet taken."""
        self.read_ahead = 1
        """Training threads: batches kept read (one per thread: each batch is read, and its
        rows prefetched, about one step time of a thread before its forward)."""
        self.exhausted = False
        self.prefetching = False
        """Training threads: the automatic prefetch is on (async modes, ``prefetch`` on)."""

    def _next(
        self, batches: Iterator[Mapping[str, Any]], shared: tuple[threading.Lock, Any] | None
    ) -> Mapping[str, Any] | None:
        """The next batch (None: the pass, ``max_steps`` or a failed thread ended it)."""
        if shared is None:
            if self.max_steps is not None and self.taken >= self.max_steps:
                return None
            batch = next(batches, None)
            self.taken += batch is not None
            return batch
        take, stop = shared
        ps_threads.GATE.enter()
        ahead = self.ahead
        with take:
            batch = None
            if not stop.is_set() and (self.max_steps is None or self.taken < self.max_steps):
                while len(ahead) < self.read_ahead and not self.exhausted:
                    read = next(batches, None)
                    if read is None:
                        self.exhausted = True
                    else:
                        ahead.append(read)
                if ahead:
                    batch = ahead.popleft()
                    self.taken += 1
                    if self.prefetching:
                        PREFETCHER.take(batch, ahead[0] if ahead else None)
        PREFETCHER.run_deferred()  # prefetches of the batches read, outside the hand-off lock
        if batch is None:
            ps_threads.GATE.leave()
        return batch

    def train(
        self,
        batches: Iterator[Mapping[str, Any]],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        shared: tuple[threading.Lock, Any] | None,
        threaded: bool,
    ) -> None:
        """Train batches from ``batches`` until they end (one thread's loop)."""
        clock = time.perf_counter
        label, loss_fn = self.label, self.loss_fn
        pulls = ps_threads.pull_wait_seconds if threaded else telemetry.pull_wait_seconds
        params = [p for p in model.parameters()] if threaded else []
        first = True
        t_step = clock()
        while True:
            batch = self._next(batches, shared)
            t_data = clock()
            if batch is None:
                if isinstance(model, HeterModel):
                    model.flush()  # async: the micro-batches still in flight finish their steps
                break
            if label not in batch:
                raise ConfigError(
                    f"the batch has no slot {label!r} (slots: {sorted(batch)}); pass label= the "
                    "name of the label slot in use_var",
                    key="label",
                )
            inputs = {k: v for k, v in batch.items() if k != label}
            pulled = pulls()
            ended = telemetry.steps_ended()
            if isinstance(model, HeterModel):  # the cut: the heter worker computes the loss
                done = model.train_step(inputs, batch[label], optimizer)
                t_forward = t_backward = clock()
                pull_wait = pulls() - pulled
                if done is None:  # async: still in flight (counted when it comes back)
                    continue
                loss, output, target = done, model.last_output, model.last_target
                target = loss_target(loss_fn, output, target, label)
            else:
                output = model(inputs)
                target = loss_target(loss_fn, output, batch[label], label)
                loss = _loss(loss_fn, output, target, label, first=first)
                first = False
                t_forward = clock()
                pull_wait = pulls() - pulled
                loss.backward()
                t_backward = clock()
                optimizer.step()
            if threaded:
                for p in params:
                    p.grad = None
                ps_threads.GATE.leave()  # a step boundary: a checkpoint may cut here
            elif optimizer is not None:
                optimizer.zero_grad()
            t_optimizer = clock()
            size = int(target.shape[0])
            value = float(loss.detach())
            # a step ends here unless the optimizer or the PS communicator ended it already
            telemetry.report(loss=value, samples=size, step=telemetry.steps_ended() == ended)
            preds = positive_scores(output, self.output_is_logits)
            with self.lock:
                self.steps += 1
                self.examples += size
                self.loss_sum += value
                self.period_loss += value
                self.period_examples += size
                state = self.state
                if state is not None:
                    if preds is None:
                        logger.warning(
                            "train_from_dataset: the model's output has shape %s, neither one "
                            "score nor two class scores per example; no AUC (pass auc=False to "
                            "silence this)",
                            tuple(output.shape),
                        )
                        self.state = None
                    else:
                        state.update(preds, target.detach().reshape(-1))
                t_end = clock()
                self.timer.add(
                    t_data - t_step,
                    pull_wait,
                    t_forward - t_data - pull_wait,
                    t_backward - t_forward,
                    t_optimizer - t_backward,
                    t_end - t_optimizer + self.printing,
                )
                t_step, self.printing = t_end, 0.0
                if self.steps % self.print_period == 0 and self.stream is not None:
                    self._print(output, batch, loss, t_end)
                    t_step = clock()
                    self.printing = t_step - t_end  # the next step's "other": every second counts

    def _print(self, output: Any, batch: Mapping[str, Any], loss: Any, now: float) -> None:
        stream = self.stream
        assert stream is not None
        extras = {name: f(output, batch, loss) for name, f in self.fetch.items()}
        _print_line(
            stream,
            self.steps,
            self.examples,
            self.total,
            self.period_examples / (now - self.period_start),
            self.period_loss / self.print_period,
            _local_auc(self.state),
            extras,
        )
        stream.write(f"[train] step-time: {format_shares(self.timer.period, self.print_period)}\n")
        stream.flush()
        self.timer.reset_period()
        self.period_loss, self.period_examples, self.period_start = 0.0, 0, now


_FLOAT_TARGET_LOSSES = (
    torch.nn.BCEWithLogitsLoss,
    torch.nn.BCELoss,
    torch.nn.MSELoss,
    torch.nn.L1Loss,
    torch.nn.SmoothL1Loss,
    torch.nn.HuberLoss,
    torch.nn.SoftMarginLoss,
    torch.nn.MultiLabelSoftMarginLoss,
)
"""Losses whose target is a float tensor shaped like the output."""
_CLASS_TARGET_LOSSES = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss, torch.nn.MultiMarginLoss)
"""Losses whose target is one int64 class index per example."""


def loss_target(
    loss_fn: Callable[..., Any], output: Any, target: torch.Tensor, label: str = "label"
) -> torch.Tensor:
    """The label slot's tensor in the dtype and shape ``loss_fn`` takes.

    A dense label slot is int64 ``[B, 1]`` by default (``Slot("click", dense=True)``). The
    losses of :data:`_FLOAT_TARGET_LOSSES` get it as the output's float dtype, shaped like the
    output when the sizes agree; those of :data:`_CLASS_TARGET_LOSSES` get int64 ``[B]`` (a
    float label with whole values is converted; a fractional one is an error naming the slot).
    Any other callable gets the tensor as the slot holds it.
    """
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor):
        return target
    if isinstance(loss_fn, _FLOAT_TARGET_LOSSES):
        if target.dtype != output.dtype:
            target = target.to(output.dtype)
        if target.shape != output.shape and target.numel() == output.numel():
            target = target.reshape(output.shape)
        return target
    if isinstance(loss_fn, _CLASS_TARGET_LOSSES):
        if target.dim() == 2 and target.shape[1] == 1:
            target = target.reshape(-1)
        if target.dtype != torch.int64:
            if target.is_floating_point() and not bool((target == target.round()).all()):
                raise ConfigError(
                    f"slot {label!r} holds {target.dtype} values that are not whole numbers, but "
                    f"{type(loss_fn).__name__} takes class indices; declare the slot with "
                    f"Slot({label!r}, dense=True) (int64) or use a loss that takes float targets",
                    key="label",
                )
            target = target.to(torch.int64)
        return target
    return target


def _loss(
    loss_fn: Callable[..., Any], output: Any, target: Any, label: str, first: bool
) -> torch.Tensor:
    """``loss_fn(output, target)``; at the first batch a dtype clash names the slot and fix."""
    if not first:
        return loss_fn(output, target)
    try:
        return loss_fn(output, target)
    except RuntimeError as e:
        text = str(e)
        if not any(m in text for m in ("can't be cast", "scalar type", "dtype", "Expected object")):
            raise
        dtype = getattr(target, "dtype", type(target).__name__)
        raise ConfigError(
            f"the loss {getattr(loss_fn, '__name__', type(loss_fn).__name__)} failed on the "
            f"label slot {label!r} ({dtype}): {text.splitlines()[0]}. Declare the slot with the "
            f"dtype the loss takes (Slot({label!r}, dense=True, dtype='float32') for BCE-style "
            f"losses, the int64 default for class indices), or convert it in loss_fn",
            key="label",
        ) from e


def positive_scores(output: Any, output_is_logits: bool) -> torch.Tensor | None:
    """The positive class's score per example for the AUC: one score per example (sigmoid of a
    logit), or the second of two class scores (softmax of two logits); None otherwise."""
    if not isinstance(output, torch.Tensor):
        return None
    with torch.no_grad():
        out = output.detach()
        if out.dim() <= 1 or (out.dim() == 2 and out.shape[1] == 1):
            return (torch.sigmoid(out) if output_is_logits else out).reshape(-1)
        if out.dim() == 2 and out.shape[1] == 2:
            return torch.softmax(out, dim=1)[:, 1] if output_is_logits else out[:, 1]
    return None


def _begin_pass(dataset: Any, label: str) -> bool:
    """Open a pass of :mod:`fleet.ps.pass_cache` over ``dataset`` when this PS trainer has
    pass-cached embeddings (``cache="pass"`` or ``a_sync_configs.use_ps_gpu``)."""
    from fleet.ps import pass_api

    return pass_api.auto_begin(dataset, label)


def _end_pass() -> None:
    """Push the pass opened by :func:`_begin_pass` back to the servers."""
    from fleet.ps import pass_api

    pass_api.end_pass()


def _trainer_rank() -> int:
    """This trainer's index: fleet's (``fleet.worker_index()``: async/GEO PS trainers meeting
    through fleetrun's coordinator form no process group), else torch.distributed's, else 0."""
    rt = current_runtime()
    if rt is not None:
        return rt.env.rank
    return tdist.get_rank() if tdist.is_available() and tdist.is_initialized() else 0


def _local_auc(state: metrics.AucState | None) -> float:
    if state is None or state.num_instances == 0:
        return math.nan
    return state.local_auc()


def _global_auc(state: metrics.AucState) -> float:
    try:
        return state.auc()
    except ConfigError:  # one class missing everywhere: the AUC is undefined
        return math.nan


def _dataset_size(dataset: Any) -> int | None:
    for name in ("get_memory_data_size", "__len__"):
        fn = getattr(dataset, name, None)
        if fn is None:
            continue
        try:
            return int(fn())
        except (TypeError, NotImplementedError):
            return None
    return None


SHARE_NAMES = ("data", "pull", "fwd", "bwd", "push/opt", "other")
"""How the progress line names :data:`fleet.telemetry.LOOP_PHASES`."""


def format_shares(seconds: list[float], steps: int) -> str:
    """``data 2% pull 31% fwd 18% bwd 25% push/opt 20% other 4% (12.3 ms/step)``: each phase's
    share of the summed time of ``steps`` steps (``seconds`` in
    :data:`fleet.telemetry.LOOP_PHASES` order) and the mean step."""
    whole = sum(seconds)
    if whole <= 0 or steps <= 0:
        return "no steps"
    shares = " ".join(f"{n} {100 * s / whole:.0f}%" for n, s in zip(SHARE_NAMES, seconds))
    return f"{shares} ({1000 * whole / steps:.3g} ms/step)"


def _print_line(
    stream: TextIO,
    steps: int,
    examples: int,
    total: int | None,
    rate: float,
    loss: float,
    local_auc: float,
    extras: Mapping[str, Any],
) -> None:
    if total:
        done = min(examples / total, 1.0)
        bar = "#" * int(done * 20)
        progress = f"[{bar:<20}] {done * 100:5.1f}% "
    else:
        progress = ""
    extra = "".join(f"  {k} {v}" for k, v in extras.items())
    stream.write(
        f"[train] {progress}batch {steps}  {rate:.0f} ex/s  loss {loss:.5f}  "
        f"auc {local_auc:.5f}{extra}\n"
    )
    stream.flush()


__all__ = ["TrainStats", "format_shares", "train_from_dataset"]
