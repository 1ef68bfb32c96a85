"""Parameter-server mode of fleet: roles, servers, the trainer's client and communicator.

A PS script is one program for both roles (as in Paddle); fleetrun starts it as servers
(TRAINING_ROLE=PSERVER) and as trainers::

    fleet.init(is_collective=False, strategy=strategy)
    model = CTRModel(embedding=lambda: fleet.DistributedEmbedding("emb", 8, optimizer=Adagrad(0.05)))
    if fleet.is_server():
        fleet.init_server()          # optionally init_server(dirname) to start from a checkpoint
        fleet.run_server()           # blocks until the trainers stop it
    else:
        fleet.init_worker()          # connect, create the tables
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.dense_parameters(), lr=1e-3))
        ... loss.backward(); opt.step(); opt.zero_grad() ...
        fleet.save_persistables("ckpt", mode=0)   # rank 0 asks the servers to save
        fleet.stop_worker()

Trainers also form a gloo process group among themselves (``barrier_worker``, ``fleet.metrics``),
except async, half-async and GEO trainers of a fleetrun job with automatic checkpoints, which
meet through fleetrun's coordinator (:mod:`fleet.base.coordination`: one can be restarted alone).

Security comes from the environment fleetrun sets, read by PSServer / PSClient themselves: the
job's token (FLEET_PS_TOKEN: servers refuse calls without it, trainers send it), the servers'
checkpoint roots (FLEET_PS_CHECKPOINT_ROOT: where ``save_persistables`` may write; a relative
dirname lands in fleetrun's working directory), optional TLS (FLEET_PS_TLS_*) and the directory
of SSD tables' cold rows (FLEET_PS_SSD_ROOT, from ``--ps_ssd_dir``; read by ``init_server``).
The dirname of ``init_server(dirname)`` is the server's own choice and is not confined.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from collective.clean_exit import register_shutdown, unregister_shutdown
from collective.env import TrainingRole, WorkerEnv
from collective.errors import ConfigError, FleetError
from fleet.base import coordination
from fleet.ps import pass_cache
from fleet.ps.communicator import (
    DENSE_TABLE,
    AsyncCommunicator,
    Communicator,
    GeoCommunicator,
    SyncCommunicator,
)
from fleet.strategy import DistributedStrategy

logger = logging.getLogger(__name__)


@dataclass
class PSState:
    """What PS mode keeps for this process."""

    env: WorkerEnv
    strategy: DistributedStrategy
    server: Any = None
    client: Any = None
    communicator: Communicator | None = None
    tables: weakref.WeakValueDictionary[str, Any] = field(
        default_factory=weakref.WeakValueDictionary
    )
    created: set[str] = field(default_factory=set)
    pending_checkpoint: Any = None
    """Trainer 0: the last ``fleet.ps.checkpoint`` still being written and committed."""
    auto_checkpoint: Any = None
    """The automatic checkpointer (:mod:`fleet.ps.auto_checkpoint`) when the job has one."""


_state: PSState | None = None
_early_tables: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
"""DistributedEmbedding modules built before ``fleet.init`` (adopted by it): a model may be
built first, or outside PS mode altogether to be served (``fleet.ps.ServingModel``)."""
_lookups: contextvars.ContextVar[Any] = contextvars.ContextVar("fleet_ps_lookups", default=None)
"""Where DistributedEmbedding lookups go instead of the trainer's communicator (serving)."""


def start_ps(env: WorkerEnv, strategy: DistributedStrategy) -> None:
    """Called by ``fleet.init(is_collective=False)`` after the trainers' group is up."""
    global _state
    _state = PSState(env=env, strategy=strategy)
    for name, module in list(_early_tables.items()):
        _state.tables[name] = module
    _early_tables.clear()
    if env.training_role is TrainingRole.HETER_TRAINER:
        _watch_heter_start(strategy.heter_configs.start_timeout_s)


_heter_started = threading.Event()
"""Set by ``fleet.run_heter_worker``: this heter worker process serves."""


def _watch_heter_start(timeout_s: float) -> None:
    """A heter worker whose script never calls ``fleet.run_heter_worker`` would leave the CPU
    trainers waiting: after ``timeout_s``, or at exit without it, fail with the fix."""

    def fail(when: str) -> None:
        if _heter_started.is_set() or getattr(sys, "last_value", None) is not None:
            return  # serving, or the script already failed with its own error
        logger.error(
            "this process is a heter worker (TRAINING_ROLE=HETER_TRAINER) but the script %s "
            "without calling fleet.run_heter_worker(model, optimizer): add a branch "
            "`if fleet.is_heter_worker(): fleet.run_heter_worker(model, optimizer)` with a "
            "fleet.heter.HeterModel (the script may be taking the is_worker() path only)",
            when,
        )
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(
        timeout_s, fail, (f"ran {timeout_s:g}s (heter_configs.start_timeout_s)",)
    )
    timer.daemon = True
    timer.start()
    atexit.register(fail, "ended")


def heter_started() -> None:
    """``fleet.run_heter_worker`` began: the start watchdog stands down."""
    _heter_started.set()


def _require(api: str, role: TrainingRole | None = None) -> PSState:
    if _state is None:
        raise FleetError(
            f"fleet.{api} needs fleet.init(is_collective=False) first (parameter-server mode)"
        )
    if role is not None and _state.env.training_role is not role:
        if _state.env.training_role is TrainingRole.HETER_TRAINER:
            raise FleetError(
                f"fleet.{api} is for the {role.value} role; this process is a heter worker "
                "(HETER_TRAINER) of a heterogeneous job: the script must check "
                "fleet.is_heter_worker() and call fleet.run_heter_worker(model, optimizer) "
                "with a fleet.heter.HeterModel"
            )
        raise FleetError(
            f"fleet.{api} is for the {role.value} role; this process is a "
            f"{_state.env.training_role.value} (check fleet.is_server() first)"
        )
    return _state


def in_ps_mode() -> bool:
    """True after ``fleet.init(is_collective=False)``."""
    return _state is not None


# -- roles ---------------------------------------------------------------------------------------
def is_server() -> bool:
    """True in a parameter-server process."""
    return _require("is_server()").env.training_role is TrainingRole.PSERVER


def is_worker() -> bool:
    """True in a trainer process."""
    return _require("is_worker()").env.training_role is TrainingRole.TRAINER


def is_heter_worker() -> bool:
    """True in a heter worker process (TRAINING_ROLE=HETER_TRAINER; :mod:`fleet.heter`)."""
    return _require("is_heter_worker()").env.training_role is TrainingRole.HETER_TRAINER


def heter_worker_num() -> int:
    """Number of heter workers (0 in a job without them)."""
    return len(_require("heter_worker_num()").env.heter_endpoints)


def server_num() -> int:
    """Number of parameter servers."""
    return len(_require("server_num()").env.pserver_endpoints)


def server_index() -> int:
    """This server's index (servers only)."""
    return _require("server_index()", TrainingRole.PSERVER).env.server_index


def server_endpoints(to_string: bool = False) -> list[str] | str:
    """``ip:port`` of every server."""
    eps = list(_require("server_endpoints()").env.pserver_endpoints)
    return ",".join(eps) if to_string else eps


# -- server side ---------------------------------------------------------------------------------
def init_server(dirname: str | None = None) -> None:
    """Start this process's parameter server on POD_IP:PADDLE_PORT (tables from ``dirname``'s
    checkpoint when given; otherwise the trainers create them)."""
    from ps_server import PSServer
    from ps_server.server import RESTORE_LATEST_ENV, ssd_root_from_env

    st = _require("init_server()", TrainingRole.PSERVER)
    env = st.env
    host, _, port = env.current_endpoint.rpartition(":")
    st.server = PSServer(
        host=host,
        port=int(port),
        server_index=env.server_index,
        num_servers=len(env.pserver_endpoints),
        ssd_root=ssd_root_from_env(),
    )
    if dirname:
        st.server.load_checkpoint(dirname)
    elif os.environ.get(RESTORE_LATEST_ENV):  # restarted alone by fleetrun (async/GEO recovery)
        st.server.restore_latest(os.environ[RESTORE_LATEST_ENV])
    st.server.start()
    logger.info("parameter server %d serving on %s", env.server_index, env.current_endpoint)


def run_server() -> None:
    """Serve until the trainers stop the servers (``fleet.stop_worker``)."""
    st = _require("run_server()", TrainingRole.PSERVER)
    if st.server is None:
        init_server()
    while not st.server.wait(0.5):  # wake now and then: a signal's handler (Ctrl-C) runs only
        pass  # once the main thread executes bytecode, whichever thread the kernel gave it to
    logger.info("parameter server %d stopped", st.env.server_index)


# -- trainer side --------------------------------------------------------------------------------
def register_table(module: Any) -> None:
    """A DistributedEmbedding was built: remember it; create its table now if connected
    (before ``fleet.init`` it waits for it)."""
    st = _state
    tables = st.tables if st is not None else _early_tables
    other = tables.get(module.table)
    if other is not None and other is not module:
        raise ConfigError(
            f"two DistributedEmbedding modules use table {module.table!r}; give each its own name",
            key="table",
        )
    tables[module.table] = module
    if st is not None and st.client is not None:
        _create(st, module)


def _create(st: PSState, module: Any) -> None:
    if module.table in st.created:
        return
    st.client.create_table_from_config(module.table_config())
    st.created.add(module.table)
    assert st.communicator is not None
    st.communicator.add_table(
        module.table, module.embedding_dim, float(getattr(module.optimizer, "lr", 0.01))
    )


def _barrier() -> None:
    from collective.comm import barrier

    client = coordination.active()
    if client is not None:  # async/half-async/GEO trainers that can be restarted alone: no gloo
        client.barrier("fleet.ps barrier")
        return
    barrier()


def make_communicator(
    strategy: DistributedStrategy, client: Any, num_trainers: int
) -> Communicator:
    """The communicator of the strategy's mode (see :mod:`fleet.ps.communicator`)."""
    cfg = strategy.a_sync_configs
    if not strategy.a_sync:
        return SyncCommunicator(client, num_trainers, _barrier)
    if cfg.k_steps > 0:
        return GeoCommunicator(client, num_trainers, _barrier, k_steps=cfg.k_steps)
    return AsyncCommunicator(
        client,
        num_trainers,
        _barrier,
        queue_size=cfg.send_queue_size,
        max_merge=cfg.max_merge_var_num,
        barrier_interval=cfg.barrier_interval,
        auto_prefetch=cfg.prefetch,
    )


def init_worker() -> None:
    """Connect to every server (waits until they serve), create the tables of the
    DistributedEmbedding modules built so far, start the communicator."""
    from ps_server import PSClient

    st = _require("init_worker()", TrainingRole.TRAINER)
    if st.client is not None:
        return
    st.client = PSClient(list(st.env.pserver_endpoints))
    register_shutdown("fleet.ps.client", st.client.close)  # a script that never calls stop_worker
    st.client.wait_ready(timeout_s=120)
    st.communicator = make_communicator(st.strategy, st.client, st.env.world_size)
    register_shutdown("fleet.ps.communicator", st.communicator.close)  # closes before the client
    for module in list(st.tables.values()):
        _create(st, module)
    logger.info(
        "trainer %d connected to %d server(s), %s mode",
        st.env.rank,
        len(st.env.pserver_endpoints),
        st.communicator.mode,
    )


@contextlib.contextmanager
def lookups_from(source: Any) -> Iterator[None]:
    """DistributedEmbedding lookups in this context go to ``source`` (an object with the
    communicator's ``pull_sparse``, ``prefetch``, ``record_sparse`` and ``prefetches``: a
    serving copy) instead of the trainer's communicator."""
    token = _lookups.set(source)
    try:
        yield
    finally:
        _lookups.reset(token)


def get_communicator() -> Communicator:
    """The trainer's communicator (after ``init_worker``), or the lookup source of an enclosing
    :func:`lookups_from`."""
    source = _lookups.get()
    if source is not None:
        return source
    st = _require("DistributedEmbedding.forward()", TrainingRole.TRAINER)
    if st.communicator is None:
        raise FleetError(
            "call fleet.init_worker() before the first forward of a DistributedEmbedding"
        )
    return st.communicator


def current_communicator() -> Communicator | None:
    """The trainer's communicator, or None (not a PS trainer, or before ``init_worker``)."""
    st = _state
    return st.communicator if st is not None else None


def get_client() -> Any:
    """The trainer's PSClient (after ``init_worker``)."""
    st = _require("PS client", TrainingRole.TRAINER)
    if st.client is None:
        raise FleetError("call fleet.init_worker() first")
    return st.client


_stop_hooks: list[Any] = []
"""Called first by ``stop_worker`` (a HeterModel drains its micro-batches and tells its heter
worker it is done)."""
_heter_models = 0
"""HeterModels built in this process (a heterogeneous job's trainer needs one)."""


def add_stop_hook(hook: Any) -> None:
    """Run ``hook()`` at the start of ``stop_worker`` (once; :mod:`fleet.heter`)."""
    if hook not in _stop_hooks:
        _stop_hooks.append(hook)


def note_heter_model() -> None:
    """A ``fleet.heter.HeterModel`` was built in this process."""
    global _heter_models
    _heter_models += 1


def _heter_model_missing(st: PSState) -> FleetError | None:
    if not st.env.heter_endpoints or _heter_models:
        return None
    return FleetError(
        f"this job has {len(st.env.heter_endpoints)} heter worker(s) "
        f"({','.join(st.env.heter_endpoints)}) but this trainer's script built no "
        "fleet.heter.HeterModel: the heter workers got no work. Split the model with "
        "fleet.heter.HeterModel(cpu_part, device_part, loss_fn) and train with "
        "model.train_step(inputs, label), or launch without --heter_worker_num"
    )


def stop_worker() -> None:
    """Flush pending updates, wait for every trainer, then trainer 0 waits for its last
    checkpoint to be committed and stops the servers (a checkpoint that failed is raised after
    the servers were stopped). In a heterogeneous job, each HeterModel first drains its
    micro-batches in flight and tells its heter worker this trainer is done."""
    st = _require("stop_worker()", TrainingRole.TRAINER)
    hooks, _stop_hooks[:] = list(_stop_hooks), []
    for hook in hooks:
        hook()
    if st.auto_checkpoint is not None:
        st.auto_checkpoint.finish()  # the progress file shows the last step
    if st.communicator is not None:
        st.communicator.close()
    _barrier()
    failed: BaseException | None = None
    if st.pending_checkpoint is not None:
        try:
            st.pending_checkpoint.result()
        except FleetError as err:
            if st.auto_checkpoint is None:
                failed = err
            else:  # an automatic checkpoint is best effort (a server restarted while it wrote)
                logger.warning("the last automatic checkpoint failed and is skipped: %s", err)
        st.pending_checkpoint = None
    if st.client is not None:
        if st.env.rank == 0:
            st.client.stop_servers()
        st.client.close()
    unregister_shutdown("fleet.ps.communicator")
    unregister_shutdown("fleet.ps.client")
    st.client, st.communicator = None, None
    if failed is not None:
        raise failed
    missing = _heter_model_missing(st)
    if missing is not None:
        raise missing


def lookup_source_in_force() -> bool:
    """Whether an enclosing :func:`lookups_from` sends this thread's lookups elsewhere."""
    return _lookups.get() is not None


def save_persistables(dirname: str, mode: int = 0) -> None:
    """Save every table (sparse and dense) on the servers: ``mode`` 0 = all, 1 = delta since the
    last save. Every trainer calls it; trainer 0 asks the servers after all flushed."""
    if mode not in (0, 1):
        raise ConfigError(f"got {mode!r}; allowed: 0 (all), 1 (delta)", key="mode")
    st = _require("save_persistables()", TrainingRole.TRAINER)
    pass_cache.refuse_in_pass("fleet.save_persistables()")  # checkpoints are cut at pass ends
    get_communicator().flush()
    _barrier()
    if st.env.rank == 0 and not coordination.replaying():  # a restarted trainer 0 saved it before
        get_client().save(dirname, mode="all" if mode == 0 else "delta")
    _barrier()


def shrink(unseen_days: int) -> int:
    """Evict rows unseen for more than ``unseen_days`` days from every sparse table (trainer 0
    asks; every trainer calls). Returns the rows removed (on trainer 0; 0 elsewhere)."""
    st = _require("shrink()", TrainingRole.TRAINER)
    _barrier()
    removed = 0
    if st.env.rank == 0 and not coordination.replaying():
        for table in sorted(st.created):
            removed += int(get_client().shrink(table, unseen_days))
    _barrier()
    return removed


def end_day() -> None:
    """Advance the tables' day counter (unseen_days + 1 for rows not pushed since)."""
    st = _require("end_day()", TrainingRole.TRAINER)
    _barrier()
    if st.env.rank == 0 and not coordination.replaying():
        get_client().end_day()
    _barrier()


__all__ = [
    "DENSE_TABLE",
    "end_day",
    "init_server",
    "heter_worker_num",
    "init_worker",
    "is_heter_worker",
    "is_server",
    "is_worker",
    "run_server",
    "save_persistables",
    "server_endpoints",
    "server_index",
    "server_num",
    "shrink",
    "stop_worker",
]
