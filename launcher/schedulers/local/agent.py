"""The node agent: start this node's processes, watch them, restart or fail — both job modes.

An explicit loop over attempts (0 = first run, then one per restart)::

    specs   = plan.specs(attempt)   # collective: trainers (+ rendezvous on several nodes)
                                    # ps: servers + trainers from the endpoint lists
    running = start them with the env contract
    outcome = wait until all trainers succeed, one process fails, another node fails, or a signal
    teardown (always): SIGTERM → grace → SIGKILL, reap, kill stray descendants
    success → exit 0;  failure and budget left → next attempt;  else → summary, exit 1

The decision after a failure is :func:`~launcher.attempt.decide` (plain data in, plain data
out), unit-tested without processes.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import replace

from collective.env import metrics_env
from collective.errors import LaunchError, RendezvousError
from launcher.attempt import (
    PEER_REPORT_WAIT_S,
    SEEN_WAIT_S,
    SERVER,
    TRAINER,
    Decision,
    Interrupted,
    ProcSpec,
    Running,
    decide,
    start_all,
    warm_pool,
    watch,
    worker_argv,
)
from launcher.console import StatusConsole
from launcher.process import ConsoleWriter, WorkerProcess, terminate_all
from launcher.schedulers.local.plan import CollectivePlan, Placement, Plan
from launcher.spec import JobSpec
from launcher.summary import Failure, format_summary, lost_a_peer, role_label, root_first
from launcher.telemetry import FailureCause, JobMonitor, JobState, cause_of
from launcher.warm import WarmPool

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def monitored(monitor: JobMonitor, stopped: str) -> Iterator[None]:
    """The console status line and the job's final state around an agent's run: ``stopped``
    (what happened to this node's processes) when fleetrun got a signal, the rendezvous or any
    other error as FAILED; the monitor is closed however the run ends."""
    status = StatusConsole(monitor)
    status.start()
    try:
        yield
    except Interrupted as sig:
        monitor.finished(JobState.STOPPED, f"fleetrun got {sig}; {stopped}")
        raise
    except RendezvousError as err:
        monitor.attempt_failed([FailureCause.RENDEZVOUS])
        monitor.finished(JobState.FAILED, f"rendezvous failed: {err}")
        raise
    except BaseException as err:
        monitor.finished(JobState.FAILED, f"fleetrun failed: {err}")
        raise
    finally:
        status.stop()
        monitor.close()


def _label(f: Failure) -> str:
    return role_label(f.role, f.rank)


def make_monitor(spec: JobSpec, plan: Plan, node_rank: int) -> JobMonitor:
    """The :class:`JobMonitor` of this node: metrics bind 127.0.0.1 on one node, the node's IP
    when Prometheus must reach several."""
    place: Placement = getattr(plan, "place")  # noqa: B009 - both plans have one
    host = getattr(plan, "pod_ip", None) or place.node_ip
    multi = place.num_nodes > 1 or bool(spec.ps.servers)
    node_rank, num_nodes = node_scope(spec, plan, node_rank)
    return JobMonitor(
        spec.name,
        place.run_id,
        plan.max_restarts,
        spec.log_dir,
        host,
        node_rank,
        metrics=spec.metrics,
        metrics_host=host if multi else "127.0.0.1",
        num_nodes=num_nodes,
    )


def node_scope(spec: JobSpec, plan: Plan, node_rank: int) -> tuple[int, int]:
    """(node rank, node count) that name this node's files in a shared ``log_dir``
    (``job_state.node<R>.json``...): the placement's, or for a static PS layout the position of
    this node's IP among the layout's IPs (in order of first appearance)."""
    place: Placement = getattr(plan, "place")  # noqa: B009 - both plans have one
    if not spec.ps.servers:
        return node_rank, place.num_nodes
    ips = list(dict.fromkeys(e.rpartition(":")[0] for e in (*spec.ps.servers, *spec.ps.workers)))
    pod_ip = getattr(plan, "pod_ip", None)
    return (ips.index(pod_ip) if pod_ip in ips else 0), len(ips)


class Agent:
    """Runs this node's share of a job to the end; :meth:`run` returns the exit code."""

    def __init__(
        self, spec: JobSpec, plan: Plan, node_rank: int, console: ConsoleWriter | None = None
    ):
        self.spec, self.plan, self.node_rank = spec, plan, node_rank
        self.console = console or ConsoleWriter()
        self.warm: WarmPool | None = None  # made with the first attempt's environment

    def run(self) -> int:
        """Run all attempts; return fleetrun's exit code. Keeps ``log_dir/job_state.json`` and
        ``metrics_targets.json`` current (:class:`~launcher.telemetry.JobMonitor`)."""
        monitor = make_monitor(self.spec, self.plan, self.node_rank)
        try:
            with monitored(monitor, "every process was stopped"):
                return self._run(monitor)
        finally:
            if self.warm is not None:
                self.warm.close(wait=False)  # killed; freed while fleetrun ends
            if getattr(self.plan, "recovery", None) is not None:
                self.plan.recovery.close()  # type: ignore[attr-defined]

    def _restart_alone(
        self,
        running: list[Running],
        failures: list[Failure],
        remote: str | None,
        attempt: int,
        alone: int,
        monitor: JobMonitor,
        argv: list[str],
    ) -> bool:
        """A PS job in async/GEO mode whose one failure is a server (or a trainer, when the
        trainers meet through the coordinator; or a heter worker, async/half-async): restart it
        alone — a server on its endpoint, restoring its shards; a trainer from its data
        position; a heter worker on its endpoint with its env — while the others go on
        (:meth:`PSRecovery.recover_alone`). True when done (its entry of ``running`` replaced)."""
        recovery = getattr(self.plan, "recovery", None)
        if recovery is None or remote is not None or len(failures) != 1:
            return False
        (failed,) = failures
        budget_left = attempt + alone < self.plan.max_restarts
        rec = recovery.recover_alone(
            attempt, f"{_label(failed)} {failed.exit_desc}", failed.role, failed.rank, budget_left
        )
        if rec is None:
            return False
        i = next(
            i
            for i, r in enumerate(running)
            if (r.spec.role, r.spec.rank) == (failed.role, failed.rank)
        )
        old = running[i].spec
        extra = (
            recovery.resume_env(rec)
            if failed.role == TRAINER
            else recovery.restore_env()
            if failed.role == SERVER
            else {}
        )
        new = replace(old, env={**old.env, **extra})
        header = (
            f"==== fleetrun: attempt {attempt}, {new.label} restarted alone, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} ====\n"
        )
        if (
            failed.role == SERVER and not self.spec.entrypoint.no_python
        ):  # the server side of a fleet script is only
            # init_server + run_server: the same, without the script's imports (torch: seconds)
            argv = [
                sys.executable,
                "-u",
                "-m",
                "collective.bootstrap",
                "-m",
                "ps_server",
                "--from_env",
            ]
        try:
            proc = WorkerProcess(
                argv,
                new.env,
                new.log_path,
                self.console if new.show else None,
                new.prefix,
                header,
                append=True,
                warm=self.warm,
            )
        except OSError as err:
            raise LaunchError(f"could not restart {new.label}: {err}") from None
        running[i] = Running(new, proc)
        monitor.recovered(failed.role, rec.text())
        logger.warning("%s", rec.text())
        monitor.attempt_started(attempt, running)
        return True

    def _with_metrics(self, spec: ProcSpec, monitor: JobMonitor) -> ProcSpec:
        port = monitor.metrics_port()
        if not port:
            return spec
        return replace(
            spec, metrics_port=port, env={**spec.env, **metrics_env(port, monitor.metrics_host)}
        )

    def _run(self, monitor: JobMonitor) -> int:
        spec, plan = self.spec, self.plan
        argv = worker_argv(spec)
        history: list[str] = []
        attempt = 0
        alone = 0  # recoveries that restarted one process alone (each spends a restart)
        remote_tick = isinstance(plan, CollectivePlan) and plan.rdzv is not None
        while True:
            specs = [self._with_metrics(s, monitor) for s in plan.specs(attempt)]
            if attempt == 0 and specs:
                self.warm = warm_pool(spec, specs[0].env, str(self.node_rank), len(specs))
            running = start_all(specs, argv, attempt, self.console, self.warm)
            monitor.attempt_started(attempt, running)
            stopped: list[tuple[str, int]] = []
            failures, remote = [], None
            try:
                while True:
                    try:
                        failures, remote = watch(
                            running,
                            attempt,
                            0.25 if remote_tick else 3600.0,
                            (lambda a=attempt: plan.remote_failure(a)) if remote_tick else None,
                            spec.ps.server_grace_s,
                            monitor.refresh,
                        )
                    except Interrupted as sig:
                        plan.report_failure(attempt, f"fleetrun on node {self.node_rank} got {sig}")
                        raise
                    if not self._restart_alone(
                        running, failures, remote, attempt, alone, monitor, argv
                    ):
                        break
                    alone += 1  # a unit of the budget spent; the job goes on in this attempt
                    monitor.restarted_in_place(attempt + alone)
                if failures:
                    first = root_first(failures)[0]
                    peer = lost_a_peer(first)
                    text = f"{_label(first)} {first.exit_desc} {first.message}"
                    plan.report_failure(attempt, text, first.time, peer)
                    wait = PEER_REPORT_WAIT_S if peer else 0.0
                    earlier = plan.earlier_failure(attempt, first.time, wait, peer)
                    if earlier is not None:  # ours only followed another node's failure
                        failures, remote = [], earlier
                elif remote is not None:
                    plan.saw_failure(attempt)
                stopped = [
                    (r.spec.role, r.spec.rank)
                    for r in running
                    if r.proc.exit is None and r.spec.role == TRAINER
                ]
            finally:
                terminate_all([r.proc for r in running], spec.grace_period_s)
            if not failures and remote is None:
                remote = plan.finish(attempt)
            failed_ids = [(f.role, f.rank) for f in failures]
            monitor.attempt_failed(
                [cause_of(f.exit_desc) for f in failures]
                or ([FailureCause.NODE] if remote is not None else [])
            )
            decision = decide(
                bool(failures) or remote is not None, attempt + alone, plan.max_restarts
            )
            recovery = getattr(plan, "recovery", None)
            no_recovery = ""
            if recovery is not None and failures and decision is not Decision.SUCCEED:
                first = root_first(failures)[0]
                got = recovery.recover(
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
            if decision is Decision.SUCCEED:
                logger.info("job '%s' succeeded (%d restart(s) used)", spec.name, attempt + alone)
                if recovery is not None and recovery.recoveries:
                    sys.stderr.write(
                        f"fleetrun: job '{spec.name}' succeeded; {recovery.finish(attempt)}\n"
                    )
                monitor.finished(JobState.SUCCEEDED)
                return 0
            what = remote or ", ".join(
                f"{_label(f)} {f.exit_desc}" for f in sorted(failures, key=lambda f: f.time)
            )
            history.append(f"attempt {attempt}: {what}")
            if decision is Decision.RESTART:
                attempt += 1
                monitor.restarting(attempt + alone)
                monitor.refresh(failed_ids)
                logger.warning(
                    "attempt %d failed (%s); restarting the job (restart %d of %d)",
                    attempt - 1,
                    what,
                    attempt + alone,
                    plan.max_restarts,
                )
                continue
            plan.wait_seen(attempt, SEEN_WAIT_S)  # node 0 holds the store the others read
            note = "Earlier attempts: " + "; ".join(history[:-1]) if len(history) > 1 else ""
            after = (
                "\n".join(t for t in (no_recovery, recovery.finish(attempt)) if t)
                if recovery
                else ""
            )
            if failures:
                text = (
                    format_summary(
                        spec.name, failures, stopped, spec.log_dir, attempt, plan.max_restarts, note
                    )
                    + "\n"
                    + (after + "\n" if after else "")
                )
            else:
                text = (
                    f"fleetrun: job '{spec.name}' FAILED: {remote}. This node's processes were "
                    f"stopped; the root-cause summary is on that node's console. Logs: {spec.log_dir}/\n"
                )
            monitor.finished(JobState.FAILED, text.rstrip("\n"), failed_ids)
            sys.stderr.write(text)
            sys.stderr.flush()
            return 1
