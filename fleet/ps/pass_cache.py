"""The pass cache: a pass's sparse rows in trainer-local device memory (Paddle's PS-GPU pass).

Paddle's GPU parameter server builds the keys of a pass into device memory before the pass
(``PSGPUWrapper::BuildGPUTask`` / ``BeginPass``), trains against that table, and writes it back
at the end (``EndPass``). Here::

    dataset.load_into_memory()
    fleet.begin_pass(dataset)      # unique keys per table -> one pull per table -> local table
    fleet.train_from_dataset(model, opt, dataset, loss_fn, label="click")
    fleet.end_pass()               # one delta push per table; the servers merge (GEO's merge)

``fleet.train_from_dataset`` (so ``fleet.train_days``) calls both for the user when a
:class:`~fleet.ps.embedding.DistributedEmbedding` has ``cache="pass"`` or the strategy sets
``a_sync_configs.use_ps_gpu``.

:func:`begin_pass` collects the unique keys of the dataset's sparse slots per table (all
sparse slots, or the embedding's ``cache_slots``; vectorised over the loaded columns), checks
that the pass fits the device (:func:`memory_budget`: free CUDA memory, or a fraction of the
available RAM; a :class:`~collective.errors.ConfigError` saying how many keys the pass has and
how many fit, before anything is pulled), pulls each table's rows in one logical request
(``PSClient.pull_sparse`` splits it into messages; with the rule's state, Adagrad's accumulators
or Adam's moments and step, by ``pull_sparse_with_state``) and keeps them in a
:class:`PassTable` on the trainer's device (CUDA when available; :mod:`fleet.ps.pass_store`).
During the pass a lookup reads the local table; its backward's gradient is applied by the
table's own optimizer rule at the next step boundary, as a SYNC server would apply one trainer's
push: on CPU with the built-in rules by the server's own compiled push on local copies of its
columns, otherwise by the :mod:`ps_server.core.optimizers` formulas (their torch form on CUDA).
Show (occurrences) and click (occurrences in examples whose label is positive) are counted per
row from the pass's data.

:func:`end_pass` pushes each table's value delta (``local - pulled``) and state delta once, with
``mode="delta"``: the servers add the deltas of every trainer (``SparseTable.add_delta``, the
GEO merge; the rule merges the state: a sum, so one trainer's rows and state after a pass are
those of training without the cache, and Adagrad's accumulators of several trainers hold every
trainer's squared gradients), reset ``unseen_days`` and add each row's show count of the pass
(its occurrences in the pass's examples, what the per-step pushes would have counted), so
``shrink``, show decay, the SSD tier's eviction by show count and serving exports' ``min_show``
keep working. Then the trainers meet in a barrier, so the next pass pulls every trainer's
updates.

Checkpoints are cut at pass ends: ``fleet.ps.checkpoint`` and ``fleet.save_persistables``
refuse inside a pass (:func:`refuse_in_pass`). An automatic checkpoint taken inside a pass
records the pass's start as the trainer's position (:func:`cut_position`; the servers hold
none of the pass's sparse updates yet), so a recovered job restarts the pass it was in.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from collective.errors import ConfigError, FleetError
from fleet.base.data_position import DataPosition
from fleet.ps.pass_keys import collect_keys
from fleet.ps.pass_store import make_rows

logger = logging.getLogger(__name__)

CPU_MEMORY_FRACTION = 0.5
"""Share of the available RAM a CPU pass may take (``begin_pass(max_memory_fraction=)``)."""
CUDA_MEMORY_FRACTION = 0.8
"""Share of the free CUDA memory a CUDA pass may take."""


@dataclass(frozen=True)
class TableStats:
    """One table's pass: what was pulled, trained and pushed."""

    keys: int
    """Unique keys of the pass (rows pulled and held)."""
    pushed: int
    """Rows pushed back (rows the pass updated)."""
    shows: int
    """Occurrences of the table's keys in the pass's examples."""
    clicks: int
    """Occurrences in examples with a positive label."""
    pulls: int
    """Pull calls to the servers (1)."""
    pushes: int
    """Push calls to the servers (1; 0 when nothing was updated)."""
    nbytes: int
    """Device memory the table held."""


@dataclass
class PassStats:
    """What :func:`end_pass` did, per table, and how long the pass's two exchanges took."""

    tables: dict[str, TableStats] = field(default_factory=dict)
    begin_seconds: float = 0.0
    """Key collection, memory check and pulls."""
    end_seconds: float = 0.0
    """Pushes and the barrier."""

    @property
    def rpcs(self) -> int:
        """Pull and push calls of the pass, all tables."""
        return sum(t.pulls + t.pushes for t in self.tables.values())


class PassTable:
    """One table's rows for a pass: sorted ``keys_np``, the rows in a store on ``device``
    (:mod:`fleet.ps.pass_store`: trained values, values as pulled, the rule's state), per-row
    ``show`` / ``click``; gradients wait for their step's end before the rule applies them."""

    def __init__(
        self,
        name: str,
        rule: Any,
        keys: np.ndarray,
        rows: np.ndarray,
        shows: np.ndarray,
        clicks: np.ndarray,
        device: torch.device,
        steps: Any,
        state: np.ndarray | None = None,
    ) -> None:
        self.name = name
        self.rule = rule
        self.device = device
        self.dim = int(rows.shape[1])
        self.keys_np = keys
        self.rows = make_rows(rule, keys, rows, device, state)
        self.show = shows
        self.click = clicks
        self._steps = steps  # () -> the communicator's step count
        self._pending: list[tuple[Any, Any]] = []
        self._pending_step = -1
        self._lock = threading.RLock()  # training threads share the table
        self._recent: list[tuple[np.ndarray, Any]] = []

    @property
    def nbytes(self) -> int:
        """Bytes held on the device."""
        return int(self.rows.nbytes)

    def pull(self, keys: np.ndarray) -> np.ndarray:
        """float32 ``[len(keys), dim]`` (CPU numpy) for unique ``keys``: the local rows."""
        self.apply_due()
        idx = self._index(keys)
        with self._lock:
            return self.rows.gather(idx)

    def pull_tensor(self, keys: np.ndarray) -> torch.Tensor:
        """The rows of unique ``keys`` as a tensor on the pass's device (a lookup of a module on
        that device: no copy to the host)."""
        self.apply_due()
        idx = self._index(keys)
        with self._lock:
            return self.rows.gather_tensor(idx)

    def record_tensor(self, keys: np.ndarray, grads: torch.Tensor) -> None:
        """:meth:`record` of a gradient tensor (on the pass's device: no copy to the host)."""
        idx = self._index(keys)
        grad = self.rows.grads(grads)
        with self._lock:
            self._pending.append((idx, grad))
            self._pending_step = self._steps()

    def record(self, keys: np.ndarray, grads: np.ndarray) -> None:
        """The gradient of a lookup of unique ``keys``: applied at the next step boundary."""
        idx = self._index(keys)
        grad = self.rows.grads(grads)
        with self._lock:
            self._pending.append((idx, grad))
            self._pending_step = self._steps()

    def _index(self, keys: np.ndarray) -> Any:
        """Rows of ``keys`` (a lookup's pull and its gradient's record ask for the same array:
        the last few answers are kept)."""
        for known, idx in self._recent:
            if known is keys:
                return idx
        idx, found = self.rows.find(keys)
        if not found.all():
            missing = np.asarray(keys)[~found]
            raise FleetError(
                f"table {self.name!r}: {missing.shape[0]} key(s) of this lookup are not in the "
                f"pass (e.g. {missing[:4].tolist()}): begin_pass built the pass from other "
                "slots; set cache_slots= on the DistributedEmbedding to the slots it reads, or "
                "call fleet.begin_pass with the dataset the pass trains on"
            )
        self._recent = [*self._recent[-3:], (keys, idx)]
        return idx

    def apply_due(self, force: bool = False) -> None:
        """Apply the recorded gradients once their step has ended (``force``: now)."""
        with self._lock:
            if not self._pending or (not force and self._steps() == self._pending_step):
                return
            pending, self._pending = self._pending, []
            self.rows.apply(pending)

    def delta(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, ``values - base``, ``state - base state``) of the rows the pass updated (CPU
        numpy)."""
        self.apply_due(force=True)
        with self._lock:
            return self.rows.delta()


class PassCache:
    """The tables of the open pass (:func:`begin_pass` makes it, :func:`end_pass` ends it).

    While open it stands in front of the trainer's communicator for its tables: the
    communicator's ``pull_sparse``, ``record_sparse`` and ``prefetch`` (what a
    DistributedEmbedding calls) read and train the local tables, and the communicator's step
    no longer pushes them (they leave its ``tables`` until :meth:`close`). Other tables and the
    dense parameters go through the communicator as before.
    """

    _ROUTED = ("pull_sparse", "record_sparse", "prefetch")

    def __init__(self, client: Any, communicator: Any, tables: dict[str, PassTable]) -> None:
        self.client = client
        self.communicator = communicator
        self.tables = tables
        self.stats = PassStats()
        self._dims: dict[str, int] = {}
        self._inner: dict[str, Any] = {}

    def open(self) -> None:
        """Route the communicator's calls for the pass's tables here."""
        comm = self.communicator
        for name in self.tables:
            dim = comm.tables.pop(name, None)
            if dim is not None:
                self._dims[name] = dim
        self._inner = {name: getattr(comm, name) for name in self._ROUTED}
        for name in self._ROUTED:
            setattr(comm, name, getattr(self, name))

    def close(self) -> None:
        """Give the tables back to the communicator."""
        comm = self.communicator
        for name in self._ROUTED:
            if comm.__dict__.get(name) is not None:
                delattr(comm, name)
        comm.tables.update(self._dims)

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        local = self.tables.get(table)
        return local.pull(keys) if local is not None else self._inner["pull_sparse"](table, keys)

    def record_sparse(self, table: str, keys: np.ndarray, grads: np.ndarray) -> None:
        local = self.tables.get(table)
        if local is not None:
            local.record(keys, grads)
        else:
            self._inner["record_sparse"](table, keys, grads)

    def prefetch(self, table: str, keys: np.ndarray) -> None:
        if table not in self.tables:  # the pass's rows are local: nothing to fetch
            self._inner["prefetch"](table, keys)


_ACTIVE: PassCache | None = None


def local_table(communicator: Any, table: str, device: torch.device) -> PassTable | None:
    """The open pass's ``table`` when ``communicator`` is its trainer's and the pass holds its
    rows on ``device`` (a CUDA pass): a lookup of a module on that device then reads and trains
    them there without a copy to the host. None otherwise (the communicator's path)."""
    cache = _ACTIVE
    if cache is None or device.type == "cpu" or cache.communicator is not communicator:
        return None
    local = cache.tables.get(table)
    return local if local is not None and local.device == device else None


def in_pass() -> bool:
    """Whether a pass is open (between :func:`begin_pass` and :func:`end_pass`)."""
    return _ACTIVE is not None


_automatic = threading.local()


def refuse_in_pass(what: str) -> None:
    """Raise a ConfigError naming ``what`` when a pass is open: checkpoints are cut at pass
    ends (the pass's updates reach the servers only at :func:`end_pass`). Inside
    :func:`automatic_cut` it lets the automatic checkpoint through."""
    if _ACTIVE is not None and not getattr(_automatic, "on", False):
        raise ConfigError(
            f"{what} inside a pass: the pass's sparse updates are on this trainer until "
            "fleet.end_pass() pushes them; checkpoint after end_pass (checkpoints are cut at "
            "pass ends, a recovered job restarts the pass)",
            key="pass_cache",
        )


@contextlib.contextmanager
def automatic_cut() -> Iterator[None]:
    """An automatic checkpoint (:mod:`fleet.ps.auto_checkpoint`) inside a pass: it goes ahead
    with the trainer's position rewound to the pass's start (:func:`cut_position`)."""
    _automatic.on = True
    try:
        yield
    finally:
        _automatic.on = False


def cut_position(position: DataPosition) -> DataPosition:
    """The data position an automatic checkpoint records: ``position`` itself between passes;
    inside a pass the pass's first step, since the servers hold none of the pass's sparse
    updates yet (they are on this trainer until :func:`end_pass`): a job recovered from the
    checkpoint restarts the pass."""
    if _ACTIVE is None:
        return position
    return DataPosition(position.pass_index, 0, position.step - position.step_in_pass)


# -- building a pass ------------------------------------------------------------------------------
def bytes_per_key(dim: int, rule: Any) -> int:
    """Device bytes one key of a pass takes: the key, its values and the rule's state twice
    (trained and as pulled), and 16 B of counters and index (the CPU store's count,
    unseen-days and flag columns and hash slots; the CUDA store's counter)."""
    return 8 + 4 * 2 * (dim + rule.state_dim(dim)) + 16


def memory_budget(device: torch.device, max_memory_fraction: float | None = None) -> int:
    """Bytes a pass may take on ``device``: the fraction of the free CUDA memory, or of the
    available RAM on CPU (:data:`CPU_MEMORY_FRACTION`)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        fraction = CUDA_MEMORY_FRACTION if max_memory_fraction is None else max_memory_fraction
        return int(free * fraction)
    import psutil

    fraction = CPU_MEMORY_FRACTION if max_memory_fraction is None else max_memory_fraction
    return int(psutil.virtual_memory().available * fraction)


def check_fits(tables: Mapping[str, tuple[int, int]], budget: int, device: torch.device) -> None:
    """``tables``: name -> (keys, bytes per key). Raise the ConfigError when the pass needs
    more than ``budget`` bytes."""
    need = sum(n * b for n, b in tables.values())
    if need <= budget:
        return
    keys = sum(n for n, _ in tables.values())
    mean = need / max(keys, 1)
    fit = int(budget // mean) if mean else 0
    detail = ", ".join(f"{t}: {n} keys x {b} B" for t, (n, b) in tables.items())
    raise ConfigError(
        f"the pass has {keys} unique keys ({detail}) = {need / 2**20:.1f} MiB, but {device} "
        f"has a budget of {budget / 2**20:.1f} MiB for it: about {fit} keys fit. Train on "
        "fewer files per pass (split the day into more passes), or raise "
        "begin_pass(max_memory_fraction=) / memory_budget_bytes=",
        key="pass_cache",
    )


def start(
    modules: Sequence[Any],
    dataset: Any,
    client: Any,
    communicator: Any,
    *,
    label: str | None = None,
    device: str | torch.device | None = None,
    max_memory_fraction: float | None = None,
    memory_budget_bytes: int | None = None,
    register: bool = True,
) -> PassCache:
    """Open a pass for ``modules`` (DistributedEmbeddings) over ``dataset`` with this client and
    communicator (what :func:`begin_pass` does with the trainer's own). ``register=False``
    leaves it out of the process's open pass (several in one process: tests of several
    trainers); :func:`finish` takes it then."""
    global _ACTIVE
    if register and _ACTIVE is not None:
        raise ConfigError(
            "a pass is already open: call fleet.end_pass() before the next begin_pass",
            key="pass_cache",
        )
    if not modules:
        raise ConfigError(
            "no DistributedEmbedding to cache: build the model's DistributedEmbeddings first",
            key="pass_cache",
        )
    t0 = time.perf_counter()
    dev = torch.device(device) if device is not None else _default_device()
    if dev.type == "cuda" and dev.index is None:  # the device tensors report
        dev = torch.device("cuda", torch.cuda.current_device())
    slots_of = {m.table: getattr(m, "cache_slots", None) for m in modules}
    collected = collect_keys(dataset, slots_of, label)
    sizes = {
        m.table: (int(collected[m.table][0].shape[0]), bytes_per_key(m.embedding_dim, m.optimizer))
        for m in modules
    }
    budget = (
        memory_budget(dev, max_memory_fraction)
        if memory_budget_bytes is None
        else int(memory_budget_bytes)
    )
    check_fits(sizes, budget, dev)
    communicator.flush()  # updates made before the pass reach the servers before its pulls
    steps = lambda: communicator.steps  # noqa: E731
    with ThreadPoolExecutor(max_workers=len(modules), thread_name_prefix="fleet-pass") as pool:
        # the tables' pulls run together (each one logical pull, split into messages by the
        # client); the servers create the rows they do not hold yet meanwhile
        pulled = {
            m.table: pool.submit(_pull, client, m, collected[m.table][0])
            for m in modules
            if collected[m.table][0].shape[0]
        }
    tables = {}
    for m in modules:
        keys, show, click = collected[m.table]
        future = pulled.get(m.table)
        rows, state = (
            future.result()
            if future is not None
            else (np.zeros((0, m.embedding_dim), np.float32), None)
        )
        tables[m.table] = PassTable(
            m.table,
            m.optimizer,
            keys,
            np.ascontiguousarray(rows, np.float32),
            show,
            click,
            dev,
            steps,
            state,
        )
    cache = PassCache(client, communicator, tables)
    cache.open()
    cache.stats.begin_seconds = time.perf_counter() - t0
    if register:
        _ACTIVE = cache
    logger.info(
        "pass begun on %s: %s",
        dev,
        ", ".join(f"{t} {p.keys_np.shape[0]} keys" for t, p in tables.items()),
    )
    return cache


def finish(cache: PassCache | None = None, barrier: bool = True) -> PassStats:
    """Close the open pass (or ``cache``): push each table's delta once (``mode="delta"``), give
    the tables back to the communicator, meet the other trainers (``barrier``). Its stats."""
    global _ACTIVE
    if cache is None:
        cache = _ACTIVE
    if cache is None:
        raise ConfigError("no pass is open: call fleet.begin_pass(dataset) first", key="pass_cache")
    t0 = time.perf_counter()
    try:
        # steps the async sender still holds were taken without these tables: send them
        # before the tables are given back
        cache.communicator.flush()
        tables = list(cache.tables.items())
        with ThreadPoolExecutor(
            max_workers=max(1, len(tables)), thread_name_prefix="fleet-pass"
        ) as pool:
            # the tables' deltas and pushes run together, as their pulls did
            pushed = {name: pool.submit(_push_delta, cache.client, name, t) for name, t in tables}
            for name, future in pushed.items():
                cache.stats.tables[name] = future.result()
    finally:
        if cache is _ACTIVE:
            _ACTIVE = None
        cache.close()
    comm = cache.communicator
    if barrier and getattr(comm, "num_trainers", 1) > 1:
        comm.barrier()  # the next pass pulls every trainer's deltas
    cache.stats.end_seconds = time.perf_counter() - t0
    return cache.stats


def _push_delta(client: Any, name: str, table: PassTable) -> TableStats:
    """One table's end of pass: its value and state deltas in one push (none if nothing
    changed); its stats."""
    keys, delta, state = table.delta()
    if keys.shape[0]:
        shows = table.show[np.searchsorted(table.keys_np, keys)]
        client.push_sparse(
            name,
            keys,
            delta,
            mode="delta",
            shows=shows,
            state_deltas=state if state.shape[1] else None,
        )
    return TableStats(
        keys=int(table.keys_np.shape[0]),
        pushed=int(keys.shape[0]),
        shows=int(table.show.sum()),
        clicks=int(table.click.sum()),
        pulls=1 if table.keys_np.shape[0] else 0,
        pushes=1 if keys.shape[0] else 0,
        nbytes=table.nbytes,
    )


def _pull(client: Any, module: Any, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """A pass's rows of ``module``'s table and their optimizer state (None when the rule keeps
    none), by a pull with state whatever the rule: the pull an SSD table reads through its tiers
    without creating rows (the pass's end push creates them)."""
    values, state = client.pull_sparse_with_state(module.table, keys)
    return values, state if state.shape[1] else None


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


__all__ = [
    "PassCache",
    "PassStats",
    "PassTable",
    "TableStats",
    "in_pass",
    "refuse_in_pass",
]
