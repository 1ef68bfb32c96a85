"""The node agent: start this node's processes, watch them, restart or fail — both job modes.

An explicit loop over attempts (0 = first run, then one per restart)::

    specs   = plan.specs(attempt)   # collective: trainers (+ rendezvous on several nodes)
                                    # ps: servers + trainers from the endpoint lists
    running = start them with the env contract
    outcome = wait until all trainers succeed, one process fails, another node fails, or a signal
    teardown (always): SIGTERM → grace → SIGKILL, reap, kill stray descendants
    success → exit 0;  failure and budget left → next attempt;  else → summary, exit 1

The decision after a failure is :func:`~launcher.attempt.decide` (plain data in, plain data out), unit-tested
without processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from collective.env import (
    FLEET_PS_TABLE_THREADS,
    NodeLayout,
    PSLayout,
    find_free_port,
    make_ps_server_env,
    make_ps_trainer_env,
    make_worker_env,
    metrics_env,
    usable_cpus,
)
from collective.errors import ConfigError, LaunchError, RendezvousError
from launcher.attempt import (
    SERVER,
    TRAINER,
    Decision,
    Interrupted,
    ProcSpec,
    Running,
    base_env,
    console_prefix,
    decide,
    start_all,
    watch,
    worker_argv,
    write_endpoints,
)
from launcher.console import StatusConsole
from launcher.process import ConsoleWriter, WorkerProcess, terminate_all
from launcher.ps_env import (
    FLEET_PS_CHECKPOINT_ROOT,
    FLEET_PS_TOKEN,
    job_ps_token,
    ps_checkpoint_root_env,
    user_ps_token,
)
from launcher.recovery.ps_policy import make_recovery
from launcher.rendezvous import NodeInfo, NodeRendezvous
from launcher.spec import JobSpec
from launcher.summary import Failure, format_summary
from launcher.telemetry import FailureCause, JobMonitor, JobState, cause_of, node_file

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


@dataclass(frozen=True)
class Placement:
    """Where this node sits in the job, resolved once from the spec."""

    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    node_ip: str
    run_id: str


def check_port_free(host: str, port: int, what: str) -> None:
    """LaunchError naming ``port`` when something already listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise LaunchError(
                f"{what} port {port} on {host} is busy ({err.strerror}); pick another "
                "--master_port, or leave it out and fleetrun picks a free one"
            ) from None


def _table_threads_env(env: dict[str, str], nproc_here: int) -> dict[str, str]:
    """FLEET_PS_TABLE_THREADS for the servers of a node running ``nproc_here`` processes: the
    node's CPUs split between them, unless the user set it."""
    if FLEET_PS_TABLE_THREADS in env:
        return {}
    return {FLEET_PS_TABLE_THREADS: str(max(1, usable_cpus() // max(1, nproc_here)))}


class Plan(Protocol):
    """Builds this node's process specs for one attempt."""

    max_restarts: int

    def specs(self, attempt: int) -> list[ProcSpec]: ...

    def remote_failure(self, attempt: int) -> str | None: ...

    def report_failure(self, attempt: int, text: str) -> None: ...

    def finish(self, attempt: int) -> str | None: ...


class CollectivePlan:
    """Trainers only; on several nodes the agents meet in a :class:`NodeRendezvous`."""

    def __init__(self, spec: JobSpec, place: Placement, strategy_file: str | None) -> None:
        self.spec, self.place, self.strategy_file = spec, place, strategy_file
        self.host = socket.gethostname()
        self.rdzv: NodeRendezvous | None = None
        if place.num_nodes > 1:
            assert place.master_port is not None
            self.rdzv = NodeRendezvous(
                place.master_addr,
                place.master_port,
                place.num_nodes,
                place.node_rank,
                spec.rendezvous.timeout_s,
                spec.max_restarts,
                place.run_id,
            )
        self.max_restarts = self.rdzv.max_restarts if self.rdzv else spec.max_restarts

    def layout(self, attempt: int) -> NodeLayout:
        p, nproc = self.place, self.spec.sizes.nproc_per_node
        ports = tuple(find_free_port(p.node_ip) for _ in range(nproc))
        if self.rdzv is None:
            nodes = [NodeInfo(0, p.node_ip, self.host, ports)]
            master_port, run_id = p.master_port or find_free_port(p.master_addr), p.run_id
        else:
            nodes, master_port = self.rdzv.join(
                attempt, NodeInfo(p.node_rank, p.node_ip, self.host, ports)
            )
            run_id = self.rdzv.run_id
        log_dir = self.spec.log_dir
        return NodeLayout(
            run_id=run_id,
            num_nodes=p.num_nodes,
            nproc_per_node=nproc,
            node_rank=p.node_rank,
            master_addr=p.master_addr,
            master_port=master_port,
            trainer_endpoints=tuple(f"{n.ip}:{port}" for n in nodes for port in n.ports),
            node_ip=p.node_ip,
            restart_count=attempt,
            max_restarts=self.max_restarts,
            backend=self.spec.backend,
            log_dir=log_dir,
            error_dir=os.path.join(log_dir, "errors", f"attempt{attempt}"),
            job_name=self.spec.name,
            strategy_file=self.strategy_file,
        )

    def specs(self, attempt: int) -> list[ProcSpec]:
        layout = self.layout(attempt)
        write_endpoints(
            self.spec.log_dir,
            attempt,
            f"run_id {layout.run_id} master {layout.master_addr}:{layout.master_port}",
            [],
            layout.trainer_endpoints,
            node_file("endpoints.log", self.place.node_rank, self.place.num_nodes),
        )
        base = base_env(self.spec, layout.nproc_per_node)
        out = []
        for local_rank in range(layout.nproc_per_node):
            rank = layout.global_rank(local_rank)
            show, prefix = console_prefix(self.spec, TRAINER, rank)
            out.append(
                ProcSpec(
                    TRAINER,
                    rank,
                    local_rank,
                    layout.node_rank,
                    {**base, **make_worker_env(layout, local_rank)},
                    os.path.join(layout.log_dir, f"workerlog.{rank}"),
                    layout.error_file(local_rank),
                    show,
                    prefix,
                )
            )
        return out

    def remote_failure(self, attempt: int) -> str | None:
        return self.rdzv.remote_failure(attempt) if self.rdzv else None

    def report_failure(self, attempt: int, text: str) -> None:
        if self.rdzv:
            self.rdzv.report_failure(attempt, text)

    def finish(self, attempt: int) -> str | None:
        return self.rdzv.finish(attempt) if self.rdzv else None


def _is_local(ip: str) -> bool:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


class PSPlan:
    """Servers + trainers: ``server_num``/``worker_num`` on this machine (free ports per attempt),
    or static ``ps.servers``/``ps.workers`` lists of which this node runs the entries with its
    IP. Nodes do not coordinate: a multi-node PS job cannot restart (ConfigError), and its nodes
    must share a FLEET_PS_TOKEN given by the user; on one node fleetrun makes the job's token
    (:func:`~launcher.ps_env.job_ps_token`). Servers also get their checkpoint roots
    (:func:`~launcher.ps_env.ps_checkpoint_root_env`)."""

    def __init__(self, spec: JobSpec, place: Placement, strategy_file: str | None) -> None:
        self.spec, self.place, self.strategy_file = spec, place, strategy_file
        self.max_restarts = spec.max_restarts
        ps = spec.ps
        self.static = bool(ps.servers)
        if self.static:
            ips = {e.rpartition(":")[0] for e in (*ps.servers, *ps.workers)}
            if ps.pod_ip:
                self.pod_ip = ps.pod_ip
            else:
                mine = sorted(ip for ip in ips if _is_local(ip))
                if len(mine) != 1:
                    raise ConfigError(
                        f"cannot tell which of the ps endpoint IPs ({', '.join(sorted(ips))}) is this "
                        f"node (local ones: {', '.join(mine) or 'none'}); pass --pod_ip",
                        key="ps.pod_ip",
                    )
                self.pod_ip = mine[0]
            if len(ips) > 1 and spec.max_restarts:
                raise ConfigError(
                    "max_restarts > 0 needs a single-node PS job: nodes of a static PS layout do not "
                    "coordinate restarts; set max_restarts: 0",
                    key="max_restarts",
                )
            if len(ips) > 1 and user_ps_token(spec) is None:
                raise ConfigError(
                    "a PS job over several nodes needs one token shared by every node (the nodes' "
                    "fleetruns do not talk to each other): export the same secret on each, e.g. "
                    "FLEET_PS_TOKEN=$(python -c "
                    "'import secrets; print(secrets.token_urlsafe(32))')",
                    key=FLEET_PS_TOKEN,
                )
        self.token = job_ps_token(spec)
        self.recovery = make_recovery(spec)  # automatic checkpoints: recover from them
        if self.recovery is not None and not self.static:  # a_sync trainers meet through it
            self.recovery.start_coordinator(self.token)  # and one can be restarted alone
        self._servers: tuple[str, ...] = ()

    def layout(self, attempt: int) -> PSLayout:
        ps, sizes = self.spec.ps, self.spec.sizes
        if self.static:
            servers, workers = ps.servers, ps.workers
        else:
            ip = self.place.node_ip
            servers = tuple(f"{ip}:{find_free_port(ip)}" for _ in range(sizes.server_num))
            if self.recovery is not None:  # a recovered server comes back on its endpoint
                servers = self._servers = self._servers or servers
            workers = tuple(f"{ip}:{find_free_port(ip)}" for _ in range(sizes.worker_num))
        log_dir = self.spec.log_dir
        return PSLayout(
            run_id=self.place.run_id,
            server_endpoints=servers,
            trainer_endpoints=workers,
            restart_count=attempt,
            max_restarts=self.max_restarts,
            backend=self.spec.backend,
            log_dir=log_dir,
            error_dir=os.path.join(log_dir, "errors", f"attempt{attempt}"),
            job_name=self.spec.name,
            strategy_file=self.strategy_file,
        )

    def _here(self, endpoint: str) -> bool:
        return not self.static or endpoint.rpartition(":")[0] == self.pod_ip

    def specs(self, attempt: int) -> list[ProcSpec]:
        layout = self.layout(attempt)
        write_endpoints(
            self.spec.log_dir,
            attempt,
            f"run_id {layout.run_id}",
            layout.server_endpoints,
            layout.trainer_endpoints,
        )
        servers = [i for i, e in enumerate(layout.server_endpoints) if self._here(e)]
        trainers = [i for i, e in enumerate(layout.trainer_endpoints) if self._here(e)]
        if not servers and not trainers:
            raise ConfigError(
                f"no server or worker endpoint has this node's IP {self.pod_ip}", key="ps.pod_ip"
            )
        base = {**base_env(self.spec, len(servers) + len(trainers)), FLEET_PS_TOKEN: self.token}
        server_base = {
            **base,
            **_table_threads_env(base, len(servers) + len(trainers)),
            **ps_checkpoint_root_env(base, self.spec.log_dir, os.getcwd()),
        }
        if self.recovery is not None:
            self.recovery.begin_attempt(attempt)
            server_base[FLEET_PS_CHECKPOINT_ROOT] = self.recovery.server_roots(
                server_base.get(FLEET_PS_CHECKPOINT_ROOT, "")
            )
            base = {**base, **self.recovery.trainer_env()}
        out = []
        for i in servers:
            show, prefix = console_prefix(self.spec, SERVER, i)
            out.append(
                ProcSpec(
                    SERVER,
                    i,
                    i,
                    0,
                    {**server_base, **make_ps_server_env(layout, i)},
                    os.path.join(layout.log_dir, f"serverlog.{i}"),
                    layout.server_error_file(i),
                    show,
                    prefix,
                )
            )
        for local_rank, t in enumerate(trainers):
            show, prefix = console_prefix(self.spec, TRAINER, t)
            out.append(
                ProcSpec(
                    TRAINER,
                    t,
                    local_rank,
                    0,
                    {**base, **make_ps_trainer_env(layout, t, local_rank, len(trainers))},
                    os.path.join(layout.log_dir, f"workerlog.{t}"),
                    layout.trainer_error_file(t),
                    show,
                    prefix,
                )
            )
        return out

    def remote_failure(self, attempt: int) -> str | None:
        return None

    def report_failure(self, attempt: int, text: str) -> None:
        return None

    def finish(self, attempt: int) -> str | None:
        return None


def _label(f: Failure) -> str:
    return f"rank {f.rank}" if f.role == TRAINER else f"server {f.rank}"


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

    def run(self) -> int:
        """Run all attempts; return fleetrun's exit code. Keeps ``log_dir/job_state.json`` and
        ``metrics_targets.json`` current (:class:`~launcher.telemetry.JobMonitor`)."""
        monitor = make_monitor(self.spec, self.plan, self.node_rank)
        try:
            with monitored(monitor, "every process was stopped"):
                return self._run(monitor)
        finally:
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
        trainers meet through the coordinator): restart it alone — a server on its endpoint,
        restoring its shards; a trainer from its data position — while the others go on
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
        new = replace(
            old,
            env={
                **old.env,
                **(recovery.resume_env(rec) if failed.role == TRAINER else recovery.restore_env()),
            },
        )
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
            running = start_all(specs, argv, attempt, self.console)
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
                    first = min(failures, key=lambda f: f.time)
                    plan.report_failure(
                        attempt, f"{_label(first)} {first.exit_desc} {first.message}"
                    )
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
                first = min(failures, key=lambda f: f.time)
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
