"""Training threads of a parameter-server trainer (Paddle's ``thread_num`` hogwild workers).

Paddle's ``exe.train_from_dataset`` runs ``thread_num`` worker threads in one trainer process;
each takes whole batches from the dataset and runs forward, backward and the push against
parameters all threads share. :func:`fleet.train_from_dataset` does the same in the async,
half-async and GEO modes (torch's kernels release the GIL, so a second thread adds
throughput). This module holds what the loop needs for it:

- :func:`resolve`: how many threads a pass trains with (``thread_num``, default the dataset's;
  sync mode always one: its step is a barrier of every trainer, and a deterministic step order
  is its point);
- :func:`replicate`: a per-thread copy of the model whose parameters alias the original's
  storage (hogwild: every thread reads and the communicator writes the same values) but keep
  their own ``.grad``, so one thread's step pushes exactly its own batch's dense gradient. The
  copies have their own autograd version counters: a parameter refresh written by another
  thread's step never invalidates a backward in flight. Buffers are shared as they are;
- :class:`StepGate` (:data:`GATE`): the threads' step boundaries. An automatic checkpoint cuts
  through :func:`quiesce`, which waits until every other thread finished its step (its pushes
  queued) and holds new batches back until the cut is taken;
- :func:`run`: the worker threads themselves; an exception in one stops the others at their
  next batch and re-raises in the caller with the worker's traceback;
- per-thread pull-wait seconds (:func:`add_pull_wait`), for the loop's step-time breakdown.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

JOIN_AFTER_ERROR_S = 30.0
"""How long the caller waits for the other threads after one failed, before it raises anyway
(a thread blocked in a barrier of the job would otherwise hold the process)."""

_sync_said = False


def resolve(thread_num: int | None, dataset: Any, mode: str | None) -> int:
    """Training threads for a pass: ``thread_num`` (None: the dataset's ``thread_num``, else 1);
    one in sync mode (said once) and outside a PS trainer (``mode`` None)."""
    from collective.errors import ConfigError

    if thread_num is None:
        thread_num = getattr(dataset, "thread_num", 1)
        if not isinstance(thread_num, int) or isinstance(thread_num, bool) or thread_num < 1:
            thread_num = 1
    elif not isinstance(thread_num, int) or isinstance(thread_num, bool) or thread_num < 1:
        raise ConfigError(
            f"must be None (the dataset's thread_num) or an integer >= 1, got {thread_num!r}",
            key="thread_num",
        )
    if thread_num == 1 or mode is None:
        return 1
    if mode == "sync":
        global _sync_said
        if not _sync_said:
            _sync_said = True
            logger.warning(
                "sync mode trains with one thread (thread_num=%d ignored): every step is a "
                "barrier of all trainers and its order is deterministic",
                thread_num,
            )
        return 1
    return thread_num


def check_shareable(n: int, optimizer: Any, comm: Any, lookup_source: bool = False) -> int:
    """``n``, or 1 (with a warning) where the threads cannot share this trainer: an optimizer
    stepping parameters that are not the communicator's dense ones (a thread's step would miss
    its own gradients), or a lookup source in force (``lookup_source``: ``lookups_from`` or an
    open pass of the pass cache)."""
    if lookup_source:
        logger.warning("training on one thread: a lookup source (the pass cache) is in use")
        return 1
    dense = {id(p) for p in comm.dense}
    params = [p for group in getattr(optimizer, "param_groups", []) for p in group["params"]]
    if any(id(p) not in dense for p in params):
        logger.warning(
            "training on one thread (thread_num=%d asked): the optimizer is not the one "
            "fleet.distributed_optimizer wrapped, so its step would not see each thread's own "
            "gradients; wrap it with fleet.distributed_optimizer to train on threads",
            n,
        )
        return 1
    return n


# -- replicas ------------------------------------------------------------------------------------
def replicate(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[int, torch.nn.Parameter]]:
    """A copy of ``model`` for one training thread, and ``id(original parameter)`` -> its alias.

    Every submodule is a shallow copy (its attributes shared, its ``_parameters`` /
    ``_modules`` / ``_buffers`` dicts its own); each parameter is a new ``Parameter`` over the
    original's storage (``.data``: the same memory, a version counter and ``.grad`` of its
    own)."""
    aliases: dict[int, torch.nn.Parameter] = {}
    done: dict[int, torch.nn.Module] = {}

    def clone(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in done:
            return done[id(module)]
        twin = copy.copy(module)
        done[id(module)] = twin
        params: dict[str, Any] = {}
        for name, p in module._parameters.items():
            if p is not None and id(p) not in aliases:
                aliases[id(p)] = torch.nn.Parameter(p.data, requires_grad=p.requires_grad)
            params[name] = None if p is None else aliases[id(p)]
        twin._parameters = params
        twin._buffers = dict(module._buffers)
        twin._modules = {k: None if m is None else clone(m) for k, m in module._modules.items()}
        object.__setattr__(twin, "replica_of", module)
        return twin

    return clone(model), aliases


def original(module: Any) -> Any:
    """The module a :func:`replicate` copy was made from (``module`` itself otherwise)."""
    return module.__dict__.get("replica_of", module) if hasattr(module, "__dict__") else module


# -- per-thread state ----------------------------------------------------------------------------
class _Local(threading.local):
    def __init__(self) -> None:
        self.pull_wait = 0.0
        self.in_step = False
        self.dense: list[torch.Tensor] | None = None


_local = _Local()


def add_pull_wait(seconds: float) -> None:
    """This thread waited ``seconds`` in a PS pull."""
    _local.pull_wait += seconds


def pull_wait_seconds() -> float:
    """Seconds this thread waited in PS pulls so far."""
    return _local.pull_wait


def set_dense(params: list[torch.Tensor] | None) -> None:
    """The dense parameters whose ``.grad`` this thread's steps push (None: the originals)."""
    _local.dense = params


def thread_dense() -> list[torch.Tensor] | None:
    """The dense parameters of this thread's steps (:func:`set_dense`), or None."""
    return _local.dense


# -- step boundaries -----------------------------------------------------------------------------
class StepGate:
    """Counts the threads inside a step (from taking a batch to the end of its step); a cut
    (:meth:`quiesce`) waits until none is, and holds new steps back while it runs."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._closed = 0
        self.running = 0
        """Threaded passes running (the gate only waits while one is)."""

    def enter(self) -> None:
        """This thread starts a step (waits while a cut runs)."""
        with self._cv:
            while self._closed:
                self._cv.wait()
            self._active += 1
        _local.in_step = True

    def leave(self) -> None:
        """This thread's step ended (or it took no batch)."""
        if not _local.in_step:
            return
        _local.in_step = False
        with self._cv:
            self._active -= 1
            self._cv.notify_all()

    @contextlib.contextmanager
    def quiesce(self, timeout: float | None = None) -> Iterator[None]:
        """Run the body while no other training thread is inside a step (the caller, at its
        step boundary, counts as outside)."""
        if not self.running:
            yield
            return
        inside = _local.in_step
        with self._cv:
            self._closed += 1
            if inside:
                self._active -= 1
            if not self._cv.wait_for(lambda: self._active == 0, timeout=timeout):
                logger.warning("a checkpoint cut waited %.0f s for the training threads", timeout)
        try:
            yield
        finally:
            with self._cv:
                self._closed -= 1
                if inside:
                    self._active += 1
                self._cv.notify_all()


GATE = StepGate()
"""The process's step gate (one trainer process trains one pass at a time)."""
CHECKPOINT_LOCK = threading.Lock()
"""Serialises the automatic checkpoint's step-boundary bookkeeping across training threads."""


def quiesce() -> contextlib.AbstractContextManager[None]:
    """:meth:`StepGate.quiesce` of :data:`GATE`: for a checkpoint cut at a step boundary."""
    return GATE.quiesce(timeout=600.0)


# -- the worker threads --------------------------------------------------------------------------
class Workers:
    """``n`` threads running ``work(index, stop)``; the first exception stops the rest."""

    def __init__(self, n: int, work: Callable[[int, threading.Event], None]) -> None:
        self.stop = threading.Event()
        self.errors: list[tuple[int, BaseException]] = []
        self._lock = threading.Lock()
        self._work = work
        self._threads = []
        for i in range(n):
            ctx = contextvars.copy_context()  # the caller's context vars (lookup sources ...)
            t = threading.Thread(
                target=ctx.run, args=(self._run, i), name=f"fleet-train-{i}", daemon=True
            )
            self._threads.append(t)

    def _run(self, index: int) -> None:
        try:
            self._work(index, self.stop)
        except BaseException as err:  # re-raised in the caller by join()
            with self._lock:
                self.errors.append((index, err))
            self.stop.set()
        finally:
            GATE.leave()

    def run(self) -> None:
        """Start the threads, wait for all; re-raise the first failure (its own traceback)."""
        GATE.running += 1
        try:
            for t in self._threads:
                t.start()
            deadline = None
            while any(t.is_alive() for t in self._threads):
                for t in self._threads:
                    t.join(timeout=0.2)
                if self.stop.is_set() and deadline is None:
                    deadline = time.monotonic() + JOIN_AFTER_ERROR_S
                if deadline is not None and time.monotonic() > deadline:
                    stuck = [t.name for t in self._threads if t.is_alive()]
                    logger.error("training threads %s did not stop after a failure", stuck)
                    break
        except BaseException:
            self.stop.set()
            raise
        finally:
            GATE.running -= 1
        if self.errors:
            index, err = self.errors[0]
            if len(self.errors) > 1:
                logger.error(
                    "training threads failed: %s",
                    "; ".join(f"thread {i}: {type(e).__name__}: {e}" for i, e in self.errors),
                )
            err.add_note(f"(raised in training thread {index} of {len(self._threads)})")
            raise err


__all__ = [
    "CHECKPOINT_LOCK",
    "GATE",
    "StepGate",
    "Workers",
    "add_pull_wait",
    "check_shareable",
    "original",
    "pull_wait_seconds",
    "quiesce",
    "replicate",
    "resolve",
    "set_dense",
    "thread_dense",
]
