"""Ray scheduler: ``fleetrun --scheduler ray`` runs a collective or PS job on a Ray cluster.

What runs where:

* **driver** (this fleetrun process): joins ``ray.address`` or starts a local cluster on
  127.0.0.1 (:mod:`launcher.schedulers.ray.cluster`); per attempt, one placement group with a
  bundle per trainer and per PS server (``resources.trainer/server``, ``ray.placement_strategy``)
  and one :class:`~launcher.schedulers.ray.actor.ProcessActor` per bundle; builds every process's
  env with ``collective.env`` from where the actors landed (:mod:`launcher.schedulers.ray.plan`;
  MASTER_ADDR = rank 0's node IP, ports found free on each actor's node); long-polls every actor
  for output, writes ``log_dir/workerlog.N`` / ``serverlog.N`` and the console (``tee``), and
  decides the attempt's outcome with the same rules as the local scheduler
  (:mod:`launcher.attempt`).
* **actors** (on the cluster's nodes): each runs the user's command as a child process (through
  ``collective.bootstrap``, so a traceback lands in the error file, which the actor sends back).

Metrics and watcher files, as the local scheduler (:class:`launcher.telemetry.JobMonitor`, one
code path): every trainer/server gets FLEET_METRICS_PORT/HOST — a port its actor found free on
its node, bound to that node's IP (127.0.0.1 on a loopback cluster); the driver serves
``fleet_launcher_*`` on its own node IP and keeps ``log_dir/job_state.json`` (every process
with role, rank, node, state, exit, endpoint, log) and ``log_dir/metrics_targets.json`` current
as members start, exit, fail and restart. ``metrics: false`` / ``--no-metrics`` turns the
endpoints off (job_state.json is still written).

Failure of any process (non-zero exit or signal), actor or node ends the attempt: every actor is
stopped (SIGTERM → grace → SIGKILL of the child's process group), killed, and the placement group
removed; with restarts left (``max_restarts``) the whole group starts again, else the
root-cause-first summary (:func:`launcher.summary.format_summary`) is printed and fleetrun exits 1.
Ctrl-C / SIGTERM does the same teardown and also shuts down a local cluster fleetrun started.

A PS job with automatic checkpoints (``ps_checkpoint``) recovers as on the local scheduler
(:mod:`launcher.recovery.ps_policy`): the failure of a server or trainer (its process, its
actor, its node) spends one restart, and every actor is re-created in the job's placement group, which is
kept across the attempts (the same bundles, so the same nodes; each server on its first port, so
on its endpoint); trainer 0 loads the newest good checkpoint and the trainers skip what they had
trained. In async/GEO mode a dead server alone is re-created in its bundle on its port and
restores its own shards while the trainers go on, and a dead trainer alone is re-created in its
bundle and resumes at its data position while the others go on: the driver hosts the trainers'
coordinator (:mod:`launcher.recovery.coordinator`, on its node's IP), as the local agent does
(:mod:`launcher.schedulers.ray.ps_recovery`).
Each recovery goes to the console, ``job_state.json`` (``recoveries``; ``restarts`` counts
in-place ones too), the final summary and ``fleet_ps_recoveries_total``; no checkpoint yet or no
restart left: the job fails as above.

An elastic job (``--nnodes MIN:MAX``) forms each attempt from the actors the cluster can place
and grows when resources return (:mod:`launcher.schedulers.ray.elastic`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import IO, Any

from collective.env import metrics_env
from collective.errors import ConfigError, LaunchError
from launcher.attempt import (
    SERVER,
    TRAINER,
    Decision,
    Interrupted,
    ProcSpec,
    decide,
    install_signal_handlers,
    worker_argv,
    write_endpoints,
)
from launcher.console import StatusConsole
from launcher.job_files import write_job_file, write_strategy
from launcher.process import ConsoleWriter, ExitInfo
from launcher.ps_env import FLEET_PS_CHECKPOINT_ROOT, job_ps_token
from launcher.recovery.ps_policy import make_recovery
from launcher.schedulers.ray import elastic, ps_recovery
from launcher.schedulers.ray.actor import ActorInfo, PollReply, ProcessActor
from launcher.schedulers.ray.cluster import ClusterHandle, connect, disconnect
from launcher.schedulers.ray.plan import AttemptPaths, Placed, Slot, make_proc_specs, make_slots
from launcher.spec import JobSpec, Mode
from launcher.summary import Failure, format_summary, read_error_file
from launcher.telemetry import FailureCause, JobMonitor, JobState, MemberView, cause_of

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""Long-poll period of each actor (output arrives as soon as it is written, not per period)."""
ACTOR_CALL_TIMEOUT_S = 120.0
"""Bound on actor start-up and its small calls (info, ports, start)."""
ACTOR_CONCURRENCY = 4
"""Threads per actor: ``poll`` and ``stop`` run concurrently."""


def run_ray(spec: JobSpec) -> int:
    """Run ``spec`` on a Ray cluster; return fleetrun's exit code."""
    entry = spec.entrypoint
    if (
        entry.script
        and not os.path.exists(entry.script)
        and "working_dir" not in spec.ray.runtime_env
    ):
        raise ConfigError(
            f"script {entry.script!r} not found (working directory {os.getcwd()})",
            key="entrypoint.script",
        )
    slots = make_slots(spec)  # ConfigError before any cluster is touched
    write_job_file(spec)
    strategy_file = write_strategy(spec)
    handle: ClusterHandle | None = None
    install_signal_handlers()  # Ctrl-C during ray.init also tears down what started
    try:
        handle = connect(
            spec.ray, sum(s.bundle["CPU"] for s in slots), spec.ray.runtime_env or None
        )
        install_signal_handlers()  # again: ray.init installs its own SIGTERM handler
        return RayJob(spec, slots, strategy_file).run()
    except (Interrupted, SystemError) as err:
        sig = _interruption(err)
        if sig is None:
            raise
        sys.stderr.write(
            f"fleetrun: got {sig}; stopped every actor and process of job '{spec.name}'\n"
        )
        return 128 + sig.signum
    finally:
        disconnect(handle)


def _interruption(err: BaseException) -> Interrupted | None:
    """The Interrupted behind ``err``: itself, or the cause of the SystemError Ray's Cython
    ``wait``/``get`` raise when our signal handler fires inside them."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, Interrupted):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@dataclass
class _Member:
    """One process of a running attempt, as the driver sees it."""

    actor: Any
    info: ActorInfo
    proc: ProcSpec
    log: IO[bytes]
    pid: int = 0
    reply: PollReply | None = None
    """The final poll reply (set once the process exited)."""
    failure: Failure | None = None
    torn_down: bool = False
    """The attempt's teardown ran (a member with no reply by then is gone, exit unknown)."""

    def view(self) -> MemberView:
        """What :class:`~launcher.telemetry.JobMonitor` records of this member."""
        exit_info = ExitInfo(self.reply.returncode, self.reply.exit_time) if self.reply else None
        gone = self.reply is None and (self.failure is not None or self.torn_down)
        ip = self.info.node_ip
        return MemberView(
            self.proc.role,
            self.proc.rank,
            self.proc.log_path,
            self.proc.metrics_port,
            self.pid or None,
            exit_info,
            ip,
            ip,
            gone,
        )


@dataclass
class _Group:
    """Placement group + actors of one attempt."""

    pg: Any
    actors: list[Any] = field(default_factory=list)
    members: list[_Member] = field(default_factory=list)


class RayJob:
    """All attempts of one job on the connected cluster; :meth:`run` returns the exit code."""

    def __init__(self, spec: JobSpec, slots: list[Slot], strategy_file: str | None) -> None:
        import ray

        self.ray = ray
        self.spec, self.slots, self.strategy_file = spec, slots, strategy_file
        self.run_id = spec.run_id or uuid.uuid4().hex[:12]
        self.log_dir = os.path.abspath(spec.log_dir)
        self.console = ConsoleWriter()
        self.actor_cls = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(ProcessActor)
        self.argv = worker_argv(spec)
        cwd_given = "working_dir" in spec.ray.runtime_env
        self.cwd = None if cwd_given else os.getcwd()
        self.ps_token = job_ps_token(spec) if spec.mode is Mode.PS else ""
        self.recovery = make_recovery(spec)
        """PS job with automatic checkpoints: a failed attempt is recovered as locally (every
        actor re-created in the same placement group, servers on their node and port)."""
        self.kept_pg: Any = None
        """The placement group kept across the attempts of a recovered PS job."""
        self.server_ports: dict[int, int] = {}
        """Server index -> its port (a recovered server comes back on its endpoint)."""
        self.restarts = 0
        """Restarts spent: failed attempts restarted, and servers restarted alone in place."""
        self.elastic = spec.elastic.enabled
        self.probe: tuple[Any, Any] | None = None
        """An elastic round's growth probe (elastic.arm_growth_probe)."""
        self.grow = False
        """The growth probe was placed: the round ends and the next forms bigger."""
        if self.elastic and not spec.elastic.standalone:
            logger.info(
                "elastic job on Ray: the driver forms each round from the actors it "
                "places; --rdzv_backend/--rdzv_endpoint are not used"
            )

    def run(self) -> int:
        """Run all attempts; return fleetrun's exit code (keeps ``job_state.json`` current)."""
        spec = self.spec
        host = self.ray.util.get_node_ip_address()  # the driver's node: serves fleet_launcher_*
        monitor = JobMonitor(
            spec.name,
            self.run_id,
            spec.max_restarts,
            self.log_dir,
            host,
            metrics=spec.metrics,
            metrics_host=host,
            view=_Member.view,
        )
        self.monitor = monitor
        if self.recovery is not None and not self.elastic:  # async/GEO trainers meet through it
            self.recovery.start_coordinator(self.ps_token, host)  # and one can restart alone;
            # the driver outlives every actor, and its node's IP is what the actors reach
        status = StatusConsole(monitor)  # the same live status line as a local job
        status.start()
        try:
            return self._run(monitor)
        except BaseException as err:
            sig = _interruption(err)
            if sig is not None:
                monitor.finished(
                    JobState.STOPPED, f"fleetrun got {sig}; every actor and process was stopped"
                )
            else:
                monitor.finished(JobState.FAILED, f"fleetrun failed: {err}")
            raise
        finally:
            status.stop()
            monitor.close()
            if self.recovery is not None:
                self.recovery.close()  # the coordinator
            if self.kept_pg is not None:
                _remove_pg(self.kept_pg)

    def _run(self, monitor: JobMonitor) -> int:
        spec = self.spec
        history: list[str] = []
        attempt = 0  # every round of an elastic job; self.restarts: failures (in place too)
        world = 0  # elastic: the previous round's world size, and why that round ended
        change: tuple[str, list[str]] = ("", [])
        while True:
            group = _Group(pg=None)
            failures: list[Failure] = []
            stopped: list[tuple[str, int]] = []
            self.grow = False
            try:
                self._start(group, attempt)
                monitor.attempt_started(attempt, group.members)
                if self.elastic:
                    world = self._membership(monitor, attempt, world, len(group.members), change)
                    self.probe = elastic.arm_growth_probe(
                        self.ray,
                        spec,
                        self.run_id,
                        attempt,
                        len(group.members) // spec.sizes.nproc_per_node,
                    )
                failures = self._watch(group, attempt)
                stopped = [
                    (m.proc.role, m.proc.rank)
                    for m in group.members
                    if m.reply is None and m.failure is None and m.proc.role == TRAINER
                ]
            finally:
                elastic.disarm_growth_probe(self.probe)
                self.probe = None
                self._teardown(group)
            if self.grow and not failures:  # resources returned: re-form bigger, no restart spent
                attempt += 1
                change = ("join", [])
                continue
            failed_ids = [(f.role, f.rank) for f in failures]
            change = ("failure", [f"{_label(f)} ({f.exit_desc})" for f in failures])
            monitor.attempt_failed(
                [
                    FailureCause.NODE
                    if f.exit_desc.startswith("Ray actor died")
                    else cause_of(f.exit_desc)
                    for f in failures
                ]
            )
            decision = decide(bool(failures), self.restarts, spec.max_restarts)
            no_recovery = ""
            if self.recovery is not None and failures and decision is not Decision.SUCCEED:
                first = min(failures, key=lambda f: f.time)
                got = self.recovery.recover(
                    attempt,
                    f"{_label(first)} {first.exit_desc}",
                    first.role,
                    decision is Decision.RESTART,
                )
                if isinstance(got, str):
                    decision, no_recovery = Decision.FAIL, got
                else:
                    monitor.recovered(first.role, got.text())
                    logger.warning("%s", got.text())
            recovered = self.recovery.finish(attempt) if self.recovery is not None else ""
            if decision is Decision.SUCCEED:
                logger.info(
                    "job '%s' succeeded on Ray (%d restart(s) used)", spec.name, self.restarts
                )
                if recovered:
                    sys.stderr.write(f"fleetrun: job '{spec.name}' succeeded; {recovered}\n")
                monitor.finished(JobState.SUCCEEDED)
                return 0
            what = ", ".join(
                f"{_label(f)} {f.exit_desc}" for f in sorted(failures, key=lambda f: f.time)
            )
            history.append(f"attempt {attempt}: {what}")
            if decision is Decision.RESTART:
                attempt, self.restarts = attempt + 1, self.restarts + 1
                monitor.restarting(self.restarts)
                monitor.refresh(failed_ids)
                logger.warning(
                    "attempt %d failed (%s); restarting the whole group (restart %d of %d)",
                    attempt - 1,
                    what,
                    self.restarts,
                    spec.max_restarts,
                )
                continue
            note = "Earlier attempts: " + "; ".join(history[:-1]) if len(history) > 1 else ""
            if monitor.membership_changes:
                note = "; ".join(
                    [note, "Membership changes: " + "; ".join(monitor.membership_changes)]
                ).lstrip("; ")
            text = format_summary(
                spec.name, failures, stopped, spec.log_dir, self.restarts, spec.max_restarts, note
            )
            text += "".join(f"\n{t}" for t in (no_recovery, recovered) if t)
            monitor.finished(JobState.FAILED, text, failed_ids)
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            return 1

    def _membership(
        self, monitor: JobMonitor, attempt: int, old: int, new: int, change: tuple[str, list[str]]
    ) -> int:
        """Record an elastic round whose world size differs from the previous round's."""
        if attempt and old != new:
            cause, left = change
            text = elastic.change_text(attempt, cause, left, old, new)
            monitor.membership_changed(cause, text)
            logger.warning("membership change: %s", text)
        return new

    # -- one attempt ---------------------------------------------------------------------------
    def _start(self, group: _Group, attempt: int) -> None:
        """Placement group, actors, env, processes (filling ``group`` as it goes, for teardown)."""
        ray, spec = self.ray, self.spec
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.elastic:  # as many nodes as the cluster places now, MAX down to MIN
            group.pg, self.slots = elastic.place_round(ray, spec, self.run_id, attempt)
        elif self.kept_pg is not None:  # a recovery: the same bundles, so the same nodes
            group.pg = self.kept_pg
        else:
            group.pg = placement_group(
                [s.bundle for s in self.slots],
                strategy=str(spec.ray.placement_strategy),
                name=f"fleetrun-{spec.name}-{self.run_id}-{attempt}",
            )
        if self.recovery is not None:
            self.kept_pg = group.pg
        bundles = [s.bundle for s in self.slots]
        ready, _ = ray.wait([group.pg.ready()], timeout=spec.ray.placement_timeout_s)
        if not ready:
            raise LaunchError(
                f"the Ray cluster could not place the job's {len(bundles)} bundles "
                f"({_bundles_text(bundles)}, strategy {spec.ray.placement_strategy}) within "
                f"{spec.ray.placement_timeout_s:g} s; available: {_resources_text(ray.available_resources())}. "
                "Lower resources.trainer/server, add nodes, or pick another ray.placement_strategy"
            )
        for i, slot in enumerate(self.slots):
            b = slot.bundle
            group.actors.append(
                self.actor_cls.options(
                    num_cpus=b["CPU"],
                    num_gpus=b.get("GPU", 0),
                    memory=b["memory"],
                    max_restarts=0,
                    name=f"fleetrun-{self.run_id}-{attempt}-{slot.role}-{slot.index}",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group.pg, placement_group_bundle_index=i
                    ),
                ).remote()
            )
        infos: list[ActorInfo] = self._get(
            [a.info.remote() for a in group.actors], "start the actors"
        )
        # per actor, on its node: its endpoint port, its /metrics port (metrics on), and for
        # actor 0 of a collective job the master port (rank 0 is slot 0's trainer: plan.py
        # numbers node by node)
        metrics = self.monitor.metrics_enabled
        collective = spec.mode is Mode.COLLECTIVE
        ports = self._get(
            [
                a.free_ports.remote(info.node_ip, 1 + int(metrics) + int(collective and i == 0))
                for i, (a, info) in enumerate(zip(group.actors, infos, strict=True))
            ],
            "find free ports",
        )
        placed = [
            Placed(slot, info.node_ip, info.node_id, info.gpu_ids, self._port(slot, got[0]))
            for slot, info, got in zip(self.slots, infos, ports, strict=True)
        ]
        master_port = ports[0][-1] if collective else 0
        paths = AttemptPaths(
            self.run_id,
            attempt,
            spec.max_restarts,
            self.log_dir,
            self.strategy_file,
            ps_token=self.ps_token,
            cwd=self.cwd or ".",
        )
        procs, head = make_proc_specs(spec, placed, master_port, paths)
        if (
            self.recovery is not None
        ):  # as the local agent: checkpoints on, the servers may load them
            rec = self.recovery
            rec.begin_attempt(attempt)  # the coordinator forgets the rounds of earlier attempts
            procs = [
                replace(p, env={**p.env, **rec.trainer_env()})
                if p.role == TRAINER
                else replace(
                    p,
                    env={
                        **p.env,
                        FLEET_PS_CHECKPOINT_ROOT: rec.server_roots(
                            p.env.get(FLEET_PS_CHECKPOINT_ROOT, "")
                        ),
                    },
                )
                for p in procs
            ]
        if metrics:  # bound to the node IP the actor runs on
            procs = [
                replace(p, metrics_port=got[1], env={**p.env, **metrics_env(got[1], info.node_ip)})
                for p, got, info in zip(procs, ports, infos, strict=True)
            ]
        servers = [f"{p.env['POD_IP']}:{p.env['PADDLE_PORT']}" for p in procs if p.role == SERVER]
        trainers = next(
            p.env["PADDLE_TRAINER_ENDPOINTS"] for p in procs if p.role == TRAINER
        ).split(",")
        write_endpoints(self.log_dir, attempt, head, servers, tuple(trainers))
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        for actor, info, proc in zip(group.actors, infos, procs, strict=True):
            log = open(proc.log_path, "ab" if attempt else "wb", buffering=0)  # noqa: SIM115 - closed in teardown
            log.write(
                f"==== fleetrun: attempt {attempt}, {proc.label}, {stamp}, ray node {info.node_ip} "
                f"({info.hostname}) ====\n".encode()
            )
            group.members.append(_Member(actor, info, proc, log))
        pids = self._get(
            [
                m.actor.start.remote(self.argv, m.proc.env, self.cwd, sys.executable)
                for m in group.members
            ],
            "start the processes",
        )
        for m, pid in zip(group.members, pids, strict=True):
            m.pid = pid
        logger.info(
            "attempt %d: %d process(es) running on %d Ray node(s) (run_id %s)",
            attempt,
            len(group.members),
            len({i.node_id for i in infos}),
            self.run_id,
        )

    def _port(self, slot: Slot, found: int) -> int:
        """A slot's endpoint port: a server of a recovered job keeps its first one."""
        if self.recovery is None or slot.role != SERVER:
            return found
        return self.server_ports.setdefault(slot.index, found)

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        from ray.exceptions import GetTimeoutError, RayError

        try:
            return list(self.ray.get(refs, timeout=ACTOR_CALL_TIMEOUT_S))
        except GetTimeoutError:
            raise LaunchError(f"Ray did not {what} within {ACTOR_CALL_TIMEOUT_S:g} s") from None
        except RayError as err:
            raise LaunchError(f"could not {what} on Ray: {_first_line(err)}") from None

    def _watch(self, group: _Group, attempt: int) -> list[Failure]:
        """Stream output until the attempt ends; the failures (empty = success)."""
        pending = {m.actor.poll.remote(POLL_S): m for m in group.members}
        server_deadline: float | None = None
        while pending:
            ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=POLL_S * 5)
            for ref in ready:
                m = pending.pop(ref)
                if self._handle_poll(m, ref, attempt):
                    pending[m.actor.poll.remote(POLL_S)] = m
            if ready:
                self.monitor.refresh()
            failures = [m.failure for m in group.members if m.failure is not None]
            if failures:
                member = self._restart_alone(group, failures, attempt)
                if member is None:
                    return failures
                pending[member.actor.poll.remote(POLL_S)] = member
                continue
            if not any(m.reply for m in group.members) and elastic.probe_placed(
                self.ray, self.probe
            ):  # an elastic job can grow (none has finished yet)
                logger.info("resources for one more node are free: re-forming the job bigger")
                self.grow = True
                return []
            trainers_done = all(
                m.reply is not None for m in group.members if m.proc.role == TRAINER
            )
            if trainers_done:
                # as the local scheduler: servers get server_grace_s to stop on their own
                server_deadline = server_deadline or time.monotonic() + self.spec.ps.server_grace_s
                if time.monotonic() >= server_deadline:
                    return []
        return []

    def _restart_alone(
        self, group: _Group, failures: list[Failure], attempt: int
    ) -> _Member | None:
        """A PS job in async/GEO mode whose one failure is a server or a trainer: re-create its
        actor alone in its bundle — a server on its port, restoring its shards; a trainer from
        its data position, meeting the others through the coordinator —
        (:mod:`~launcher.schedulers.ray.ps_recovery`); the others go on. The new member (replacing the dead one), or None: the attempt ends."""
        if self.recovery is None or self.elastic or len(failures) != 1:
            return None
        i = next(i for i, m in enumerate(group.members) if m.failure is failures[0])
        old = group.members[i]
        ctx = ps_recovery.RespawnContext(
            self.ray,
            self.actor_cls,
            group.pg,
            self.run_id,
            self.argv,
            self.spec.entrypoint.no_python,
            self.cwd,
            self.monitor.metrics_enabled,
            self._get,
        )
        respawn = (
            ps_recovery.respawn_trainer if old.proc.role == TRAINER else ps_recovery.respawn_server
        )
        got = respawn(
            ctx,
            self.recovery,
            failures,
            old.actor,
            old.proc,
            i,
            self.slots[i].bundle,
            old.log,
            attempt,
            self.restarts < self.spec.max_restarts,
        )
        if not isinstance(got, ps_recovery.Respawned):
            if got == ps_recovery.PORT_TAKEN:  # the restart-all recovery finds it a new port
                self.server_ports.pop(old.proc.rank, None)
            return None
        member = _Member(got.actor, got.info, got.proc, old.log, got.pid)
        group.members[i] = member
        group.actors.append(got.actor)
        self.restarts += 1
        self.monitor.recovered(old.proc.role, got.recovery.text())
        self.monitor.restarted_in_place(self.restarts)
        self.monitor.attempt_started(attempt, group.members)
        logger.warning("%s", got.recovery.text())
        return member

    def _handle_poll(self, m: _Member, ref: Any, attempt: int) -> bool:
        """Write a poll reply's output; record an exit. True while the process still runs."""
        from ray.exceptions import RayError

        try:
            reply: PollReply = self.ray.get(ref)
        except RayError as err:  # actor or node died
            m.failure = Failure(
                role=m.proc.role,
                rank=m.proc.rank,
                local_rank=m.proc.local_rank,
                node_rank=m.proc.node_rank,
                host=_host(m.info),
                pid=m.info.pid,
                exit_desc=f"Ray actor died ({type(err).__name__})",
                time=time.time(),
                attempt=attempt,
                log_path=m.proc.log_path,
                message=_first_line(err),
            )
            return False
        if reply.output:
            m.log.write(reply.output)
            if m.proc.show:
                for line in reply.output.splitlines(keepends=True):
                    self.console.write(m.proc.prefix, line)
        if reply.returncode is None:
            return True
        m.reply = reply
        if reply.returncode != 0:
            m.failure = self._failure(m, reply, attempt)
        return False

    def _failure(self, m: _Member, reply: PollReply, attempt: int) -> Failure:
        parsed = None
        if reply.error_text is not None:
            os.makedirs(os.path.dirname(m.proc.error_file), exist_ok=True)
            if not _same_file_written(m.proc.error_file, reply.error_text):
                with open(m.proc.error_file, "w", encoding="utf-8") as f:
                    f.write(reply.error_text)
            parsed = read_error_file(m.proc.error_file)
        return Failure(
            role=m.proc.role,
            rank=m.proc.rank,
            local_rank=m.proc.local_rank,
            node_rank=m.proc.node_rank,
            host=_host(m.info),
            pid=reply.pid,
            exit_desc=reply.exit_desc,
            time=reply.exit_time,
            attempt=attempt,
            log_path=m.proc.log_path,
            error_file=m.proc.error_file if parsed else None,
            message=parsed[0] if parsed else "",
            traceback=parsed[1] if parsed else "",
        )

    def _teardown(self, group: _Group) -> None:
        """Stop every process, flush the last output, kill the actors, remove the placement group."""
        ray = self.ray
        from ray.exceptions import RayError

        grace = self.spec.grace_period_s
        alive = [m for m in group.members if m.reply is None and m.failure is None]
        try:
            if group.members:
                # every member, failed ones too: stop() also kills what is left of the child's
                # process group (a dead actor's call just errors)
                stops = [m.actor.stop.remote(grace) for m in group.members]
                ray.wait(stops, num_returns=len(stops), timeout=grace + 10.0)
            if alive:  # the output they wrote while stopping
                finals = {m.actor.poll.remote(0.0): m for m in alive}
                done, _ = ray.wait(list(finals), num_returns=len(finals), timeout=5.0)
                for ref in done:
                    try:
                        reply = ray.get(ref)
                    except RayError:
                        continue
                    finals[ref].log.write(reply.output)
                    if reply.returncode is not None:
                        finals[ref].reply = reply
        finally:
            for m in group.members:
                m.log.close()
                m.torn_down = True
            for actor in group.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except (RayError, ValueError):
                    pass
            if group.pg is not None and group.pg is not self.kept_pg:
                _remove_pg(group.pg)


def _remove_pg(pg: Any) -> None:
    from ray.exceptions import RayError
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except (RayError, ValueError):
        pass


def _label(f: Failure) -> str:
    return f"rank {f.rank}" if f.role == TRAINER else f"{SERVER} {f.rank}"


def _host(info: ActorInfo) -> str:
    return info.hostname if info.hostname == info.node_ip else f"{info.hostname} ({info.node_ip})"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _same_file_written(path: str, text: str) -> bool:
    """True when ``path`` already holds ``text`` (driver and actor on one machine)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() == text
    except OSError:
        return False


def _bundles_text(bundles: list[dict[str, float]]) -> str:
    first = bundles[0]
    each = ", ".join(
        f"{k} {v / 2**20:.0f}Mi" if k == "memory" else f"{k} {v:g}" for k, v in first.items()
    )
    same = all(b == first for b in bundles)
    return f"each {each}" if same else "; ".join(str(b) for b in bundles)


def _resources_text(res: dict[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU", "memory") if k in res]
    return (
        ", ".join(
            f"{k} {res[k] / 2**20:.0f}Mi" if k == "memory" else f"{k} {res[k]:g}" for k in keys
        )
        or "none"
    )


__all__ = ["RayJob", "run_ray"]
