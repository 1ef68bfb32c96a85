"""The elastic agent: one node of a ``--nnodes MIN:MAX`` job, round after round.

torchrun's agent loop (``torch.distributed.elastic.agent.server.SimpleElasticAgent``) over our
process machinery (``launcher.attempt.start_all`` / ``watch``, ``launcher.process.terminate_all``,
the env contract ``collective.env.make_worker_env``)::

    round  = handler.next_rendezvous()       # torch: c10d / etcd / etcd-v2
    nodes  = exchange records in the round's store (ip, ports, fingerprint, master port)
    start this node's workers with torchrun's and Paddle's env for this membership
    watch every monitor_interval_s:
        all workers exit 0                      -> exit barrier, close the rendezvous, exit 0
        a worker fails (a lost peer node too)   -> stop workers; restarts left? re-rendezvous
                                                   (spends one) : close the rendezvous, exit 1
        handler.num_nodes_waiting() > 0 (join)  -> stop workers, re-rendezvous (spends none)
        the rendezvous store is gone            -> stop workers, RendezvousError naming its host

A node lost (its agent, or all its workers) makes the survivors' workers fail (their collective
peers are gone): each survivor spends a restart and re-forms with the nodes left, as torchrun
does. Torch's handler drops a dead node after ``keep_alive_interval * keep_alive_max_attempt``
seconds (5 s with our defaults) and closes a round ``last_call_timeout`` (1 s) after MIN nodes.
Before re-forming, a survivor probes the other members' liveness ports
(:mod:`launcher.elastic.liveness`): a node whose agent process is proven gone (connection
refused) is dropped from torch's state at once (:func:`launcher.elastic.rdzv.drop_dead_nodes`),
and when no other node is left to wait for, the round closes without the last-call wait. A node
that does not answer (a machine powered off) is still left to the heartbeat window.

The c10d store lives in the agent that hosts it (the first one on the endpoint's host): when
that agent dies, the others lose the store and cannot re-form (torch raises
RendezvousConnectionError). We stop the workers and fail with an error naming the lost host;
``--rdzv_backend etcd`` / ``etcd-v2`` keep the state in etcd and survive any agent.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from contextlib import nullcontext
from typing import Any

from collective.env import NodeLayout, find_free_port, make_worker_env, metrics_env
from collective.errors import RendezvousError
from launcher.attempt import (
    TRAINER,
    ProcSpec,
    base_env,
    console_prefix,
    start_all,
    warm_pool,
    watch,
    worker_argv,
)
from launcher.elastic.config import describe_job, job_fingerprint
from launcher.elastic.liveness import LivenessListener, LivenessTracker
from launcher.elastic.membership import Membership, MembershipChange, NodeRecord, diff, exchange
from launcher.elastic.rdzv import (
    alone_in_rendezvous,
    drop_dead_nodes,
    heartbeat_window_s,
    last_call,
    leave_round,
    this_node_key,
)
from launcher.process import ConsoleWriter, terminate_all
from launcher.schedulers.local.agent import monitored
from launcher.spec import JobSpec
from launcher.summary import format_membership, format_summary
from launcher.telemetry import JobMonitor, JobState, cause_of
from launcher.warm import WarmPool

logger = logging.getLogger(__name__)

EXIT_BARRIER_POLL_S = 0.05
STORE_HOST_LINGER_S = 10.0
"""After success, how long the agent hosting the c10d store waits for the others to leave."""
ALONE_LAST_CALL_S = 0.001
"""The last call of a round that follows a loss when every other node is proven dead: there is
nobody to wait for (a node that starts meanwhile joins the next round, as any later node)."""


class JobEndedWhileWaiting(Exception):
    """torch's RendezvousGracefulExitError: this agent waited as a spare (the job had MAX nodes)
    and the job closed its rendezvous meanwhile."""


class ElasticAgent:
    """Runs this node's share of an elastic job to the end; :meth:`run` returns the exit code."""

    def __init__(
        self,
        spec: JobSpec,
        handler: Any,
        *,
        run_id: str,
        node_ip: str,
        where: str,
        hosts_store: bool,
        strategy_file: str | None,
        console: ConsoleWriter | None = None,
    ) -> None:
        self.spec, self.handler, self.run_id = spec, handler, run_id
        self.node_ip, self.where, self.hosts_store = node_ip, where, hosts_store
        self.strategy_file = strategy_file
        self.console = console or ConsoleWriter()
        self.node_id = f"{socket.gethostname()}/{os.getpid()}"
        self.fingerprint, self.job = job_fingerprint(spec), describe_job(spec)
        self.changes: list[MembershipChange] = []
        self.members: Membership | None = None
        self._round_store: Any = None
        self._store_lost: str | None = None
        self._joined_round: int | None = None
        self._group_rank: int | None = None
        self._dropped = False
        self.warm: WarmPool | None = None  # made when the rounds start (warm_start on)
        self.liveness: LivenessListener | None = None  # opened when the rounds start
        self._seen_alive = LivenessTracker()

    # -- rounds -----------------------------------------------------------------------------------
    def _next_round(self, round_no: int) -> Membership:
        from torch.distributed.elastic.rendezvous import api  # lazy: elastic agents only
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousClosedError,
            RendezvousConnectionError,
            RendezvousTimeoutError,
        )
        from torch.distributed.elastic.rendezvous.api import RendezvousError as TorchRendezvousError

        graceful_exit = getattr(api, "RendezvousGracefulExitError", ())  # torch >= 2.5

        e, timeout_s = self.spec.elastic, self.spec.rendezvous.timeout_s
        t0 = time.monotonic()
        alone = False
        if round_no > 0:  # etcd (v1): say we left the old round instead of letting our lease expire
            leave_round(self.handler, e.rdzv_backend, self._group_rank)
            alone = self._drop_proven_dead()
        try:
            with last_call(self.handler, ALONE_LAST_CALL_S) if alone else nullcontext():
                info = self.handler.next_rendezvous()
        except graceful_exit:  # waited beyond MAX nodes; the job ended meanwhile
            raise JobEndedWhileWaiting() from None
        except RendezvousClosedError:
            raise RendezvousError(
                f"the rendezvous {self.run_id!r} at {self.where} is closed: another agent of this "
                "job failed for good (see its summary) or the job already finished. A new job "
                "needs a new --rdzv_id"
            ) from None
        except RendezvousTimeoutError:
            raise RendezvousError(
                f"no round of {e.min_nodes}..{e.max_nodes} node(s) formed at {self.where} within "
                f"{timeout_s:g} s (--rdzv_timeout): fewer than MIN={e.min_nodes} agents joined "
                f"rendezvous {self.run_id!r}. Start more agents with the same --rdzv_id, or lower "
                "MIN in --nnodes MIN:MAX"
            ) from None
        except RendezvousConnectionError as err:
            raise RendezvousError(self._lost_store_text(err)) from None
        except TorchRendezvousError as err:
            raise RendezvousError(
                f"rendezvous {self.run_id!r} at {self.where} failed: {type(err).__name__}: {err}"
            ) from None
        if isinstance(info, tuple):  # torch < 2.4: (store, rank, world_size)
            store, group_rank, group_world_size = info
        else:
            store, group_rank, group_world_size = info.store, info.rank, info.world_size
        self._round_store, self._group_rank = store, group_rank
        joined = self._torch_round()
        self._joined_round = joined[0] if joined else None
        self._dropped = False
        nproc = self.spec.sizes.nproc_per_node
        mine = NodeRecord(
            node_id=self.node_id,
            host=socket.gethostname(),
            ip=self.node_ip,
            nproc=nproc,
            ports=tuple(find_free_port(self.node_ip) for _ in range(nproc)),
            fingerprint=self.fingerprint,
            job=self.job,
            hosts_store=self.hosts_store,
            master_port=find_free_port(self.node_ip) if group_rank == 0 else 0,
            liveness_port=self.liveness.port if self.liveness else 0,
            rdzv_node=this_node_key(self.handler),
        )
        members = exchange(
            store, group_rank, group_world_size, mine, timeout_s, round_no, self.where
        )
        self._seen_alive.check_in_background(members.liveness_targets())
        logger.info(
            "round %d formed in %.2f s: node %d of %d, world size %d (%s)",
            round_no,
            time.monotonic() - t0,
            group_rank,
            group_world_size,
            members.world_size,
            ", ".join(n.node_id for n in members.nodes),
        )
        return members

    def _drop_proven_dead(self) -> bool:
        """Probe the last round's other nodes; drop those whose agent is proven gone from
        torch's rendezvous state. Whether this node is then alone in the rendezvous (nobody
        else to wait for); False when no node was proven dead (today's rules apply)."""
        if self.members is None or not this_node_key(self.handler):  # etcd (v1): no such state
            return False
        t0 = time.monotonic()
        dead = set(self._seen_alive.proven_dead(self.members.liveness_targets()))
        if not dead:
            return False
        keys = [n.rdzv_node for n in self.members.nodes if n.node_id in dead and n.rdzv_node]
        dropped = drop_dead_nodes(self.handler, keys)
        alone = alone_in_rendezvous(self.handler)
        window = heartbeat_window_s(self.handler)
        s = f" ({window:g} s)" if window is not None else ""
        logger.warning(
            "node(s) %s gone (their agent's liveness port refused a connection, %.2f s): %s%s",
            ", ".join(sorted(dead)),
            time.monotonic() - t0,
            f"dropped from the rendezvous without waiting for the heartbeat window{s}"
            if dropped
            else "left to torch's rendezvous (not in its state any more, or its store did "
            "not answer)",
            "; no other node left, the round closes without the last call" if alone else "",
        )
        return alone

    def _lost_store_text(self, err: BaseException) -> str:
        if self.members is None:
            return (
                f"lost the c10d rendezvous store at {self.where} before this agent joined a "
                f"round: the agent hosting it exited ({err}). The job may have ended while "
                f"this agent waited (it waits as a spare when the job already has MAX="
                f"{self.spec.elastic.max_nodes} nodes); --rdzv_backend etcd keeps the "
                "rendezvous beyond any agent"
            )
        host = self.members.store_host() if self.members else None
        who = (
            f"hosted by the agent {host}"
            if host and host != self.node_id
            else "hosted by the first agent on the endpoint's host"
        )
        return (
            f"lost the c10d rendezvous store at {self.where} ({who}): {err}"
            f"{f' ({err.__cause__})' if err.__cause__ else ''}. With --rdzv_backend c10d the "
            "store lives in that agent, so the job cannot re-form without it; use "
            "--rdzv_backend etcd (or etcd-v2) with scripts/etcd.sh for a rendezvous that "
            "outlives any agent"
        )

    def _torch_round(self) -> tuple[int, bool] | None:
        """(torch's round number, whether this node is a participant) from the dynamic
        handler's last synced state; None for the etcd (v1) handler, which has no such state."""
        holder = getattr(self.handler, "_state_holder", None)
        node = getattr(self.handler, "_this_node", None)
        if holder is None or node is None:
            return None
        state = holder.state
        return int(state.round), node in state.participants

    def _remote_check(self) -> str | None:
        """Every monitor interval: nodes waiting to join end the round (torchrun's rule), and so
        does finding this node dropped from its round (torch's sanitizer removes a node whose
        heartbeats came late, e.g. on an overloaded machine, without telling it: the others may
        already have re-formed without us, so we stop and join the next round)."""
        try:
            waiting = int(self.handler.num_nodes_waiting())
        except Exception as err:  # torch's RendezvousConnectionError and friends
            self._store_lost = self._lost_store_text(err)
            return self._store_lost
        if waiting:
            return f"{waiting} node(s) waiting to join"
        now = self._torch_round()
        if now is not None and self._joined_round is not None and now != (self._joined_round, True):
            self._dropped = True
            return "this node was dropped from its round (late heartbeats); joining the next one"
        return None

    # -- workers ----------------------------------------------------------------------------------
    def _specs(
        self, members: Membership, restarts: int, round_no: int, monitor: JobMonitor
    ) -> list[ProcSpec]:
        spec, me, master = self.spec, members.me, members.nodes[0]
        log_dir = spec.log_dir
        layout = NodeLayout(
            run_id=self.run_id,
            num_nodes=members.group_world_size,
            nproc_per_node=me.nproc,
            node_rank=members.group_rank,
            master_addr=master.ip,
            master_port=master.master_port,
            trainer_endpoints=members.endpoints(),
            node_ip=me.ip,
            restart_count=restarts,
            max_restarts=spec.max_restarts,
            backend=spec.backend,
            log_dir=log_dir,
            error_dir=os.path.join(log_dir, "errors", f"round{round_no}"),
            job_name=spec.name,
            strategy_file=self.strategy_file,
        )
        base = base_env(spec, me.nproc)
        out = []
        for local_rank in range(me.nproc):
            rank = layout.global_rank(local_rank)
            show, prefix = console_prefix(spec, TRAINER, rank)
            env = {**base, **make_worker_env(layout, local_rank)}
            port = monitor.metrics_port()
            if port:
                env.update(metrics_env(port, monitor.metrics_host))
            out.append(
                ProcSpec(
                    TRAINER,
                    rank,
                    local_rank,
                    layout.node_rank,
                    env,
                    os.path.join(log_dir, f"workerlog.{rank}"),
                    layout.error_file(local_rank),
                    show,
                    prefix,
                    metrics_port=port,
                )
            )
        return out

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Run rounds until the job succeeds or fails; return fleetrun's exit code."""
        spec = self.spec
        local = self.node_ip.startswith("127.")
        monitor = JobMonitor(
            spec.name,
            self.run_id,
            spec.max_restarts,
            spec.log_dir,
            self.node_ip,
            0,
            metrics=spec.metrics,
            metrics_host="127.0.0.1" if local else self.node_ip,
        )
        # leaving by a signal keeps the rendezvous open (as torchrun)
        with monitored(monitor, "this node's processes were stopped"):
            try:
                return self._run(monitor)
            except JobEndedWhileWaiting:
                logger.info(
                    "job '%s' ended while this agent waited to join (it already had %d "
                    "node(s), the maximum); nothing ran here",
                    spec.name,
                    spec.elastic.max_nodes,
                )
                monitor.finished(JobState.SUCCEEDED)
                return 0
            finally:
                if self.warm is not None:
                    self.warm.close()
                if self.liveness is not None:
                    self.liveness.close()

    def _record(self, change: MembershipChange | None, monitor: JobMonitor) -> None:
        if change is None:
            return
        self.changes.append(change)
        monitor.membership_changed(change.cause, change.text())
        logger.warning("membership: %s", change.text())

    def _run(self, monitor: JobMonitor) -> int:
        spec = self.spec
        argv = worker_argv(spec)
        restarts, round_no, cause = 0, 0, "start"
        history: list[str] = []
        self.liveness = LivenessListener(self.node_ip)
        # the warm process imports while the first rendezvous round gathers the nodes
        nproc = spec.sizes.nproc_per_node
        self.warm = warm_pool(spec, base_env(spec, nproc), f"agent{os.getpid()}", nproc)
        while True:
            members = self._next_round(round_no)
            self._record(diff(self.members, members, cause), monitor)
            self.members = members
            running = start_all(
                self._specs(members, restarts, round_no, monitor),
                argv,
                round_no,
                self.console,
                self.warm,
            )
            monitor.attempt_started(round_no, running)
            stopped: list[tuple[str, int]] = []
            try:
                failures, remote = watch(
                    running,
                    round_no,
                    spec.elastic.monitor_interval_s,
                    self._remote_check,
                    0.0,
                    monitor.refresh,
                )
                stopped = [(r.spec.role, r.spec.rank) for r in running if r.proc.exit is None]
            finally:
                terminate_all([r.proc for r in running], spec.grace_period_s)
            round_no += 1
            if self._store_lost:
                raise RendezvousError(self._store_lost)
            if not failures and remote is None:
                self._exit_barrier(members)
                logger.info(
                    "job '%s' succeeded (%d restart(s) used, %d membership change(s))%s",
                    spec.name,
                    restarts,
                    len(self.changes),
                    "\n" + format_membership(self.changes) if self.changes else "",
                )
                monitor.finished(JobState.SUCCEEDED)
                return 0
            if not failures:  # a node waits to join (or we were dropped): re-form, no restart spent
                cause = "rejoin" if self._dropped else "join"
                logger.info(
                    "round %d: %s; stopping this node's workers to re-form", round_no - 1, remote
                )
                continue
            monitor.attempt_failed([cause_of(f.exit_desc) for f in failures])
            what = ", ".join(
                f"rank {f.rank} {f.exit_desc}" for f in sorted(failures, key=lambda f: f.time)
            )
            history.append(f"round {round_no - 1}: {what}")
            if restarts < spec.max_restarts:
                restarts += 1
                cause = "failure"
                monitor.restarting(restarts)
                monitor.refresh([(f.role, f.rank) for f in failures])
                logger.warning(
                    "round %d failed (%s); re-forming with the nodes left (restart %d of %d)",
                    round_no - 1,
                    what,
                    restarts,
                    spec.max_restarts,
                )
                continue
            self._close()
            note = "\n".join(
                filter(
                    None,
                    [
                        "Earlier rounds: " + "; ".join(history[:-1]) if len(history) > 1 else "",
                        format_membership(self.changes),
                    ],
                )
            )
            text = (
                format_summary(
                    spec.name, failures, stopped, spec.log_dir, restarts, spec.max_restarts, note
                )
                + "\n"
            )
            monitor.finished(
                JobState.FAILED, text.rstrip("\n"), [(f.role, f.rank) for f in failures]
            )
            sys.stderr.write(text)
            sys.stderr.flush()
            return 1

    def _close(self) -> None:
        """Close the rendezvous (the job failed for good): the other agents stop too."""
        try:
            self.handler.set_closed()
        except Exception as err:  # the store may be gone already
            logger.debug("could not close the rendezvous: %s", err)

    def _exit_barrier(self, members: Membership) -> None:
        """Wait until every node of the round succeeded, then close the rendezvous; the agent
        hosting the c10d store stays until the others have read it (bounded)."""
        store, n = self._round_store, members.group_world_size
        deadline = time.monotonic() + self.spec.rendezvous.timeout_s
        try:
            store.add("fleet/finished", 1)
            while int(store.add("fleet/finished", 0)) < n:
                if time.monotonic() > deadline or self.handler.num_nodes_waiting() > 0:
                    logger.warning(
                        "not every node of round %d finished; leaving anyway (this "
                        "node's workers succeeded)",
                        members.round,
                    )
                    break
                time.sleep(EXIT_BARRIER_POLL_S)
            self.handler.shutdown()
            store.add("fleet/left", 1)
            linger = time.monotonic() + STORE_HOST_LINGER_S
            while (
                self.hosts_store
                and int(store.add("fleet/left", 0)) < n
                and time.monotonic() < linger
            ):
                time.sleep(EXIT_BARRIER_POLL_S)
        except Exception as err:  # the store host left first: our workers succeeded all the same
            logger.debug("exit barrier: %s", err)
