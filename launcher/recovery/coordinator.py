"""The PS trainers' coordinator: hosted by fleetrun's agent, so a dead async/half-async/GEO trainer can be
restarted alone while the other trainers go on (local scheduler; on Ray fleetrun, the driver,
hosts it the same way on its node's IP: :mod:`launcher.schedulers.ray.ps_recovery`).

Why here: a gloo group among the trainers cannot admit a replacement (its store lives in
trainer 0), and the servers can die too; the agent outlives every trainer and server of its node.
For a PS job with ``--ps_checkpoint_dir`` the agent starts one :class:`Coordinator` (a listening
thread and one thread per connection, standard library only) and hands its endpoint to the
trainers (FLEET_PS_COORDINATOR). Trainers in async, half-async or GEO mode then form no gloo
group; every cross-trainer operation of fleet (``barrier_worker``, ``fleet.metrics``,
``fleet.ps``'s gathers, the automatic checkpoints, the half-async barriers) meets here
(``fleet.base.coordination``, the client; the wire: :mod:`collective.ps_coordination`). Sync
trainers keep their gloo group (their per-step barriers) and ignore it.

**Named rounds, recorded (deterministic replay).** A round is keyed by (channel, sequence
number within the channel); it completes when every trainer of the job contributed, and its
payloads stay recorded. A trainer restarted alone runs its script from the top: its rounds that
completed before (its prologue: ``fleet.metrics.sum(held)``, ``barrier_worker()``, ...) are
answered at once from the record — the others' recorded contributions, combined on the trainer
with its own new one — so the prologue replays without the survivors. From the first round not
completed it takes part live; such a round waits for every trainer (the dead one comes back).
A replayed round whose kind differs from the record (the script took another path) is refused,
naming both.

**Checkpoint epochs do not wait for the dead.** A trainer that reached its training loop polls
here (``ckpt_wait``). Every ``interval_s`` the coordinator opens an epoch whose members are the
trainers polling, alive, and not blocked in another round; each member, at its next step
boundary, flushes and cuts (``ckpt_cut``) with its data position. The cut completes when every
member is in, or has died, left, or blocked in a round (or after :data:`CUT_WAIT_S`); a trainer
that is not in it is represented by its last reported position (for a dead one, the position the
agent read from its progress file: where it will resume). The lowest cutting rank (the *leader*)
takes the snapshot and reports it; the others wait for that report, as in
:func:`fleet.ps.checkpoint`. The checkpoint's step is the largest trainer step (each trainer now
trains its own stream at its own pace); an epoch where it did not grow is skipped. An epoch
whose members all entered a round before cutting (half-async trainers meet at a barrier every N
steps) closes with no cut, and the next one opens at once instead of an interval later.

One coordinator per job; :meth:`Coordinator.reset` starts an attempt afresh (a restart-all
recovery): the trainers of an earlier attempt are refused; only the completed half-async
barriers stay recorded (they are numbered by global step, not by call order). Memory: every completed round's
payloads are kept for the job's life (fleet's rounds carry a few numbers; an AUC histogram is
64 KiB).

On Kubernetes no agent outlives the trainers: the coordinator runs in a pod of its own
(:mod:`launcher.schedulers.k8s.coordinator`, on a fixed ``port``), and a restarted trainer pod
asks it (``restart_alone``) before restarting its trainer alone: only a coordinator that greeted
that trainer in this attempt holds its rounds, so one that was itself restarted says no and the
job restarts every pod instead.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from collective import ps_coordination as wire

logger = logging.getLogger(__name__)


@dataclass
class _Round:
    kind: str
    contribs: dict[int, bytes] = field(default_factory=dict)
    done: bool = False
    error: str = ""


@dataclass
class _Epoch:
    number: int
    required: set[int]
    opened: float
    cut: dict[int, Any] = field(default_factory=dict)
    closed: bool = False
    leader: int | None = None
    positions: dict[int, Any] = field(default_factory=dict)
    outcome: list[Any] | None = None


def _shut_down(fd: int) -> None:
    """Shut the socket ``fd`` down for reading and writing (its blocked reads and accepts
    return) without closing the descriptor."""
    if fd < 0:
        return
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (yet or any more)
    finally:
        sock.detach()


class Coordinator:
    """The coordination service of one PS job (see the module docstring)."""

    def __init__(
        self, token: str, world: int, interval_s: float, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.key = token.encode()
        self.world = world
        self.interval_s = interval_s
        self.cond = threading.Condition()
        self.attempt = 0
        self._listener = socket.create_server((host, port))  # port 0: any free one
        self.endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self._conns: set[Connection] = set()
        self._closed = False
        self._reset_state()
        self._thread = threading.Thread(target=self._accept, name="ps-coordinator", daemon=True)
        self._thread.start()

    def _reset_state(self) -> None:
        self.rounds: dict[tuple[str, int], _Round] = {}
        self.done_upto: dict[
            str, int
        ] = {}  # channel -> last seq of its unbroken run of done rounds
        self.positions: dict[int, Any] = {}
        self.joined: set[int] = set()
        self.greeted: set[int] = set()
        """Trainers that said hello in this attempt (this coordinator holds their rounds)."""
        self.left: set[int] = set()  # left the checkpoints (training ended) until a new hello
        self.pollers: dict[int, int] = {}  # rank -> id of its polling connection
        self.dead: set[int] = set()
        self.busy: dict[int, int] = {}  # rank -> id of the connection blocked in a round
        self.epoch = 0
        self.open: _Epoch | None = None
        self.last_cut: float | None = None
        self.retry_epoch = False
        """The last epoch closed with no cut (its members all entered a round first): the next
        opens at once, without waiting another interval."""
        self.last_step = -1
        self._done: _Epoch | None = None
        self.replayed = 0
        """Rounds answered from the record (a restarted trainer's prologue)."""

    # -- the agent's side ------------------------------------------------------------------------
    def reset(self, attempt: int) -> None:
        """A new attempt (every trainer started again): forget every round and member, except
        the completed half-async barriers (``wire.BARRIER_CHANNEL``, numbered by global step):
        trainers resumed at positions on both sides of a barrier pass it again from the record
        instead of waiting for one already past it (``fleet.base.coordination``)."""
        with self.cond:
            self.attempt = attempt
            kept = {
                key: r
                for key, r in self.rounds.items()
                if key[0] == wire.BARRIER_CHANNEL and r.done and not r.error
            }
            self._reset_state()
            self.rounds.update(kept)
            self.cond.notify_all()

    def trainer_died(self, rank: int, position: Any) -> None:
        """Trainer ``rank`` died and is being restarted alone: checkpoints go on without it, with
        ``position`` (where it resumes) as its state; rounds wait for its successor."""
        with self.cond:
            self.dead.add(rank)
            self.joined.discard(rank)
            self.busy.pop(rank, None)
            if position is not None:
                self.positions[rank] = position
            self._check_close()
            self.cond.notify_all()

    def close(self) -> None:
        """Stop listening and end every connection: each is shut down here and closed by its own
        thread. A descriptor closed under a thread that is about to read it can be handed to the
        next socket this process opens, whose bytes that thread would then take."""
        with self.cond:
            self._closed = True
            for c in self._conns:
                _shut_down(c.fileno())
            self.cond.notify_all()
        _shut_down(self._listener.fileno())  # wakes the accept thread
        try:
            self._listener.close()
        except OSError:
            pass

    # -- connections -----------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(sock,), name="ps-coordinator-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(sock.detach())
        with self.cond:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            wire.authenticate_server_side(conn, self.key)
            while not self._closed:
                header, payloads = wire.recv(conn)
                reply, out = self._handle(header, payloads, id(conn))
                wire.send(conn, reply, out)
        except (EOFError, OSError, ValueError) as err:
            logger.debug("coordinator connection ended: %s", err)
        except Exception as err:  # noqa: BLE001 - one bad client must not stop the service
            logger.warning("coordinator connection failed: %s: %s", type(err).__name__, err)
        finally:
            with self.cond:  # closed by this thread only, under the lock close() shuts it under
                self._conns.discard(conn)
                conn.close()
                for rank, cid in list(self.pollers.items()):
                    if cid == id(conn):  # its process ended: it takes part in no more cuts
                        del self.pollers[rank]
                        self.joined.discard(rank)
                        self._check_close()
                        self.cond.notify_all()

    def _handle(
        self, h: dict[str, Any], payloads: list[bytes], cid: int
    ) -> tuple[dict[str, Any], list[bytes]]:
        op = h.get("op")
        rank = int(h.get("rank", -1))
        if not 0 <= rank < self.world:
            return {
                "ok": False,
                "error": f"rank {rank} is not a trainer of this job (0..{self.world - 1})",
            }, []
        with self.cond:
            if "position" in h and h["position"] is not None:
                self.positions[rank] = h["position"]
            if op == "hello":
                return self._hello(rank, h), []
            if int(h.get("attempt", self.attempt)) != self.attempt:
                return {
                    "ok": False,
                    "error": f"attempt {h.get('attempt')} is over (now {self.attempt})",
                }, []
            if op == "round":
                return self._round(
                    rank,
                    str(h["channel"]),
                    int(h["seq"]),
                    str(h["kind"]),
                    payloads[0] if payloads else b"",
                    cid,
                )
            if op == "ckpt_wait":
                return self._ckpt_wait(rank, int(h.get("after", 0)), cid), []
            if op == "ckpt_cut":
                return self._ckpt_cut(rank, int(h["epoch"]), h.get("position")), []
            if op == "ckpt_done":
                return self._ckpt_done(rank, int(h["epoch"]), h.get("outcome")), []
            if op == "ckpt_result":
                return self._ckpt_result(int(h["epoch"])), []
            if op == "restart_alone":
                return self._restart_alone(rank, h.get("position")), []
            if op == "ckpt_leave":
                self.joined.discard(rank)
                self.left.add(rank)
                self._check_close()
                self.cond.notify_all()
                return {"ok": True}, []
        return {"ok": False, "error": f"unknown coordination op {op!r}"}, []

    def _hello(self, rank: int, h: dict[str, Any]) -> dict[str, Any]:
        if int(h.get("world", -1)) != self.world:
            return {
                "ok": False,
                "error": f"trainer {rank} says the job has {h.get('world')} trainers, "
                f"the coordinator {self.world}",
            }
        if int(h.get("attempt", -1)) != self.attempt:
            return {
                "ok": False,
                "error": f"trainer {rank} of attempt {h.get('attempt')} is stale: the "
                f"job is at attempt {self.attempt}",
            }
        self.dead.discard(rank)
        self.left.discard(rank)
        self.greeted.add(rank)
        return {"ok": True, "epoch": self.epoch, "last_step": self.last_step}

    def _restart_alone(self, rank: int, position: Any) -> dict[str, Any]:
        """A Kubernetes trainer pod asks before it restarts its dead trainer alone: granted when
        this coordinator holds that trainer's rounds of this attempt (it is not itself a restart
        that lost them); then as :meth:`trainer_died`."""
        if rank not in self.greeted:
            return {
                "ok": True,
                "granted": False,
                "why": (
                    f"the coordinator has no record of trainer {rank} in attempt {self.attempt} "
                    "(it was restarted, and a restart loses the rounds)"
                ),
            }
        self.trainer_died(rank, position)
        return {"ok": True, "granted": True}

    # -- rounds ----------------------------------------------------------------------------------
    def _round(
        self, rank: int, channel: str, seq: int, kind: str, payload: bytes, cid: int
    ) -> tuple[dict[str, Any], list[bytes]]:
        r = self.rounds.get((channel, seq))
        if r is not None and r.done and not r.error:
            if r.kind != kind:
                return {
                    "ok": False,
                    "error": (
                        f"trainer {rank} replays round {seq} of {channel!r} as {kind} but the other "
                        f"trainers ran it as {r.kind}: after a restart the script must make the same "
                        "cross-trainer calls in the same order"
                    ),
                }, []
            self.replayed += 1
            ranks = sorted(r.contribs)
            return (
                {
                    "ok": True,
                    "replayed": True,
                    "ranks": ranks,
                    "done_upto": self._done_upto(channel),
                },
                [r.contribs[k] for k in ranks],
            )
        if r is None:
            r = self.rounds[(channel, seq)] = _Round(kind)
        elif r.kind != kind and not r.done:
            r.error = (
                f"round {seq} of {channel!r}: trainer {rank} calls {kind}, the others "
                f"{r.kind}: every trainer must make the same cross-trainer calls in the same order"
            )
            r.done = True
        r.contribs[rank] = payload  # a restarted trainer's contribution replaces its predecessor's
        self.busy[rank] = cid
        self._check_close()
        if len(r.contribs) == self.world:
            r.done = True
        self.cond.notify_all()
        while not r.done and not self._closed:
            self.cond.wait(1.0)
        if self.busy.get(rank) == cid:
            del self.busy[rank]
        if r.error or self._closed:
            return {"ok": False, "error": r.error or "the coordinator closed"}, []
        ranks = sorted(r.contribs)
        return (
            {"ok": True, "replayed": False, "ranks": ranks, "done_upto": self._done_upto(channel)},
            [r.contribs[k] for k in ranks],
        )

    def _done_upto(self, channel: str) -> int:
        """The last round of ``channel`` up to which every round completed (-1: none): a trainer
        whose next round is at or below it is replaying what its predecessor did."""
        n = self.done_upto.get(channel, -1)
        while (r := self.rounds.get((channel, n + 1))) is not None and r.done and not r.error:
            n += 1
        self.done_upto[channel] = n
        return n

    # -- checkpoint epochs -----------------------------------------------------------------------
    def _maybe_open(self) -> None:
        now = time.monotonic()
        if self.open is not None or self.last_cut is None:
            return
        if not self.retry_epoch and now - self.last_cut < self.interval_s:
            return
        members = self.joined - self.dead - set(self.busy)
        if members:
            self.retry_epoch = False
            self.epoch += 1
            self.open = _Epoch(self.epoch, members, now)
            self.cond.notify_all()

    def _check_close(self) -> None:
        ep = self.open
        if ep is None or ep.closed:
            return
        still = (ep.required & self.joined) - self.dead - set(self.busy)
        if not still <= set(ep.cut) and time.monotonic() - ep.opened < wire.CUT_WAIT_S:
            return
        ep.closed = True
        ep.positions = {r: self.positions.get(r) for r in range(self.world)}
        ep.positions.update(ep.cut)
        ep.leader = min(ep.cut) if ep.cut else None
        if ep.leader is None:  # nobody cut (each member entered a round first, e.g. a half-async
            self.open, self.retry_epoch = None, True  # barrier): nothing to snapshot; retry now
        self.cond.notify_all()

    def _ckpt_wait(self, rank: int, after: int, cid: int) -> dict[str, Any]:
        if rank in self.left or rank in self.dead:
            return {"ok": True, "epoch": self.epoch, "cut": False}
        self.pollers[rank] = cid
        if rank not in self.joined:
            self.joined.add(rank)
            if self.last_cut is None:
                self.last_cut = time.monotonic()  # the interval runs from the first member
        deadline = time.monotonic() + wire.POLL_S
        while not self._closed:
            self._maybe_open()
            ep = self.open
            if ep is not None and ep.number > after and rank in ep.required and not ep.closed:
                return {"ok": True, "epoch": ep.number, "cut": True}
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.cond.wait(left)
        return {"ok": True, "epoch": self.epoch, "cut": False}

    def _ckpt_cut(self, rank: int, epoch: int, position: Any) -> dict[str, Any]:
        ep = self.open
        if ep is None or ep.number != epoch or ep.closed or rank not in ep.required:
            return {"ok": True, "taken": False}
        ep.cut[rank] = position
        self._check_close()
        while not ep.closed and not self._closed:
            self.cond.wait(0.5)
            self._check_close()
        if rank not in ep.cut or ep.leader is None:
            return {"ok": True, "taken": False}
        return {
            "ok": True,
            "taken": True,
            "leader": ep.leader,
            "last_step": self.last_step,
            "positions": {str(r): p for r, p in ep.positions.items()},
        }

    def _ckpt_done(self, rank: int, epoch: int, outcome: Any) -> dict[str, Any]:
        ep = self.open
        if ep is not None and ep.number == epoch and ep.leader == rank:
            ep.outcome = list(outcome) if isinstance(outcome, list) else ["error", "no outcome"]
            if (
                ep.outcome[0] == "ok"
                and isinstance(ep.outcome[1], dict)
                and "step" in ep.outcome[1]
            ):
                self.last_step = int(ep.outcome[1]["step"])
            self.open, self.last_cut = None, time.monotonic()
            self._done = ep
            self.cond.notify_all()
        return {"ok": True}

    def _ckpt_result(self, epoch: int) -> dict[str, Any]:
        while not self._closed:
            ep = self.open
            if ep is None or ep.number != epoch:  # finished (or never opened)
                done = self._done
                if done is not None and done.number == epoch and done.outcome is not None:
                    return {"ok": True, "outcome": done.outcome}
                return {
                    "ok": True,
                    "outcome": ["error", f"checkpoint epoch {epoch} ended without a snapshot"],
                }
            if ep.leader is not None and ep.leader in self.dead:
                self.open, self.last_cut = None, time.monotonic()
                return {
                    "ok": True,
                    "outcome": ["error", f"trainer {ep.leader} died while taking the snapshot"],
                }
            self.cond.wait(0.5)
        return {"ok": False, "error": "the coordinator closed"}


__all__ = ["Coordinator"]
