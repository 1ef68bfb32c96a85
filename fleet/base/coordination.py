"""PS trainers meeting through fleetrun's coordinator instead of a gloo group (the client side).

A fleetrun PS job with automatic checkpoints gets FLEET_PS_COORDINATOR (the endpoint of the
coordinator its agent hosts: ``launcher.recovery.coordinator``; the wire:
:mod:`collective.ps_coordination`). When its strategy is async, half-async (``a_sync`` with
``barrier_interval``) or GEO, ``fleet.init`` calls :func:`start` instead of forming the trainers'
gloo group: a dead trainer can then be restarted alone, from its data position, while the
others train on (a gloo group cannot admit a replacement). Sync trainers meet at every step
and keep gloo: they are recovered by restarting every process.

**Half-async barriers** (every ``barrier_interval`` = N steps, :mod:`fleet.ps.communicator`) are
rounds of their own channel (``collective.ps_coordination.BARRIER_CHANNEL``) numbered by the
trainer's global step, not by call order: the barrier after step ``s`` (``s % N == 0``) is round
``s // N - 1`` (:meth:`CoordinationClient.interval_barrier`). A trainer restarted alone resumes
at its data position (up to a second behind where it died): the barriers it passes again answer
at once from the record, and the first one it had not passed waits for every trainer as before,
so the survivors wait at most for the restarted trainer to catch up to their barrier (staleness
stays bounded by N steps, plus the steps it redoes). Those rounds also outlive a restart of every
process (``Coordinator.reset``): trainers resumed from a checkpoint whose positions straddle a
barrier (one cut just after it, one blocked in it) pass it again from the record instead of
waiting for a trainer already past it.

What goes through it (each a *round*: every trainer contributes a pickled value, every trainer
gets all of them): ``fleet.barrier_worker``, the PS barriers (``fleet.ps.runtime``),
``fleet.metrics`` (sum, max, min, auc, acc, ... reduced on the trainer from the gathered
values), ``fleet.ps``'s gathers (``checkpoint``, ``load_latest``, ``export_serving``) and the
datasets' ``get_memory_data_size(fleet)``. Rounds are numbered per channel; a restarted trainer
re-running its script gets its rounds that completed before at once: the others' recorded
contributions with its own new one in its place, so its prologue replays without the others
(e.g. the CTR example's ``metrics.sum(held)`` gets the others' recorded counts and the
restarted trainer's own new one). What trainer 0 does *between* two replayed
rounds on the servers' side (``save_persistables``, ``shrink``, ``end_day``, ``fleet.ps.checkpoint``)
is skipped while it replays (:func:`replaying`): it happened once, before the restart. What cannot work this way raises
:class:`~collective.errors.FleetNotImplementedError` naming the fix: a ``global_shuffle``
across trainers, a process group given to ``fleet.metrics``; ``collective.comm`` finds no
process group (torch's error).

The automatic checkpoints (:mod:`fleet.ps.auto_checkpoint`) use :meth:`CoordinationClient.poll_epoch`,
:meth:`~CoordinationClient.cut`, :meth:`~CoordinationClient.report` and
:meth:`~CoordinationClient.wait_snapshot`: cuts decided by time by the coordinator, each trainer
at its own step, none waiting for a dead one.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from typing import Any

from collective import ps_coordination as wire
from collective.env import FLEET_PS_COORDINATOR, TrainingRole, WorkerEnv
from collective.errors import FleetError, FleetNotImplementedError
from fleet.base.data_position import tracker

logger = logging.getLogger(__name__)

MAIN = "collective"
"""The channel of the script's own cross-trainer calls, replayed after a restart."""
TOKEN_ENV = "FLEET_PS_TOKEN"
"""The job's token (``ps_server.rpc.auth``; also the coordinator's authentication key)."""


class CoordinationClient:
    """One trainer's connections to the coordinator."""

    def __init__(self, endpoint: str, token: str, rank: int, world: int, attempt: int) -> None:
        self.endpoint, self.rank, self.world, self.attempt = endpoint, rank, world, attempt
        self._key = token.encode()
        self._lock = threading.Lock()
        self._seq: dict[str, int] = {}
        self._done_upto: dict[str, int] = {}
        self.replayed = 0
        """Rounds this trainer got from the record (its replayed prologue)."""
        self._conn = self._connect()
        self._poll_conn: Any = None

    def _connect(self) -> Any:
        try:
            conn = wire.connect(self.endpoint, self._key)
        except (OSError, EOFError) as err:
            raise FleetError(
                f"cannot reach the PS trainers' coordinator at {self.endpoint} "
                f"({FLEET_PS_COORDINATOR}): {err}"
            ) from None
        reply = self._call(conn, {"op": "hello", "world": self.world})
        self.hello = reply
        return conn

    def _call(
        self, conn: Any, header: dict[str, Any], payloads: tuple[bytes, ...] = ()
    ) -> dict[str, Any]:
        return self._call_full(conn, header, payloads)[0]

    def _call_full(
        self, conn: Any, header: dict[str, Any], payloads: tuple[bytes, ...] = ()
    ) -> tuple[dict[str, Any], list[bytes]]:
        try:
            wire.send(
                conn,
                {
                    "rank": self.rank,
                    "attempt": self.attempt,
                    "position": tracker().position().to_dict(),
                    **header,
                },
                payloads,
            )
            reply, out = wire.recv(conn)
        except (OSError, EOFError) as err:
            raise FleetError(
                f"lost the PS trainers' coordinator at {self.endpoint} (fleetrun's agent): {err}"
            ) from None
        if not reply.get("ok"):
            raise FleetError(str(reply.get("error", "coordination failed")))
        return reply, out

    # -- rounds ----------------------------------------------------------------------------------
    def gather(
        self,
        obj: Any,
        kind: str,
        channel: str = MAIN,
        recorded: bool = False,
        seq: int | None = None,
    ) -> list[Any]:
        """``obj`` of every trainer, by rank (a barrier too). A round that completed before (this
        trainer restarted) returns the others' recorded values with ``obj`` as this trainer's
        (``recorded``: with this trainer's recorded value, e.g. trainer 0's agreed outcome).
        ``seq``: the round's number on ``channel`` (default: the next in this process's order)."""
        data = pickle.dumps(obj)
        with self._lock:
            if seq is None:
                seq = self._seq.get(channel, 0)
            self._seq[channel] = seq + 1
            reply, payloads = self._call_full(
                self._conn, {"op": "round", "channel": channel, "seq": seq, "kind": kind}, (data,)
            )
        values: list[Any] = [None] * self.world
        for r, p in zip(reply["ranks"], payloads):
            values[int(r)] = pickle.loads(p)  # noqa: S301 - peers of this job (token-authenticated)
        if not (recorded and reply.get("replayed")):
            values[self.rank] = obj
        self._done_upto[channel] = int(reply.get("done_upto", -1))
        if reply.get("replayed"):
            self.replayed += 1
            logger.info(
                "trainer %d: round %d of %s (%s) replayed from the record",
                self.rank,
                seq,
                channel,
                kind,
            )
        return values

    def replaying(self, channel: str = MAIN) -> bool:
        """True while this trainer re-runs what its predecessor (before a restart) already did:
        its next round on ``channel`` completed before. A side effect between two rounds (trainer
        0 asking the servers to save, shrink, checkpoint) is then skipped: it happened once."""
        return self._done_upto.get(channel, -1) >= self._seq.get(channel, 0)

    def barrier(self, kind: str = "barrier") -> None:
        """Wait for every trainer (replayed after a restart as any round)."""
        self.gather(None, kind)

    def interval_barrier(self, index: int) -> None:
        """Half-async: barrier ``index`` (the one after global step ``(index + 1) * N``) on
        :data:`~collective.ps_coordination.BARRIER_CHANNEL` (module docstring)."""
        self.gather(None, "half-async barrier", channel=wire.BARRIER_CHANNEL, seq=index)

    # -- checkpoint epochs -----------------------------------------------------------------------
    def poll_epoch(self, after: int) -> tuple[int, bool]:
        """(epoch, whether this trainer must cut in it): waits up to ``wire.POLL_S`` (on the
        poller's own connection; call from one thread)."""
        if self._poll_conn is None:
            self._poll_conn = wire.connect(self.endpoint, self._key)
        reply = self._call(self._poll_conn, {"op": "ckpt_wait", "after": after})
        return int(reply["epoch"]), bool(reply.get("cut"))

    def _ckpt(self, header: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self._call(self._conn, header)

    def cut(self, epoch: int, position: dict[str, int]) -> dict[str, Any]:
        """Take part in epoch ``epoch``'s cut at ``position``: {taken, leader, positions, last_step}."""
        return self._ckpt({"op": "ckpt_cut", "epoch": epoch, "position": position})

    def report(self, epoch: int, outcome: tuple[str, Any]) -> None:
        """The leader: the snapshot's outcome (``("ok", info)`` or ``("error", text)``)."""
        self._ckpt({"op": "ckpt_done", "epoch": epoch, "outcome": list(outcome)})

    def wait_snapshot(self, epoch: int) -> list[Any]:
        """The others: wait for the leader's outcome of ``epoch``."""
        return list(self._ckpt({"op": "ckpt_result", "epoch": epoch})["outcome"])

    def leave(self) -> None:
        """This trainer takes part in no more checkpoints (its training ended)."""
        try:
            self._ckpt({"op": "ckpt_leave"})
        except FleetError as err:
            logger.debug("coordinator leave: %s", err)

    def close(self) -> None:
        for conn in (self._conn, self._poll_conn):
            if conn is not None:
                try:
                    conn.close()
                except OSError:
                    pass


_client: CoordinationClient | None = None


def active() -> CoordinationClient | None:
    """This trainer's client when its trainers meet through the coordinator, else None."""
    return _client


def wanted(env: WorkerEnv, strategy: Any) -> bool:
    """Whether a trainer with ``strategy`` meets through the coordinator: fleetrun gave one, and
    the mode is async, half-async or GEO (``a_sync``)."""
    if env.training_role is not TrainingRole.TRAINER or not os.environ.get(FLEET_PS_COORDINATOR):
        return False
    return bool(strategy.a_sync)


def start(env: WorkerEnv) -> CoordinationClient:
    """Connect this trainer to the coordinator (once per process)."""
    global _client
    if _client is None:
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise FleetError(
                f"{FLEET_PS_COORDINATOR} is set but {TOKEN_ENV} is not: the coordinator "
                "admits the job's trainers only; start the job with fleetrun"
            )
        _client = CoordinationClient(
            os.environ[FLEET_PS_COORDINATOR], token, env.rank, env.world_size, env.restart_count
        )
        logger.info(
            "trainer %d meets the other trainers through the coordinator at %s "
            "(async/half-async/GEO: it can be restarted alone); there is no process "
            "group: a direct collective.comm / torch.distributed call fails (run sync, or without "
            "--ps_checkpoint_dir, for such a script)",
            env.rank,
            _client.endpoint,
        )
    return _client


def refuse(what: str) -> None:
    """FleetNotImplementedError for ``what``, which needs a process group among the trainers."""
    raise FleetNotImplementedError(
        f"{what} moves data between the trainers through a process group, which "
        "async/half-async/GEO trainers of a fleetrun job with --ps_checkpoint_dir do not form "
        "(they meet through fleetrun's coordinator so that one can be restarted alone); use a "
        "local shuffle "
        "(local_shuffle) or fleet.metrics / fleet.barrier_worker, or run without "
        "--ps_checkpoint_dir"
    )


def replaying() -> bool:
    """:meth:`CoordinationClient.replaying` of this trainer (False without a coordinator)."""
    return _client is not None and _client.replaying()


__all__ = ["MAIN", "CoordinationClient", "active", "refuse", "replaying", "start", "wanted"]
