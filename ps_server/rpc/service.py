"""The parameter-server RPCs: pure functions over a :class:`ServerState`.

gRPC route_guide style: each RPC is a module-level function ``op(state, request) -> response``
on protobuf messages (no gRPC in them; tests may call them directly); the thin servicer of
:mod:`ps_server.rpc.servicer` counts the request, calls the function and turns an exception into a
status code through :func:`ps_server.rpc.status.status_of` — the one mapping. The server
(:mod:`ps_server.server`) owns the gRPC objects. A bad request never changes a table: every
check runs before the table is touched (the tables validate before they mutate, too).

Push modes (``PushMode``): ``APPLY`` applies the table's optimizer rule now (async training);
``SYNC`` accumulates the W pushes of a round and applies their mean once
(:mod:`ps_server.rpc.sync` documents the exact semantics); ``DELTA`` adds the values to the rows
without an optimizer (GEO, :meth:`SparseTable.add_delta` / :meth:`DenseTable.add`).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collective.env import usable_cpus
from collective.errors import ConfigError
from ps_server import checkpoint
from ps_server.checkpoint.roots import confine, resolve_roots
from ps_server.checkpoint.save_load import load_graphs
from ps_server.checkpoint.series import CheckpointRecord
from ps_server.checkpoint.writer import CheckpointWriter
from ps_server.config import NonFinitePolicy, check_same_config, config_from_dict, config_to_dict
from ps_server.core import kernels
from ps_server.core.batch_ops import all_finite
from ps_server.core.dense_table import DenseTable
from ps_server.core.factory import make_table
from ps_server.core.graph_table import GraphTable
from ps_server.core.serving_table import ServingTable
from ps_server.core.sparse_table import SparseTable
from ps_server.core.table import PushStats, Table
from ps_server.errors import (
    CheckpointError,
    NonFiniteGradientError,
    TableInputError,
    TableNotFoundError,
)
from ps_server.rpc import shm
from ps_server.rpc.codec import decode_keys, decode_rows, decode_shows, decode_values
from ps_server.rpc.proto import ps_pb2
from ps_server.rpc.status import RequestDecodeError
from ps_server.rpc.sync import Barriers, DenseUploads, SyncRounds

logger = logging.getLogger(__name__)

MAX_PASS_THREADS = 8
"""Threads a pass's pull (``with_state``) and end-of-pass push may split their row creation
over: its trainer waits for both."""

SERVICE_NAME = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
"""``fleetrun.ps.v1.ParameterServer`` (also the name health checks report on)."""
MAX_DETAILS_CHARS = 8000
"""Status messages are cut to this length (they travel in a trailer)."""
_MODES = {
    ps_pb2.PUSH_MODE_APPLY: "apply",
    ps_pb2.PUSH_MODE_SYNC: "sync",
    ps_pb2.PUSH_MODE_DELTA: "delta",
}


@dataclass
class ServerState:
    """Everything one server holds: its tables and the coordination state."""

    server_index: int = 0
    num_servers: int = 1
    tables: dict[str, Table] = field(default_factory=dict)
    graph_tables: dict[str, GraphTable] = field(default_factory=dict)
    """The graph tables (served by :mod:`ps_server.rpc.graph_service`; saved and loaded with the
    other tables by Save, Load and job checkpoints)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards changes of ``tables`` (create, load); lookups read the dict without it."""
    sync: SyncRounds = field(default_factory=SyncRounds)
    barriers: Barriers = field(default_factory=Barriers)
    uploads: DenseUploads = field(default_factory=DenseUploads)
    counter_lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards the three counters below (handlers run on many threads)."""
    requests: collections.Counter = field(default_factory=collections.Counter)
    """Requests per RPC name."""
    errors: collections.Counter = field(default_factory=collections.Counter)
    """Failed requests per ``"<RPC>:<STATUS>"``."""
    events: collections.Counter = field(default_factory=collections.Counter)
    """Server-level counters: nonfinite_rejected, sync_rounds_applied, dense_nonfinite_skipped."""
    nonfinite_rejected: collections.Counter = field(default_factory=collections.Counter)
    """NaN/inf contributions refused on arrival, per table (``fleet_ps_nonfinite_gradients``)."""
    started: float = field(default_factory=time.time)
    on_stop: Callable[[], None] | None = None
    """Called by the Stop RPC (the server stops itself after replying)."""
    endpoint: str = ""
    shm: shm.ShmRegistry = field(default_factory=shm.ShmRegistry)
    """Shared-memory segments of same-host clients (:mod:`ps_server.rpc.shm`)."""
    checkpoint_roots: tuple[str, ...] = field(default_factory=resolve_roots)
    """Directories Save / Load requests may name (:mod:`ps_server.checkpoint.roots`; default
    FLEET_PS_CHECKPOINT_ROOT, else the working directory)."""
    data_roots: tuple[str, ...] = ()
    """Directories the graph files a LoadEdges / LoadNodes request names may lie under
    (:func:`~ps_server.checkpoint.roots.resolve_data_roots`; empty: the default, the working
    directory, the checkpoint roots and the temporary directory)."""
    ssd_root: str | None = None
    """Directory of the cold rows of ``storage="ssd"`` tables (``--ssd_root``; None: none)."""
    checkpoints: CheckpointWriter = field(default_factory=CheckpointWriter)
    """This server's background checkpoint writes (:mod:`ps_server.checkpoint.writer`)."""
    serving: list[CheckpointRecord] = field(default_factory=list)
    """The serving exports loaded, base first; non-empty: a read-only serving server."""
    last_export: str = ""
    """Name of the directory of this server's last serving export (a delta follows it)."""

    def count_event(self, name: str) -> None:
        """Add one to server-level counter ``name``."""
        with self.counter_lock:
            self.events[name] += 1

    @property
    def writer(self) -> str:
        """This server's checkpoint manifest name."""
        return f"server-{self.server_index}"


# -- helpers ---------------------------------------------------------------------------------
def get_table(state: ServerState, name: str, kind: str | None = None) -> Table:
    """Table ``name`` (TableNotFoundError naming the tables that exist; TableInputError when it
    is of the other kind)."""
    table = state.tables.get(name)
    if table is None:
        raise TableNotFoundError(
            f"table {name!r} does not exist on server {state.server_index}; tables: "
            f"{sorted(state.tables) or 'none'} (create it with CreateTable first)"
        )
    if kind is not None and table.KIND != kind:
        raise TableInputError(
            name, "table", f"is a {table.KIND} table; this call needs a {kind} table"
        )
    return table


def _mode(table: str, mode: int) -> str:
    name = _MODES.get(mode)
    if name is None:
        raise TableInputError(
            table, "mode", f"must be APPLY, SYNC or DELTA, got {mode} (PUSH_MODE_UNSPECIFIED?)"
        )
    return name


def _check_finite(table: Table, values: np.ndarray, field_name: str) -> None:
    """Under ``nonfinite=reject``, a contribution with NaN/inf is refused on arrival."""
    if table.config.nonfinite is NonFinitePolicy.REJECT and not all_finite(values):
        bad = ~np.isfinite(values)
        rows = int(bad.reshape(values.shape[0], -1).any(axis=1).sum()) if values.ndim == 2 else 1
        raise NonFiniteGradientError(table.name, int(bad.sum()), rows, field=field_name)


def _push_response(stats: PushStats, arrived: int = 0) -> ps_pb2.PushSparseResponse:
    return ps_pb2.PushSparseResponse(**stats.to_dict(), sync_arrived=arrived)


# -- tables ----------------------------------------------------------------------------------
def create_table(state: ServerState, req: ps_pb2.CreateTableRequest) -> ps_pb2.CreateTableResponse:
    """Create this server's part of a table; idempotent, ALREADY_EXISTS for another config."""
    try:
        data = json.loads(req.config_json)
    except ValueError as err:
        raise ConfigError(f"is not valid JSON: {err}", key="config_json") from None
    config = config_from_dict(data, "config")
    with state.lock:
        existing = state.tables.get(config.name)
        if existing is not None:
            check_same_config(existing.config, config)
            return ps_pb2.CreateTableResponse(created=False)
        state.tables[config.name] = make_table(
            config, state.server_index, state.num_servers, ssd_root=state.ssd_root
        )
    logger.info("server %d: created table %s", state.server_index, config_to_dict(config))
    return ps_pb2.CreateTableResponse(created=True)


def list_tables(state: ServerState, req: ps_pb2.ListTablesRequest) -> ps_pb2.ListTablesResponse:
    """The configs of every table, sorted by name."""
    tables = dict(state.tables)
    return ps_pb2.ListTablesResponse(
        config_json=[json.dumps(config_to_dict(tables[n].config)) for n in sorted(tables)]
    )


# -- sparse ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PullSparseReply:
    """The PullSparseResponse of :func:`pull_sparse`, kept as an array until it is written
    (:mod:`ps_server.rpc.wire` encodes it with one copy)."""

    values: np.ndarray
    dim: int
    in_shm: bool = False
    """The rows were written to the request's shared-memory segment (the reply carries none)."""
    state: np.ndarray | None = None
    """``with_state``: float32[n, state_dim], the rows' optimizer state (in the segment too
    when ``in_shm``)."""

    def to_message(self) -> ps_pb2.PullSparseResponse:
        """The same reply as a generated message (tests, tools)."""
        values = b"" if self.in_shm else self.values.tobytes()
        if self.state is None:
            return ps_pb2.PullSparseResponse(values=values, dim=self.dim)
        return ps_pb2.PullSparseResponse(
            values=values,
            dim=self.dim,
            state=b"" if self.in_shm else self.state.tobytes(),
            state_dim=self.state.shape[1],
        )


def _sparse_arrays(
    state: ServerState, table: SparseTable | ServingTable, req: Any, with_rows: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """(keys, rows / grads or None) of a sparse request: views of its shared-memory segment
    (:mod:`ps_server.rpc.shm`) or of its packed bytes."""
    if req.shm_segment:
        if req.keys or getattr(req, "grads", b""):
            raise RequestDecodeError(f"{table.name}: a shm request carries no keys / grads bytes")
        return state.shm.views(req.shm_segment, req.shm_num_keys, table.dim)
    keys = decode_keys(table.name, req.keys)
    rows = decode_rows(table.name, req.grads, keys.shape[0], table.dim) if with_rows else None
    return keys, rows


def pull_sparse(state: ServerState, req: Any) -> PullSparseReply:
    """Rows of the keys (created with their initial value when admitted); ``req`` is a
    PullSparseRequest (or its :mod:`ps_server.rpc.wire` view)."""
    table = get_table(state, req.table, "sparse")
    assert isinstance(table, (SparseTable, ServingTable))
    if getattr(req, "with_state", False):
        if not isinstance(table, SparseTable):
            raise TableInputError(
                table.name,
                "with_state",
                "a serving table holds exported rows without optimizer state; pull without it",
            )
        width = (table.dim, table.state_dim)
        out = state_out = None
        if req.shm_segment:  # the segment's rows: the values, then the state
            if req.keys:
                raise RequestDecodeError(f"{table.name}: a shm request carries no keys bytes")
            keys, rows = state.shm.views(req.shm_segment, req.shm_num_keys, sum(width))
            out, state_out = shm.blocks(rows, width)
        else:
            keys = decode_keys(table.name, req.keys)
        # a pass's pull: its trainer waits for it, so its row creation may take every core
        with kernels.threads_for_call(min(MAX_PASS_THREADS, usable_cpus())):
            values, rows_state = table.pull_with_state(keys, out, state_out)
        return PullSparseReply(values, table.dim, in_shm=out is not None, state=rows_state)
    keys, out = _sparse_arrays(state, table, req, with_rows=False)
    values = table.pull(keys, out)
    return PullSparseReply(values, table.dim, in_shm=out is not None)


def push_sparse(state: ServerState, req: Any) -> ps_pb2.PushSparseResponse:
    """APPLY / SYNC / DELTA push of gradients (or deltas) for the keys; ``req`` is a
    PushSparseRequest (or its :mod:`ps_server.rpc.wire` view)."""
    table = get_table(state, req.table, "sparse")
    assert isinstance(table, SparseTable)
    mode = _mode(table.name, req.mode)
    shows = getattr(req, "shows", b"")
    state_deltas = getattr(req, "state_deltas", b"")
    with_state = getattr(req, "with_state", False)
    for name, given in (("shows", shows), ("state_deltas", state_deltas or with_state)):
        if given and mode != "delta":
            raise TableInputError(
                table.name, name, f"{name} go with a delta push only, not mode {mode!r}"
            )
    moved = None
    if with_state:  # the segment's rows: the deltas, then the state deltas
        if not req.shm_segment or state_deltas or req.keys or req.grads:
            raise RequestDecodeError(
                f"{table.name}: with_state is for a shm push (keys, deltas and state deltas "
                "in the segment); over bytes send keys, grads and state_deltas"
            )
        width = (table.dim, table.state_dim)
        keys, rows = state.shm.views(req.shm_segment, req.shm_num_keys, sum(width))
        grads, moved = shm.blocks(rows, width)
    else:
        keys, grads = _sparse_arrays(state, table, req, with_rows=True)
    assert grads is not None
    if mode == "apply":
        return _push_response(table.push(keys, grads))
    if mode == "delta":
        n = keys.shape[0]
        counts = decode_shows(table.name, shows, n) if shows else None
        if state_deltas:
            moved = decode_rows(
                table.name, state_deltas, n, table.state_dim, "state_deltas", "state_dim"
            )
        # a pass's push (its show counts travel with it): its trainer waits in end_pass, so
        # the rows it creates may take every core, as the pass's pull did
        threads = min(MAX_PASS_THREADS, usable_cpus()) if shows or moved is not None else 0
        with kernels.threads_for_call(threads or kernels.get_threads()):
            return _push_response(table.add_delta(keys, grads, counts, moved))
    table.check_owned(keys)
    _check_finite(table, grads, "grads")
    if req.shm_segment:  # kept until the round completes: the segment is reused meanwhile
        keys, grads = keys.copy(), grads.copy()
    arrived, parts = state.sync.add(
        table.name, f"sparse/{table.name}", req.sync_count, (keys, grads), not req.more_parts
    )
    if parts is None:
        return ps_pb2.PushSparseResponse(num_keys=keys.shape[0], sync_arrived=arrived)
    all_keys = np.concatenate([p[0] for p in parts])
    mean = np.concatenate([p[1] for p in parts]) / np.float32(req.sync_count)
    stats = table.push(all_keys, mean)
    state.count_event("sync_rounds_applied")
    return _push_response(stats, arrived)


def push_step(state: ServerState, req: ps_pb2.PushStepRequest) -> ps_pb2.PushStepResponse:
    """A trainer's async step in one call: each sparse push (APPLY only) as
    :func:`push_sparse`, in order, then the dense push as :func:`push_dense` (its values in the
    reply with ``return_values``). A part that fails stops the call: the parts before it stay
    applied, as separate calls would leave them."""
    for part in req.sparse:
        if _mode(part.table, part.mode) != "apply":
            raise TableInputError(
                part.table, "mode", "PushStep carries APPLY pushes only; send others by PushSparse"
            )
    if req.HasField("dense") and _mode(req.dense.table, req.dense.mode) != "apply":
        raise TableInputError(
            req.dense.table, "mode", "PushStep carries an APPLY push only; send others by PushDense"
        )
    reply = ps_pb2.PushStepResponse(sparse=[push_sparse(state, part) for part in req.sparse])
    if req.HasField("dense"):
        reply.dense.CopyFrom(push_dense(state, req.dense))
    return reply


def shrink(state: ServerState, req: ps_pb2.ShrinkRequest) -> ps_pb2.ShrinkResponse:
    """Delete rows unseen for more than ``unseen_days`` days."""
    table = get_table(state, req.table, "sparse")
    assert isinstance(table, SparseTable)
    return ps_pb2.ShrinkResponse(removed=table.shrink(int(req.unseen_days)))


def end_day(state: ServerState, req: ps_pb2.EndDayRequest) -> ps_pb2.EndDayResponse:
    """Close a day on every table."""
    for name in sorted(state.tables):
        state.tables[name].end_day()
    return ps_pb2.EndDayResponse()


# -- dense -----------------------------------------------------------------------------------
def _dense_values(
    state: ServerState, table: Table, name: str, data: bytes, upload: ps_pb2.DenseUpload, what: str
) -> np.ndarray | None:
    """The whole block of a request, or None while a split upload waits for more parts."""
    values = decode_values(table.name, data, what)
    if not upload.upload_id:
        return values
    return state.uploads.add_part(
        table.name,
        name,
        upload.upload_id,
        int(upload.offset),
        int(upload.total),
        values,
        upload.more_parts,
    )


def init_dense(state: ServerState, req: ps_pb2.InitDenseRequest) -> ps_pb2.InitDenseResponse:
    """Create block ``name`` with its initial values (idempotent with identical values)."""
    table = get_table(state, req.table, "dense")
    assert isinstance(table, DenseTable)
    values = _dense_values(state, table, req.name, req.values, req.upload, "values")
    if values is None:
        return ps_pb2.InitDenseResponse(created=False)
    return ps_pb2.InitDenseResponse(created=table.init(req.name, values))


def pull_dense(state: ServerState, req: ps_pb2.PullDenseRequest) -> ps_pb2.PullDenseResponse:
    """Elements ``[offset, offset + count)`` of block ``name`` (count 0: to the end)."""
    table = get_table(state, req.table, "dense")
    assert isinstance(table, DenseTable)
    values, total = table.pull_slice(req.name, int(req.offset), int(req.count))
    return ps_pb2.PullDenseResponse(values=values.tobytes(), total=total)


def push_dense(state: ServerState, req: ps_pb2.PushDenseRequest) -> ps_pb2.PushDenseResponse:
    """APPLY / SYNC / DELTA push of a block's gradient (or delta); an APPLY / DELTA push of a
    whole block in one request with ``return_values`` replies with the block's values after
    it (one call for a trainer's push-then-pull)."""
    table = get_table(state, req.table, "dense")
    assert isinstance(table, DenseTable)
    mode = _mode(table.name, req.mode)
    numel = table.numel(req.name)  # NOT_FOUND / wrong shard before anything is staged
    grad = _dense_values(state, table, req.name, req.grad, req.upload, "grad")
    if grad is None:
        return ps_pb2.PushDenseResponse(applied=False)
    if grad.shape[0] != numel:
        raise TableInputError(
            table.name, "grad", f"has {grad.shape[0]} elements, block {req.name!r} has {numel}"
        )
    if mode != "sync":
        if mode == "apply":
            applied = table.push(req.name, grad)
        else:
            applied = table.add(req.name, grad)
            if not applied:
                state.count_event("dense_nonfinite_skipped")
        if not (req.return_values and not req.upload.upload_id):
            return ps_pb2.PushDenseResponse(applied=applied)
        # the block after this push, in the same reply: saves the PullDense that follows a push
        values, _ = table.pull_slice(req.name, 0, 0)
        return ps_pb2.PushDenseResponse(applied=applied, values=values.tobytes(), has_values=True)
    _check_finite(table, grad, f"grad of {req.name!r}")
    arrived, parts = state.sync.add(
        table.name, f"dense/{table.name}/{req.name}", req.sync_count, grad, True
    )
    if parts is None:
        return ps_pb2.PushDenseResponse(applied=False, sync_arrived=arrived)
    mean = np.sum(parts, axis=0, dtype=np.float32) / np.float32(req.sync_count)
    applied = table.push(req.name, mean)
    state.count_event("sync_rounds_applied")
    return ps_pb2.PushDenseResponse(applied=applied, sync_arrived=arrived)


# -- checkpoints -----------------------------------------------------------------------------
def save(state: ServerState, req: ps_pb2.SaveRequest) -> ps_pb2.SaveResponse:
    """Save this server's tables into ``dir`` (its own manifest, ``manifest.server-<i>.json``),
    a directory under the server's checkpoint roots
    (:func:`~ps_server.checkpoint.roots.confine`)."""
    if not req.dir:
        raise ConfigError("must name a directory on the server's file system", key="dir")
    directory = confine(req.dir, state.checkpoint_roots)
    mode = req.mode or "all"
    manifest = checkpoint.save(
        directory,
        dict(state.tables),
        mode=mode,
        writer=state.writer,
        graphs=dict(state.graph_tables),
    )
    return ps_pb2.SaveResponse(manifest_json=json.dumps(manifest))


def load_dir(state: ServerState, directory: str) -> tuple[dict[str, int], list[str]]:
    """Load the shards this server owns from ``directory``; tables of the checkpoint this server
    does not hold yet are created from the checkpoint's configs (a full checkpoint only), and
    its graph tables replace this server's of the same name (this server's share, under any
    server count). Returns (rows read per table, tables created). Nothing changes if anything
    fails."""
    if not directory:
        raise ConfigError("must name a checkpoint directory", key="dir")
    info = checkpoint.read_checkpoint(directory)
    graphs = load_graphs(directory, state.server_index, state.num_servers, info)
    for name, graph in graphs.items():
        existing = state.graph_tables.get(name)
        if existing is not None:
            check_same_config(existing.config, graph.config)
    with state.lock:
        targets: dict[str, Table] = {}
        created: list[str] = []
        for name, entry in sorted(info.tables.items()):
            table = state.tables.get(name)
            if table is None:
                if info.mode == "delta":
                    raise CheckpointError(
                        f"{directory}: delta checkpoint of table {name!r}, which server "
                        f"{state.server_index} does not hold: load the full checkpoint it "
                        "follows first"
                    )
                table = make_table(
                    entry.config, state.server_index, state.num_servers, ssd_root=state.ssd_root
                )
                created.append(name)
            targets[name] = table
        rows = checkpoint.load(directory, targets)
        state.tables.update(targets)
        state.graph_tables.update(graphs)
    logger.info(
        "server %d: loaded %s (%s), created tables %s, graph tables %s",
        state.server_index,
        directory,
        rows,
        created,
        sorted(graphs),
    )
    return rows, created


def load(state: ServerState, req: ps_pb2.LoadRequest) -> ps_pb2.LoadResponse:
    """Load a checkpoint (see :func:`load_dir`) from under the server's checkpoint roots."""
    rows, created = load_dir(state, confine(req.dir, state.checkpoint_roots))
    return ps_pb2.LoadResponse(rows=rows, created_tables=created)


# -- coordination ----------------------------------------------------------------------------
def barrier(
    state: ServerState, req: ps_pb2.BarrierRequest, is_active: Callable[[], bool] = lambda: True
) -> ps_pb2.BarrierResponse:
    """Wait until ``count`` callers of barrier ``name`` arrived."""
    generation = state.barriers.wait(req.name, int(req.count), float(req.timeout_s), is_active)
    return ps_pb2.BarrierResponse(generation=generation)


def _counters(state: ServerState) -> dict[str, dict[str, int]]:
    with state.counter_lock:
        return {
            "requests": dict(state.requests),
            "errors": dict(state.errors),
            "events": dict(state.events),
        }


def stats(state: ServerState, req: ps_pb2.StatsRequest) -> ps_pb2.StatsResponse:
    """Sizes and counters of this server as JSON."""
    tables = dict(state.tables)
    data: dict[str, Any] = {
        "server_index": state.server_index,
        "num_servers": state.num_servers,
        "endpoint": state.endpoint,
        "uptime_s": round(time.time() - state.started, 3),
        "tables": {n: tables[n].stats() for n in sorted(tables)},
        "graph_tables": {n: g.stats() for n, g in sorted(dict(state.graph_tables).items())},
        **_counters(state),
        "sync_rounds_open": state.sync.pending(),
        "barriers": state.barriers.snapshot(),
        "uploads_pending": state.uploads.num_pending(),
        "serving": [r.to_dict() for r in state.serving],
    }
    return ps_pb2.StatsResponse(stats_json=json.dumps(data, default=float))


def stop(state: ServerState, req: ps_pb2.StopRequest) -> ps_pb2.StopResponse:
    """Ask the server to stop after this reply (graceful: in-flight calls finish)."""
    logger.info("server %d: Stop requested", state.server_index)
    if state.on_stop is not None:
        state.on_stop()
    return ps_pb2.StopResponse()


def shm_attach(state: ServerState, req: ps_pb2.ShmAttachRequest) -> ps_pb2.ShmAttachResponse:
    """Map a same-host client's shared-memory segment (:mod:`ps_server.rpc.shm`)."""
    state.shm.attach(req.segment, req.token)
    return ps_pb2.ShmAttachResponse()


def shm_detach(state: ServerState, req: ps_pb2.ShmDetachRequest) -> ps_pb2.ShmDetachResponse:
    """Unmap a client's segment (the client closes)."""
    return ps_pb2.ShmDetachResponse(detached=state.shm.detach(req.segment))


__all__ = [
    "SERVICE_NAME",
    "PullSparseReply",
    "ServerState",
    "barrier",
    "create_table",
    "end_day",
    "get_table",
    "init_dense",
    "list_tables",
    "load",
    "load_dir",
    "pull_dense",
    "pull_sparse",
    "push_dense",
    "push_sparse",
    "save",
    "shm_attach",
    "shm_detach",
    "shrink",
    "stats",
    "stop",
]
