"""The checkpoint and serving RPCs: pure functions over a
:class:`~ps_server.rpc.service.ServerState`, as in :mod:`ps_server.rpc.service`.

A job checkpoint (or serving export) is two-phase (:mod:`ps_server.checkpoint.series`):
``CheckpointBegin`` on every server takes the snapshot (the tables are locked only for the copy)
and starts the background write (:mod:`ps_server.checkpoint.writer`); ``CheckpointWait`` on every
server returns once its part is durable; ``CheckpointCommit`` on server 0 writes the job's
``checkpoint.json`` last and prunes old checkpoints. Every path arrives as ``root`` (confined to
the server's checkpoint roots, :mod:`ps_server.checkpoint.roots`) plus ``name``, a single path
component, so a request cannot reach outside the roots.

A server serving a read-only export (``python -m ps_server --serve DIR``) refuses every call
that would change it (:data:`MUTATING`, :func:`check_writable`): FAILED_PRECONDITION naming
read-only serving. Its Load loads the next delta export of the chain it serves.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from collective.errors import ConfigError
from ps_server import telemetry
from ps_server.checkpoint import save_load, series
from ps_server.checkpoint.roots import confine
from ps_server.checkpoint.serving import check_chain
from ps_server.core.table import ChangeLog
from ps_server.errors import CheckpointError, ReadOnlyServingError
from ps_server.rpc import service
from ps_server.rpc.proto import ps_pb2
from ps_server.rpc.service import ServerState

logger = logging.getLogger(__name__)

KINDS = ("checkpoint", "serving")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
DEFAULT_WAIT_S = 3600.0
"""Longest a CheckpointWait blocks when the request gives no timeout."""

MUTATING = frozenset(
    {
        "CreateTable",
        "PushSparse",
        "InitDense",
        "PushDense",
        "PushStep",
        "Save",
        "Shrink",
        "EndDay",
        "CheckpointBegin",
        "CheckpointCommit",
    }
)
"""RPCs a read-only serving server refuses (Load there loads a delta export; pulls, Stats,
ListTables, Barrier, health, shared memory and Stop are served)."""


def check_writable(state: ServerState, op: str) -> None:
    """ReadOnlyServingError if ``state`` serves a read-only export and ``op`` would change it."""
    if state.serving and op in MUTATING:
        served = ", ".join(str(r.directory) for r in state.serving)
        raise ReadOnlyServingError(
            f"{op} refused: server {state.server_index} serves the read-only export {served}; "
            "a serving copy changes only by loading the next delta export (Load), train on "
            "the training servers"
        )


def _directory(state: ServerState, root: str, name: str) -> tuple[Path, Path]:
    """(root, root/name), the root confined to the checkpoint roots, the name one component."""
    if not root:
        raise ConfigError("must name the checkpoints' directory on the servers", key="root")
    if not _NAME_RE.match(name or ""):
        raise ConfigError(
            f"must be one path component of letters, digits, '_', '.', '-' (not starting with "
            f"'.'), got {name!r}",
            key="name",
        )
    base = Path(confine(root, state.checkpoint_roots))
    return base, base / name


def checkpoint_begin(
    state: ServerState, req: ps_pb2.CheckpointBeginRequest
) -> ps_pb2.CheckpointBeginResponse:
    """Snapshot this server's tables and write them into ``root/name`` in the background.

    A job checkpoint is a full copy that consumes no change log (delta saves and delta exports
    keep their chains); a serving export consumes the EXPORT log. Refused while a SYNC round is
    half pushed: a consistent cut is taken at a step boundary."""
    kind = req.kind or "checkpoint"
    mode = req.mode or "all"
    if kind not in KINDS:
        raise ConfigError(f"must be one of {KINDS}, got {kind!r}", key="kind")
    save_load.check_mode(mode)
    if kind == "checkpoint" and mode != "all":
        raise ConfigError(
            "a job checkpoint is always complete (mode 'all'): a recovery point must load on "
            "its own; delta saves are Save(mode='delta')",
            key="mode",
        )
    _, directory = _directory(state, req.root, req.name)
    open_rounds = state.sync.pending()
    if open_rounds:
        raise CheckpointError(
            f"{open_rounds} SYNC push round(s) are half pushed on server {state.server_index}: "
            "take a checkpoint at a step boundary (after every trainer's step, before the next)"
        )
    serving = kind == "serving"
    previous = state.last_export

    def forget_export() -> None:  # a failed export is not one a delta can follow
        if state.last_export == directory.name:
            state.last_export = previous

    with state.lock:  # no table is created or loaded while the snapshot is taken
        job = state.checkpoints.begin(
            directory,
            dict(state.tables),
            state.writer,
            kind=kind,
            mode=mode,
            log=ChangeLog.EXPORT if serving else None,
            min_show=int(req.min_show),
            on_failure=forget_export if serving else None,
            graphs=None if serving else dict(state.graph_tables),
        )
        if serving:
            state.last_export = directory.name
    telemetry.CHECKPOINT_SECONDS.labels(op="snapshot").observe(job.snapshot_s)
    return ps_pb2.CheckpointBeginResponse(
        snapshot_s=job.snapshot_s,
        snapshot_bytes=job.snapshot_bytes,
        previous_export=previous if serving else "",
    )


def checkpoint_wait(
    state: ServerState, req: ps_pb2.CheckpointWaitRequest
) -> ps_pb2.CheckpointWaitResponse:
    """This server's manifest once its part of ``root/name`` is durable (the write's error if
    it failed)."""
    _, directory = _directory(state, req.root, req.name)
    job = state.checkpoints.job(directory)
    manifest = job.wait(float(req.timeout_s) or DEFAULT_WAIT_S)
    telemetry.CHECKPOINT_SECONDS.labels(op="write").observe(job.write_s)
    return ps_pb2.CheckpointWaitResponse(manifest_json=json.dumps(manifest), write_s=job.write_s)


def _json_object(raw: str, key: str) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise ConfigError(f"is not valid JSON: {err}", key=key) from None
    if not isinstance(data, dict):
        raise ConfigError(f"must be a JSON object, got {type(data).__name__}", key=key)
    return data


def checkpoint_commit(
    state: ServerState, req: ps_pb2.CheckpointCommitRequest
) -> ps_pb2.CheckpointCommitResponse:
    """Write ``checkpoint.json`` of ``root/name`` (after checking every server's part), then keep
    the newest ``keep`` checkpoints of ``root``."""
    base, directory = _directory(state, req.root, req.name)
    states = _json_object(req.trainer_states_json, "trainer_states")
    try:
        trainer_states = {int(k): v for k, v in states.items()}
    except ValueError:
        raise ConfigError(
            f"keys must be trainer ranks, got {sorted(states)}", key="trainer_states"
        ) from None
    record = series.commit(
        directory,
        int(req.step),
        num_writers=int(req.num_servers) or None,
        trainer_states=trainer_states,
        extra=_json_object(req.extra_json, "extra"),
    )
    deleted = series.prune(base, int(req.keep)) if req.keep and record.kind == "checkpoint" else []
    return ps_pb2.CheckpointCommitResponse(
        record_json=json.dumps(record.to_dict()), deleted=deleted
    )


def list_checkpoints(
    state: ServerState, req: ps_pb2.ListCheckpointsRequest
) -> ps_pb2.ListCheckpointsResponse:
    """The numbered checkpoints of ``root``, newest first, verified (sizes, or every CRC-32)."""
    if not req.root:
        raise ConfigError("must name the checkpoints' directory on the servers", key="root")
    base = Path(confine(req.root, state.checkpoint_roots))
    level = series.Verify.FULL if req.full else series.Verify.MANIFESTS
    out = [
        {
            "name": s.name,
            "step": s.step,
            "ok": s.ok,
            "reason": s.reason,
            "record": s.record.to_dict() if s.record is not None else None,
        }
        for s in series.list_checkpoints(base, level)
    ]
    return ps_pb2.ListCheckpointsResponse(checkpoints_json=json.dumps(out))


def load(state: ServerState, req: ps_pb2.LoadRequest) -> ps_pb2.LoadResponse:
    """Load: a checkpoint (:func:`ps_server.rpc.service.load`), or on a serving server the next
    delta export of the chain it serves."""
    if not state.serving:
        return service.load(state, req)
    rows = load_serving_delta(state, confine(req.dir, state.checkpoint_roots))
    return ps_pb2.LoadResponse(rows=rows)


def load_serving_delta(state: ServerState, directory: str) -> dict[str, int]:
    """Load the next delta export of the chain a serving server serves (checked to follow the
    last one loaded); nothing changes if anything fails."""
    record = series.verify(Path(directory), series.Verify.MANIFESTS)
    check_chain([*state.serving, record])
    with state.lock:
        rows = save_load.load(record.directory, dict(state.tables), kind="serving")
        state.serving.append(record)
    logger.info("server %d: serving delta %s loaded: %s", state.server_index, directory, rows)
    return rows


__all__ = [
    "MUTATING",
    "check_writable",
    "checkpoint_begin",
    "checkpoint_commit",
    "checkpoint_wait",
    "list_checkpoints",
    "load",
    "load_serving_delta",
]
