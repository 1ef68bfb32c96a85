"""The node agent of a collective job: start this node's trainers, watch them, restart or fail.

An explicit loop over attempts (0 = first run, then one per restart)::

    layout  = rendezvous (multi-node) or a local layout
    workers = start one process per local rank with the env contract
    outcome = wait until all succeed, one fails, another node fails, or a signal arrives
    teardown (always): SIGTERM → grace → SIGKILL, reap, kill stray descendants
    success → exit 0;  failure and budget left → next attempt;  else → summary, exit 1

The decision after a failure is :func:`decide` (plain data in, plain data out), unit-tested
without processes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from collective.env import NodeLayout, find_free_port, make_worker_env
from collective.errors import LaunchError
from launcher.process import ConsoleWriter, WorkerProcess, terminate_all, wait_any
from launcher.rendezvous import NodeInfo, NodeRendezvous
from launcher.spec import JobSpec, Tee
from launcher.summary import Failure, format_summary, read_error_file

logger = logging.getLogger(__name__)


class Interrupted(Exception):
    """fleetrun itself got SIGINT/SIGTERM/SIGHUP."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Decision(Enum):
    """What the agent does after an attempt ended."""

    SUCCEED = "succeed"
    RESTART = "restart"
    FAIL = "fail"


def decide(failed: bool, attempt: int, max_restarts: int) -> Decision:
    """Restart while the job-global budget lasts (attempt N means N restarts used)."""
    if not failed:
        return Decision.SUCCEED
    return Decision.RESTART if attempt < max_restarts else Decision.FAIL


@dataclass(frozen=True)
class Placement:
    """Where this node sits in the job, resolved once from the spec."""

    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    node_ip: str
    run_id: str


def worker_argv(spec: JobSpec) -> list[str]:
    """The command every trainer runs (Python scripts go through collective.bootstrap so an
    uncaught exception is written to the error file)."""
    entry = spec.entrypoint
    if entry.module:
        return [sys.executable, "-u", "-m", "collective.bootstrap", "-m", entry.module, *entry.args]
    assert entry.script
    if entry.no_python:
        return [entry.script, *entry.args]
    return [sys.executable, "-u", "-m", "collective.bootstrap", entry.script, *entry.args]


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


class CollectiveAgent:
    """Runs this node's share of a collective job to the end; :meth:`run` returns the exit code."""

    def __init__(self, spec: JobSpec, placement: Placement, console: ConsoleWriter | None = None):
        self.spec = spec
        self.place = placement
        self.console = console or ConsoleWriter()
        self.nproc = spec.sizes.nproc_per_node
        self.host = socket.gethostname()
        self.strategy_file: str | None = None

    # -- layout ---------------------------------------------------------------------------------
    def _layout(self, attempt: int, rdzv: NodeRendezvous | None) -> NodeLayout:
        p = self.place
        ports = tuple(find_free_port(p.node_ip) for _ in range(self.nproc))
        if rdzv is None:
            nodes = [NodeInfo(0, p.node_ip, self.host, ports)]
            master_port = p.master_port or find_free_port(p.master_addr)
            run_id = p.run_id
        else:
            nodes, master_port = rdzv.join(attempt, NodeInfo(p.node_rank, p.node_ip, self.host, ports))
            run_id = rdzv.run_id
        endpoints = tuple(f"{n.ip}:{port}" for n in nodes for port in n.ports)
        log_dir = self.spec.log_dir
        return NodeLayout(
            run_id=run_id,
            num_nodes=p.num_nodes,
            nproc_per_node=self.nproc,
            node_rank=p.node_rank,
            master_addr=p.master_addr,
            master_port=master_port,
            trainer_endpoints=endpoints,
            node_ip=p.node_ip,
            restart_count=attempt,
            max_restarts=rdzv.max_restarts if rdzv else self.spec.max_restarts,
            backend=self.spec.backend,
            log_dir=log_dir,
            error_dir=os.path.join(log_dir, "errors", f"attempt{attempt}"),
            job_name=self.spec.name,
            strategy_file=self.strategy_file,
        )

    def _write_endpoints(self, layout: NodeLayout) -> None:
        path = os.path.join(layout.log_dir, "endpoints.log")
        with open(path, "a" if layout.restart_count else "w", encoding="utf-8") as f:
            f.write(
                f"# attempt {layout.restart_count} run_id {layout.run_id} master "
                f"{layout.master_addr}:{layout.master_port}\n"
            )
            for rank, ep in enumerate(layout.trainer_endpoints):
                f.write(f"trainer {rank} {ep}\n")

    # -- processes ------------------------------------------------------------------------------
    def _start(self, layout: NodeLayout) -> list[WorkerProcess]:
        argv = worker_argv(self.spec)
        base = dict(os.environ)
        base.update(self.spec.env)
        if self.nproc > 1 and "OMP_NUM_THREADS" not in base:
            base["OMP_NUM_THREADS"] = "1"  # as torchrun: N processes must not each take all cores
        os.makedirs(layout.error_dir, exist_ok=True)
        workers = []
        for local_rank in range(self.nproc):
            rank = layout.global_rank(local_rank)
            env = dict(base)
            env.update(make_worker_env(layout, local_rank))
            stale = layout.error_file(local_rank)
            if os.path.exists(stale):
                os.remove(stale)
            tee = self.spec.tee
            show = tee is Tee.ALL or (tee is Tee.RANK0 and rank == 0)
            prefix = f"[rank {rank}] ".encode() if tee is Tee.ALL else b""
            header = (
                f"==== fleetrun: attempt {layout.restart_count}, rank {rank}, "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')} ====\n"
            )
            try:
                workers.append(
                    WorkerProcess(
                        argv,
                        env,
                        os.path.join(layout.log_dir, f"workerlog.{rank}"),
                        self.console if show else None,
                        prefix,
                        header,
                        append=layout.restart_count > 0,
                    )
                )
            except OSError as err:
                terminate_all(workers, 0.0)
                raise LaunchError(f"could not start {argv[0]!r} for rank {rank}: {err}") from None
        return workers

    def _failure(self, layout: NodeLayout, w: WorkerProcess, local_rank: int) -> Failure:
        assert w.exit is not None
        err_file = layout.error_file(local_rank)
        parsed = read_error_file(err_file)
        return Failure(
            role="trainer",
            rank=layout.global_rank(local_rank),
            local_rank=local_rank,
            node_rank=layout.node_rank,
            host=self.host,
            pid=w.pid,
            exit_desc=w.exit.describe(),
            time=w.exit.time,
            attempt=layout.restart_count,
            log_path=w.log_path,
            error_file=err_file if parsed else None,
            message=parsed[0] if parsed else "",
            traceback=parsed[1] if parsed else "",
        )

    def _watch(
        self, workers: Sequence[WorkerProcess], layout: NodeLayout, rdzv: NodeRendezvous | None
    ) -> tuple[list[Failure], str | None]:
        """Block until every worker succeeded ([], None), some failed (failures, None) or another
        node reported a failure ([], its text)."""
        tick = 0.25 if rdzv else 3600.0
        while True:
            wait_any(workers, tick)
            failed = [
                self._failure(layout, w, i)
                for i, w in enumerate(workers)
                if w.exit is not None and not w.exit.ok
            ]
            if failed:
                return failed, None
            if all(w.exit is not None for w in workers):
                return [], None
            if rdzv is not None:
                remote = rdzv.remote_failure(layout.restart_count)
                if remote:
                    return [], remote

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> int:
        """Run all attempts; return fleetrun's exit code."""
        p = self.place
        rdzv = None
        if p.num_nodes > 1:
            assert p.master_port is not None
            rdzv = NodeRendezvous(
                p.master_addr, p.master_port, p.num_nodes, p.node_rank,
                self.spec.rendezvous.timeout_s, self.spec.max_restarts, p.run_id,
            )
        max_restarts = rdzv.max_restarts if rdzv else self.spec.max_restarts
        history: list[str] = []
        attempt = 0
        while True:
            layout = self._layout(attempt, rdzv)
            self._write_endpoints(layout)
            workers = self._start(layout)
            stopped: list[tuple[str, int]] = []
            try:
                try:
                    failures, remote = self._watch(workers, layout, rdzv)
                except Interrupted as sig:
                    if rdzv is not None:
                        rdzv.report_failure(attempt, f"fleetrun on node {p.node_rank} got {sig}")
                    raise
                if failures and rdzv is not None:
                    first = min(failures, key=lambda f: f.time)
                    rdzv.report_failure(attempt, f"rank {first.rank} {first.exit_desc} {first.message}")
                stopped = [
                    ("trainer", layout.global_rank(i)) for i, w in enumerate(workers) if w.exit is None
                ]
            finally:
                terminate_all(workers, self.spec.grace_period_s)
            if not failures and remote is None and rdzv is not None:
                remote = rdzv.finish(attempt)
            decision = decide(bool(failures) or remote is not None, attempt, max_restarts)
            if decision is Decision.SUCCEED:
                logger.info("job '%s' succeeded (%d restart(s) used)", self.spec.name, attempt)
                return 0
            what = (
                remote
                if remote
                else ", ".join(f"rank {f.rank} {f.exit_desc}" for f in sorted(failures, key=lambda f: f.time))
            )
            history.append(f"attempt {attempt}: {what}")
            if decision is Decision.RESTART:
                attempt += 1
                logger.warning(
                    "attempt %d failed (%s); restarting the job (restart %d of %d)",
                    attempt - 1, what, attempt, max_restarts,
                )
                continue
            note = "Earlier attempts: " + "; ".join(history[:-1]) if len(history) > 1 else ""
            if failures:
                sys.stderr.write(
                    format_summary(
                        self.spec.name, failures, stopped, self.spec.log_dir, attempt, max_restarts, note
                    )
                    + "\n"
                )
            else:
                sys.stderr.write(
                    f"fleetrun: job '{self.spec.name}' FAILED: {remote}. This node's trainers were "
                    f"stopped; the root-cause summary is on that node's console. Logs: "
                    f"{self.spec.log_dir}/\n"
                )
            sys.stderr.flush()
            return 1
