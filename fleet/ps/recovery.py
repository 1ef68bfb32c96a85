"""Job checkpoints of parameter-server training, from the trainers: ``fleet.ps.checkpoint`` and
``fleet.ps.load_latest``.

A checkpoint is one consistent cut of the job — every server's sparse and dense tables with
their optimizer state, and each trainer's own state (an opaque JSON value such as its data
position) — taken at a step boundary. Every trainer calls :func:`checkpoint` after the same
step; each flushes its communicator (async: the queued pushes are applied; GEO: the deltas are
pushed), then the trainers meet, trainer 0 asks every server for its snapshot
(:meth:`PSClient.begin_checkpoint <ps_server.rpc.checkpoint_client.CheckpointCalls.begin_checkpoint>`)
and the trainers meet again: no push reaches a server between the first and the last snapshot.
Training then goes on while the servers write; trainer 0 commits the checkpoint (writes
``checkpoint.json`` last, deletes old ones beyond ``keep``) on a background thread once every
server's part is durable. The next :func:`checkpoint` and ``fleet.stop_worker()`` wait for that
commit first, and raise if it failed.

:func:`load_latest` (every trainer, after ``init_worker``) has trainer 0 load the newest good
checkpoint of a directory into every server — falling back past a checkpoint that is unfinished
or corrupt, and saying so — and gives every trainer the chosen checkpoint (step, trainer states).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from collective.env import TrainingRole
from collective.errors import FleetError
from fleet.base import coordination
from fleet.ps import pass_cache
from fleet.ps.communicator import GeoCommunicator
from fleet.ps.runtime import _require, get_client, get_communicator

logger = logging.getLogger(__name__)

RESUME_CHANNEL = "fleet.ps.load_latest"
"""The coordinator channel of :func:`load_latest` (kept apart from the script's main channel)."""


def _gather(obj: Any, channel: str = "", recorded: bool = False) -> list[Any]:
    """``obj`` of every trainer (gloo among trainers, or the coordinator's round on ``channel``
    — default its main one — for trainers that can be restarted alone; a barrier too).
    ``recorded``: a replayed round gives this trainer's recorded value too, not ``obj``."""
    from collective.comm import all_gather_object

    client = coordination.active()
    if client is not None:
        return client.gather(obj, "fleet.ps gather", channel or coordination.MAIN, recorded)
    out: list[Any] = []
    all_gather_object(out, obj)
    return out


def _agree(rank: int, outcome: Any, channel: str = "") -> Any:
    """Trainer 0's outcome (a value or an error message) on every trainer; every trainer raises
    the error, so none waits for the others in a later collective."""
    kind, value = _gather((rank, outcome), channel, recorded=True)[0][1]  # a replay: as recorded
    if kind == "error":
        raise FleetError(value)
    return value


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except FleetError as err:
        return ("error", f"{type(err).__name__}: {err}")


def finish_pending(st: Any) -> None:
    """Trainer 0: wait until the last checkpoint is committed (its failure is raised); the
    servers write one checkpoint or export at a time."""
    if st.pending_checkpoint is not None:
        previous, st.pending_checkpoint = st.pending_checkpoint, None
        previous.result()


def checkpoint(
    root_dir: str,
    step: int,
    *,
    trainer_state: Any = None,
    keep: int = 0,
    wait: bool = False,
) -> Any:
    """Checkpoint the job into ``root_dir/ckpt-<step>`` (on the servers, under their checkpoint
    roots). Every trainer calls it after the same step, with its own ``trainer_state`` (any JSON
    value, e.g. ``{"file": ..., "pass": ..., "offset": ...}``). ``keep`` > 0 keeps the newest
    ``keep`` checkpoints. Returns once every server took its snapshot; on trainer 0 the
    :class:`~ps_server.rpc.checkpoint_client.PendingCheckpoint` (``result()`` waits for the
    commit; ``wait=True`` waits here), None on the others."""
    st = _require("ps.checkpoint()", TrainingRole.TRAINER)
    pass_cache.refuse_in_pass("fleet.ps.checkpoint()")  # checkpoints are cut at pass ends
    rank = st.env.rank
    get_communicator().flush()
    try:
        mine = ("ok", json.dumps(trainer_state))
    except (TypeError, ValueError) as err:
        mine = ("error", f"trainer {rank}: trainer_state is not JSON data: {err}")
    gathered = _gather((rank, step, mine))  # every trainer has flushed past this point
    problems = [v for _, _, (k, v) in gathered if k == "error"]
    steps = sorted({s for _, s, _ in gathered})
    if len(steps) > 1:
        problems.append(f"trainers checkpoint different steps {steps}: call it after the same step")
    if problems:
        raise FleetError("; ".join(problems))
    states = {r: json.loads(v) for r, _, (_, v) in gathered}
    pending = None

    def begin() -> dict[str, float]:
        nonlocal pending
        finish_pending(st)  # one at a time; its failure surfaces here
        pending = get_client().begin_checkpoint(
            root_dir, step, trainer_states=states, keep=keep, background=not wait
        )
        return {"snapshot_s": pending.snapshot_s}

    again = coordination.replaying()  # a restarted trainer 0 took this one before its restart
    taken = _agree(
        rank, _outcome(begin) if rank == 0 and not again else None
    )  # nobody pushes before this
    logger.info(
        "checkpoint %s step %d: snapshot taken (%.3fs)", root_dir, step, taken["snapshot_s"]
    )
    if rank != 0 or pending is None:
        return None
    if wait:
        pending.result()
    else:
        st.pending_checkpoint = pending
    return pending


def load_latest(root_dir: str) -> Any:
    """Load the newest good checkpoint of ``root_dir`` into every server (every trainer calls
    it, after ``fleet.init_worker()``; trainer 0 asks the servers). Returns, on every trainer,
    the :class:`~ps_server.checkpoint.series.LatestGood`: ``chosen`` (``step``,
    ``trainer_states[rank]``; None when ``root_dir`` holds no checkpoint) and ``skipped``
    (each newer checkpoint passed over, with the reason). The trainer's dense parameters are
    refreshed from the servers."""
    from ps_server.checkpoint.series import LatestGood, record_from_dict

    st = _require("ps.load_latest()", TrainingRole.TRAINER)
    comm = get_communicator()
    comm.flush()
    # its own channel: a trainer restarted alone resumes from its position and skips this
    _gather(
        None, RESUME_CHANNEL
    )  # every trainer flushed: nothing reaches the servers after the load

    def load() -> dict[str, Any]:
        finish_pending(st)
        result = get_client().load_latest(root_dir)
        chosen = result.chosen.to_dict() if result.chosen is not None else None
        return {"chosen": chosen, "skipped": [list(s) for s in result.skipped]}

    got = _agree(st.env.rank, _outcome(load) if st.env.rank == 0 else None, RESUME_CHANNEL)
    chosen = record_from_dict(got["chosen"]) if got["chosen"] is not None else None
    result = LatestGood(chosen, tuple((name, why) for name, why in got["skipped"]))
    comm.forget_server_values()
    if chosen is not None and comm.dense:
        comm._set_dense(comm.pull_dense())
        if isinstance(comm, GeoCommunicator):
            comm.set_dense_base()
    return result


__all__ = ["checkpoint", "finish_pending", "load_latest"]
