"""How a parameter-server trainer exchanges gradients and parameters: the four modes.

Chosen from the strategy (Paddle's semantics; :func:`make_communicator`):

==============  =========================================  ============================================
mode            strategy                                   what happens at ``optimizer.step()``
==============  =========================================  ============================================
sync            ``a_sync=False``                           every trainer pushes its step gradients with
                                                           ``mode=sync``: each server applies the MEAN
                                                           of the W trainers' pushes once; a barrier;
                                                           dense values pulled. W trainers with batch b
                                                           equal one trainer with batch W*b (SGD).
async           ``a_sync=True``, ``k_steps <= 0``          gradients are queued (bounded:
                                                           ``send_queue_size``) and a background thread
                                                           merges up to ``max_merge_var_num`` steps and
                                                           applies them; dense values refresh from the
                                                           latest background pull.
half-async      async + ``a_sync_configs.barrier_interval  as async, and every N steps the queue is
                = N > 0``                                  drained and the trainers meet in a barrier
                                                           (after each global step that is a multiple
                                                           of N, counted from the trainer's data
                                                           position: a resumed trainer meets the
                                                           others at the same barriers): staleness is
                                                           bounded by N steps.
GEO             ``a_sync=True``, ``k_steps = K > 0``       training is local (touched sparse rows and
                                                           dense parameters are local copies, updated
                                                           with SGD at the table's lr / the user's
                                                           optimizer); every K steps the deltas since
                                                           the last exchange are pushed (servers sum
                                                           them) and fresh values are pulled.
==============  =========================================  ============================================

Sparse gradients reach the communicator from :class:`fleet.ps.embedding.DistributedEmbedding`'s
backward (already merged per unique key); dense gradients from the parameters of the optimizer
wrapped by ``fleet.distributed_optimizer``.

Several training threads (:mod:`fleet.ps.threads`) may share one communicator: the gradients a
thread records are kept per thread until its own ``step()``, a thread's dense gradient is read
from its model copy's parameters (:func:`fleet.ps.threads.set_dense`), the prefetch list and
the step counter are locked, and GEO's local copies are changed under one lock.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import fleet.telemetry as telemetry
from collective.errors import FleetError
from fleet.base import coordination
from fleet.base.data_position import tracker
from fleet.ps import threads

logger = logging.getLogger(__name__)

DENSE_TABLE = "__dense__"
"""Name of the dense table that holds a PS job's dense parameters."""


DENSE_BLOCK = "dense"
"""All dense parameters of a trainer travel as ONE flat float32 block: one push and one pull per
step, however many parameter tensors the model has."""
PREFETCH_DEPTH = 2
"""Prefetches kept pending per table (this step's and the next one's)."""
PREFETCH_WAIT_S = 30.0
"""Longest an async prefetch waits for the sender to apply the steps queued before it."""


@dataclass
class SparseGrads:
    """Gradients recorded for one table during a step (list of (keys, grads) pieces)."""

    keys: list[np.ndarray] = field(default_factory=list)
    grads: list[np.ndarray] = field(default_factory=list)

    def merged(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        if not self.keys:
            return np.zeros(0, np.int64), np.zeros((0, dim), np.float32)
        return np.concatenate(self.keys), np.concatenate(self.grads)


class Communicator:
    """Base: sync pulls and the bookkeeping every mode shares."""

    mode = "base"

    def __init__(self, client: Any, num_trainers: int, barrier: Callable[[], None]) -> None:
        self.client = client
        self.num_trainers = num_trainers
        self.barrier = barrier
        self.tables: dict[str, int] = {}  # sparse table -> dim
        self.table_lr: dict[str, float] = {}
        self.dense: list[torch.nn.Parameter] = []
        self.dense_base: np.ndarray | None = None  # GEO: the dense values at the last exchange
        self._pending = threading.local()
        self.steps = 0
        self.prefetch_depth = PREFETCH_DEPTH
        """Prefetches kept pending per table (raised to threads + 1 while several threads
        train: each thread's next batch may be prefetched before another thread's forward)."""
        self._prefetch_lock = threading.Lock()
        self.stale_steps = 0
        """Async prefetches: steps queued before the prefetch that its pull need not wait for
        (threads - 1 while several threads train: the other threads' steps in flight, as a
        hogwild pull at the forward would miss them too)."""
        self._pool: ThreadPoolExecutor | None = None
        self._prefetched: dict[str, list[tuple[np.ndarray, Future[np.ndarray]]]] = {}
        self._last_prefetch: dict[str, tuple[int, np.ndarray]] = {}  # table -> (steps, keys)
        telemetry.instrument_communicator(
            self
        )  # ps_pull/ps_push time, step ends (fleet/telemetry.py)

    # -- registration ---------------------------------------------------------------------------
    def add_table(self, name: str, dim: int, lr: float) -> None:
        self.tables[name] = dim
        self.table_lr[name] = lr

    def add_dense(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.dense = list(params)

    # -- the trainer's calls --------------------------------------------------------------------
    prefetches = False
    """Whether :meth:`prefetch` starts pulls early (async modes) or is ignored (sync: a pull
    must see the previous step's update; GEO: pulls are local)."""
    auto_prefetch = False
    """Whether looking-ahead batch iterators prefetch the next batch's rows by themselves
    (:mod:`fleet.ps.auto_prefetch`; async modes with ``a_sync_configs.prefetch``)."""

    @property
    def pending(self) -> dict[str, SparseGrads]:
        """The sparse gradients this thread recorded since its last step (table -> pieces)."""
        try:
            return self._pending.grads
        except AttributeError:
            self._pending.grads = {}
            return self._pending.grads

    @pending.setter
    def pending(self, value: dict[str, SparseGrads]) -> None:
        self._pending.grads = value

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Rows for unique ``keys`` (float32 [n, dim]); a prefetch of exactly these keys is
        used when one was started."""
        future = None
        if self.prefetches:
            with self._prefetch_lock:
                pending = self._prefetched.get(table, [])
                for i, (early_keys, early) in enumerate(pending):
                    if np.array_equal(early_keys, keys):
                        future = early
                        if self.prefetch_depth > PREFETCH_DEPTH:  # threads: others' are ahead
                            del pending[i]
                        else:  # this one, and any older one nobody asked for
                            del pending[: i + 1]
                        break
        if future is not None:
            return future.result()
        return self.client.pull_sparse(table, keys)

    def prefetch(self, table: str, keys: np.ndarray) -> None:
        """Start pulling the rows of unique ``keys`` in the background for a coming forward of
        ``table``. Up to :data:`PREFETCH_DEPTH` prefetches per table stay pending (so a loop
        may prefetch batch s + 1 before the forward of batch s, which uses the prefetch made
        one step earlier); older ones are dropped. The rows may miss updates still queued when
        the pull runs: async semantics (the async communicator bounds this: see
        :meth:`AsyncCommunicator._prefetch_pull`)."""
        if not self.prefetches:
            return
        with self._prefetch_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fleet-prefetch")
            pending = self._prefetched.setdefault(table, [])
            last = self._last_prefetch.get(table)
            steps = self.steps
            if last is not None and last[0] == steps and np.array_equal(last[1], keys):
                return  # made twice in one step (an automatic and a hand-written prefetch)
            self._last_prefetch[table] = (steps, keys)
            pending.append((keys, self._pool.submit(self._prefetch_pull, table, keys, steps)))
            del pending[: -self.prefetch_depth]

    def _prefetch_pull(self, table: str, keys: np.ndarray, steps: int) -> np.ndarray:
        """The background pull of a prefetch made after ``steps`` steps."""
        return self.client.pull_sparse(table, keys)

    def record_sparse(self, table: str, keys: np.ndarray, grads: np.ndarray) -> None:
        """Gradients of this step for ``keys`` (called from backward)."""
        g = self.pending.setdefault(table, SparseGrads())
        g.keys.append(keys)
        g.grads.append(grads)

    def step(self) -> None:
        """End of a training step (``optimizer.step()``)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make every recorded update visible on the servers (before save/stop)."""

    def close(self) -> None:
        """Stop background work."""
        self.flush()
        self._stop_prefetch()

    def forget_server_values(self) -> None:
        """Forget every value pulled earlier (prefetches, a background dense pull): the servers'
        tables were replaced (a checkpoint was loaded)."""
        with self._prefetch_lock:
            self._prefetched, self._last_prefetch = {}, {}

    def _stop_prefetch(self) -> None:
        with self._prefetch_lock:
            self._prefetched, self._last_prefetch = {}, {}
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- helpers --------------------------------------------------------------------------------
    def _take_pending(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        out = {t: self.pending.get(t, SparseGrads()).merged(dim) for t, dim in self.tables.items()}
        self.pending = {}
        return out

    def dense_values(self) -> np.ndarray:
        """The trainer's dense parameters as one flat float32 vector."""
        if not self.dense:
            return np.zeros(0, np.float32)
        return (
            torch.cat([p.detach().reshape(-1) for p in self.dense]).to(torch.float32).cpu().numpy()
        )

    def _dense_grad(self) -> np.ndarray:
        """This thread's dense gradient, flat (its model copy's parameters when it has one)."""
        params = threads.thread_dense() or self.dense
        parts = [
            p.grad.detach().reshape(-1).to(torch.float32)
            if p.grad is not None
            else torch.zeros(p.numel(), device=p.device)
            for p in params
        ]
        return torch.cat(parts).cpu().numpy().copy() if parts else np.zeros(0, np.float32)

    def _set_dense(self, flat: np.ndarray) -> None:
        arr = np.asarray(flat, np.float32)
        if not arr.flags.writeable:  # a reply's buffer: torch wants memory it may write
            arr = arr.copy()
        values = torch.from_numpy(arr)
        offset = 0
        with torch.no_grad():
            for p in self.dense:
                n = p.numel()
                p.copy_(values[offset : offset + n].view_as(p))
                offset += n

    def pull_dense(self) -> np.ndarray:
        return self.client.pull_dense(DENSE_TABLE, DENSE_BLOCK)


class SyncCommunicator(Communicator):
    """Step t: all W trainers push; each server applies the mean once; barrier; pull dense."""

    mode = "sync"

    def step(self) -> None:
        for table, (keys, grads) in self._take_pending().items():
            self.client.push_sparse(table, keys, grads, mode="sync", sync_count=self.num_trainers)
        if self.dense:
            self.client.push_dense(
                DENSE_TABLE,
                DENSE_BLOCK,
                self._dense_grad(),
                mode="sync",
                sync_count=self.num_trainers,
            )
        self.barrier()  # every trainer's push returned: the W-th push of each table applied
        if self.dense:
            self._set_dense(self.pull_dense())
        self.steps += 1


class AsyncCommunicator(Communicator):
    """A background sender merges queued steps and applies them; ``barrier_interval > 0`` makes
    it half-async (drain + barrier every N steps)."""

    mode = "async"
    prefetches = True

    def __init__(
        self,
        client: Any,
        num_trainers: int,
        barrier: Callable[[], None],
        *,
        queue_size: int,
        max_merge: int,
        barrier_interval: int,
        auto_prefetch: bool = True,
    ) -> None:
        super().__init__(client, num_trainers, barrier)
        self.auto_prefetch = auto_prefetch
        self.max_merge = max_merge
        self.barrier_interval = barrier_interval
        if barrier_interval > 0:
            self.mode = "half-async"
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._latest_dense: np.ndarray | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._sent = 0  # steps the sender has applied (or failed on)
        self._sparse_sent = 0  # steps whose sparse pushes are applied (or failed)
        self._sent_cv = threading.Condition()
        self._step_lock = threading.Lock()
        """Training threads queue their steps and count them one at a time (half-async: a
        barrier holds the other threads' steps until it is passed)."""
        self.steps_before: int | None = None
        """Half-async: global steps trained before this process (the data position it resumed
        at, :mod:`fleet.base.data_position`), read at its first step."""
        self._thread = threading.Thread(target=self._run, name="fleet-async-sender", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            batch = [item]
            while len(batch) < self.max_merge:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:  # keep the stop marker for the next loop
                    self._queue.task_done()
                    self._queue.put(None)
                    break
                batch.append(nxt)
            try:
                self._send(batch)
            except BaseException as err:
                self._error = err
                logger.exception("async sender failed")
            finally:
                with self._sent_cv:
                    self._sent += len(batch)
                    self._sparse_sent = max(self._sparse_sent, self._sent)
                    self._sent_cv.notify_all()
                for _ in batch:
                    self._queue.task_done()

    def _send(
        self, batch: list[tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray]]
    ) -> None:
        # merged by summation: the same total update as separate sends under SGD
        sparse = []
        for table in self.tables:
            keys = np.concatenate([b[0][table][0] for b in batch])
            if len(keys):
                sparse.append((table, keys, np.concatenate([b[0][table][1] for b in batch])))
        push_step = getattr(self.client, "push_step", None)
        if push_step is not None:  # sparse and dense in one call (PSClient.push_step)
            grad = None
            if self.dense:
                grad = batch[0][1] if len(batch) == 1 else np.sum([b[1] for b in batch], axis=0)
            _, latest = push_step(sparse, (DENSE_TABLE, DENSE_BLOCK, grad) if self.dense else None)
            with self._sent_cv:
                self._sparse_sent += len(batch)
                self._sent_cv.notify_all()
            if latest is not None:
                with self._lock:
                    self._latest_dense = latest
            return
        for table, keys, grads in sparse:
            self.client.push_sparse(table, keys, grads, mode="apply")
        with self._sent_cv:  # a prefetch's pull reads sparse rows only: it need not wait more
            self._sparse_sent += len(batch)
            self._sent_cv.notify_all()
        if self.dense:  # the push's reply carries the values after it: no separate pull
            grad = batch[0][1] if len(batch) == 1 else np.sum([b[1] for b in batch], axis=0)
            latest = self.client.push_pull_dense(DENSE_TABLE, DENSE_BLOCK, grad, mode="apply")
            with self._lock:
                self._latest_dense = latest

    def _check(self) -> None:
        if self._error is not None:
            raise FleetError(
                f"the async communicator failed to send: {self._error}"
            ) from self._error

    def _prefetch_pull(self, table: str, keys: np.ndarray, steps: int) -> np.ndarray:
        """Pull once the sender has applied the sparse pushes of the ``steps`` steps queued
        before the prefetch, so a prefetched row misses at most this trainer's current step
        (without the wait it could miss every step still queued: up to ``send_queue_size``,
        growing as the trainer gets faster than its sender), less :attr:`stale_steps`. The
        pull does not wait for those steps' dense push, which follows their sparse pushes and
        changes no row: the two round trips overlap. Bounded: after :data:`PREFETCH_WAIT_S` it
        pulls anyway."""
        applied = steps - self.stale_steps
        with self._sent_cv:
            self._sent_cv.wait_for(lambda: self._sparse_sent >= applied, timeout=PREFETCH_WAIT_S)
        return self.client.pull_sparse(table, keys)

    def step(self) -> None:
        self._check()
        item = (self._take_pending(), self._dense_grad())
        with self._step_lock:
            if self.steps_before is None:  # the tracker counts this step after it
                self.steps_before = tracker().step
            self._queue.put(item)  # blocks when full
            self.steps += 1
            done = self.steps_before + self.steps  # global steps, this one included
            if self.barrier_interval > 0 and done % self.barrier_interval == 0:
                self.flush()
                client = coordination.active()
                if client is not None:  # by global step: a restarted trainer meets the same ones
                    client.interval_barrier(done // self.barrier_interval - 1)
                else:
                    self.barrier()
                if self.dense:
                    self._set_dense(self.pull_dense())
                return
        with self._lock:
            latest, self._latest_dense = self._latest_dense, None
        if latest is not None:
            self._set_dense(latest)

    def flush(self) -> None:
        self._queue.join()
        self._check()

    def forget_server_values(self) -> None:
        super().forget_server_values()
        with self._lock:
            self._latest_dense = None

    def close(self) -> None:
        if self._thread.is_alive():
            self.flush()
            self._queue.put(None)
            self._thread.join(timeout=60)
        self._stop_prefetch()


class GeoCommunicator(Communicator):
    """Local training on copies; every ``k_steps`` push deltas (summed by the servers), re-pull."""

    mode = "geo"

    def __init__(
        self,
        client: Any,
        num_trainers: int,
        barrier: Callable[[], None],
        *,
        k_steps: int,
        dense_step: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(client, num_trainers, barrier)
        self.k_steps = k_steps
        self.dense_step = dense_step
        # table -> (key -> row index), current rows, rows at the last exchange
        self._index: dict[str, dict[int, int]] = {}
        self._rows: dict[str, np.ndarray] = {}
        self._base: dict[str, np.ndarray] = {}
        self._geo_lock = threading.RLock()
        """The local copies are read and changed by one training thread at a time."""

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        with self._geo_lock:
            return self._pull_local(table, keys)

    def _pull_local(self, table: str, keys: np.ndarray) -> np.ndarray:
        index = self._index.setdefault(table, {})
        dim = self.tables[table]
        missing = np.array([k for k in keys.tolist() if k not in index], dtype=np.int64)
        if len(missing):
            fresh = self.client.pull_sparse(table, missing)
            start = len(index)
            for i, k in enumerate(missing.tolist()):
                index[k] = start + i
            rows = self._rows.get(table, np.zeros((0, dim), np.float32))
            self._rows[table] = np.concatenate([rows, fresh])
            self._base[table] = np.concatenate(
                [self._base.get(table, np.zeros((0, dim), np.float32)), fresh]
            )
        idx = np.fromiter((index[k] for k in keys.tolist()), dtype=np.int64, count=len(keys))
        return self._rows[table][idx]

    def step(self) -> None:
        pending = self._take_pending()
        with self._geo_lock:
            self._step_locked(pending)

    def _step_locked(self, pending: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        for table, (keys, grads) in pending.items():
            if len(keys):
                index = self._index.get(table, {})
                idx = np.fromiter(
                    (index.get(k, -1) for k in keys.tolist()), dtype=np.int64, count=len(keys)
                )
                if len(idx) and idx.min() < 0:
                    # another training thread's exchange sent the rows this thread pulled:
                    # its gradient goes to fresh copies (hogwild: computed on older values)
                    self._pull_local(table, keys)
                    index = self._index[table]
                    idx = np.fromiter(
                        (index[k] for k in keys.tolist()), dtype=np.int64, count=len(keys)
                    )
                np.subtract.at(self._rows[table], idx, self.table_lr[table] * grads)
        if self.dense_step is not None:
            mine = threads.thread_dense()
            if mine is None:
                self.dense_step()  # the user's optimizer, locally
            else:  # a training thread: its model copy's gradients, the shared values
                for p, q in zip(self.dense, mine):
                    p.grad = q.grad
                try:
                    self.dense_step()
                finally:
                    for p in self.dense:
                        p.grad = None
        self.steps += 1
        if self.steps % self.k_steps == 0:
            self.flush()

    def flush(self) -> None:
        with self._geo_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        for table, index in self._index.items():
            if index:
                keys = np.fromiter(index.keys(), dtype=np.int64, count=len(index))
                order = np.fromiter(index.values(), dtype=np.int64, count=len(index))
                delta = self._rows[table][order] - self._base[table][order]
                self.client.push_sparse(table, keys, delta, mode="delta")
        self._index, self._rows, self._base = {}, {}, {}
        if self.dense:  # no barrier: GEO is asynchronous; stop_worker meets the others at the end
            if self.dense_base is not None:
                fresh = self.client.push_pull_dense(
                    DENSE_TABLE, DENSE_BLOCK, self.dense_values() - self.dense_base, mode="delta"
                )
            else:
                fresh = self.pull_dense()
            self._set_dense(fresh)
            self.dense_base = np.asarray(fresh, np.float32).copy()

    def set_dense_base(self) -> None:
        self.dense_base = self.dense_values().copy()
