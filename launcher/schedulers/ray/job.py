"""Ray scheduler: ``fleetrun --scheduler ray`` runs a collective or PS job on a Ray cluster.

This module owns :func:`run_ray` (connect to the cluster, signals, the exit code) and
:class:`RayJob` (the attempt loop: each attempt is started by :mod:`~launcher.schedulers.ray.start`
and watched and torn down by :mod:`~launcher.schedulers.ray.watch`; here its outcome is decided:
succeed, restart, recover or fail, with the job's state and summary).

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
import uuid
from typing import Any

from collective.errors import ConfigError
from launcher.attempt import (
    TRAINER,
    Decision,
    Interrupted,
    decide,
    install_signal_handlers,
    worker_argv,
)
from launcher.console import StatusConsole
from launcher.job_files import write_job_file, write_strategy
from launcher.process import ConsoleWriter
from launcher.ps_env import job_ps_token
from launcher.recovery.ps_policy import make_recovery
from launcher.schedulers.ray import elastic
from launcher.schedulers.ray.actor import ProcessActor
from launcher.schedulers.ray.cluster import ClusterHandle, connect, disconnect
from launcher.schedulers.ray.members import Group, Member, remove_pg
from launcher.schedulers.ray.plan import Slot, make_slots
from launcher.schedulers.ray.start import start_attempt
from launcher.schedulers.ray.watch import teardown_attempt, watch_attempt
from launcher.spec import JobSpec, Mode
from launcher.summary import Failure, format_summary, role_label, root_first
from launcher.telemetry import FailureCause, JobMonitor, JobState, cause_of

logger = logging.getLogger(__name__)

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
            view=Member.view,
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
                remove_pg(self.kept_pg)

    def _run(self, monitor: JobMonitor) -> int:
        spec = self.spec
        history: list[str] = []
        attempt = 0  # every round of an elastic job; self.restarts: failures (in place too)
        world = 0  # elastic: the previous round's world size, and why that round ended
        change: tuple[str, list[str]] = ("", [])
        while True:
            group = Group(pg=None)
            failures: list[Failure] = []
            stopped: list[tuple[str, int]] = []
            self.grow = False
            try:
                start_attempt(self, group, attempt)
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
                failures = watch_attempt(self, group, attempt)
                stopped = [
                    (m.proc.role, m.proc.rank)
                    for m in group.members
                    if m.reply is None and m.failure is None and m.proc.role == TRAINER
                ]
            finally:
                elastic.disarm_growth_probe(self.probe)
                self.probe = None
                teardown_attempt(self, group)
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
                first = root_first(failures)[0]
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


def _label(f: Failure) -> str:
    return role_label(f.role, f.rank)


__all__ = ["RayJob", "run_ray"]
