"""The launcher's Prometheus metrics and the two files it keeps in ``log_dir`` for watchers.

Metrics (``fleet_launcher_*``, served by the launcher itself on a free 127.0.0.1 port):

* ``fleet_launcher_job_state{state}`` — 1 for the current :class:`JobState`, 0 for the others;
* ``fleet_launcher_processes_up{role}`` — processes of this node running now, by role;
* ``fleet_launcher_restarts_total`` — job restarts done;
* ``fleet_launcher_failures_total{cause}`` — failed processes / attempts by :class:`FailureCause`.

Files (formats documented in README "Metrics"; the dashboard reads them):

* ``metrics_targets.json`` — Prometheus file-based service discovery, one group per process
  (and one for the launcher), rewritten when an attempt starts;
* ``job_state.json`` — the job and every process, rewritten atomically (tmp + ``os.replace``)
  on every state change.

:class:`JobMonitor` is the one object the agent talks to; it holds no torch and no locks the
agent's hot loop waits on (the console thread reads a snapshot under a short lock).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import Counter, Gauge, start_http_server

from collective.env import StrEnum, find_free_port
from launcher.process import signal_name

logger = logging.getLogger(__name__)

JOB_STATE_FILE = "job_state.json"
TARGETS_FILE = "metrics_targets.json"


class JobState(StrEnum):
    """States of a job as the launcher sees it."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class ProcState(StrEnum):
    """State of one process in ``job_state.json``."""

    UP = "up"
    EXITED = "exited"
    FAILED = "failed"


class FailureCause(StrEnum):
    """Label values of ``fleet_launcher_failures_total``."""

    EXIT_CODE = "exit_code"
    SIGNAL = "signal"
    NODE = "node"
    RENDEZVOUS = "rendezvous"


ROLES = ("trainer", "server")

# -- metric definitions (the naming test scans this module) -----------------------------------
JOB_STATE = Gauge("fleet_launcher_job_state", "1 for the job's current state, 0 for the others",
                  ["state"])
PROCESSES_UP = Gauge("fleet_launcher_processes_up", "Processes of this node running now", ["role"])
RESTARTS = Counter("fleet_launcher_restarts", "Job restarts done by this launcher")
FAILURES = Counter("fleet_launcher_failures", "Failures seen by this launcher, by cause", ["cause"])

for _s in JobState:
    JOB_STATE.labels(state=_s.value)
for _r in ROLES:
    PROCESSES_UP.labels(role=_r)
for _c in FailureCause:
    FAILURES.labels(cause=_c.value)


def cause_of(exit_desc: str) -> FailureCause:
    """``signal SIGKILL (9)`` → SIGNAL, ``exit code 1`` → EXIT_CODE."""
    return FailureCause.SIGNAL if exit_desc.startswith("signal") else FailureCause.EXIT_CODE


@dataclass
class ProcRecord:
    """One process in ``job_state.json``."""

    role: str
    rank: int
    host: str
    pid: int | None
    state: str
    exit_code: int | None
    signal: str | None
    metrics: str | None
    """``host:port`` of its ``/metrics``, or None with metrics off."""
    log: str
    """Absolute path of its workerlog.N / serverlog.N."""


def write_json_atomic(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` via a temporary file and ``os.replace`` (readers never
    see a half-written file)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def serve_metrics(host: str = "127.0.0.1", port: int = 0) -> tuple[Any, int]:
    """Start a ``/metrics`` HTTP server (daemon thread) on ``host:port`` (0 = free port) serving
    the default registry; returns (server, bound port). Stop it with ``server.shutdown()``."""
    httpd, _thread = start_http_server(port, addr=host)
    return httpd, int(httpd.server_port)


class JobMonitor:
    """Keeps the launcher's metrics and the ``log_dir`` files in step with the agent.

    The agent calls: :meth:`metrics_port` while building process specs, :meth:`attempt_started`
    after starting them, :meth:`refresh` whenever a process may have exited,
    :meth:`attempt_failed` / :meth:`restarting` / :meth:`finished`, and :meth:`close`.
    """

    def __init__(self, name: str, run_id: str, max_restarts: int, log_dir: str, host: str,
                 node_rank: int = 0, metrics: bool = True, metrics_host: str = "127.0.0.1") -> None:
        self.name, self.run_id, self.max_restarts = name, run_id, max_restarts
        self.log_dir, self.host, self.node_rank = log_dir, host, node_rank
        self.metrics_enabled, self.metrics_host = metrics, metrics_host
        self.state = JobState.STARTING
        self.attempt = 0
        self.restarts = 0
        self.started_at = time.time()
        self.failure_summary: str | None = None
        self.processes: list[ProcRecord] = []
        self._running: Sequence[Any] = ()
        self._lock = threading.Lock()
        self._server: Any = None
        self.launcher_metrics: str | None = None
        os.makedirs(log_dir, exist_ok=True)
        if metrics:
            self._server, port = serve_metrics(metrics_host, 0)
            self.launcher_metrics = f"{metrics_host}:{port}"
        self._set_state(JobState.STARTING)

    # -- what the agent calls ------------------------------------------------------------------
    def metrics_port(self) -> int:
        """A free port for one process's ``/metrics`` (0 with metrics off)."""
        return find_free_port(self.metrics_host) if self.metrics_enabled else 0

    def attempt_started(self, attempt: int, running: Sequence[Any]) -> None:
        """The processes of ``attempt`` are started (``running``: launcher.attempt.Running)."""
        self.attempt = attempt
        self._running = list(running)
        self._write_targets()
        self.state = JobState.RUNNING
        self.refresh(force=True)

    def refresh(self, failed: Sequence[tuple[str, int]] = (), force: bool = False) -> None:
        """Re-read the processes' exits; write ``job_state.json`` if anything changed.
        ``failed``: (role, rank) of the processes that failed on their own (the rest of the
        non-zero exits were stopped by fleetrun and show as ``exited``)."""
        records = [self._record(r, failed) for r in self._running]
        up = dict.fromkeys(ROLES, 0)
        for rec in records:
            if rec.state == ProcState.UP:
                up[rec.role] = up.get(rec.role, 0) + 1
        for role, n in up.items():
            PROCESSES_UP.labels(role=role).set(n)
        with self._lock:
            changed = records != self.processes
            self.processes = records
        if changed or force:
            self._set_state(self.state)

    def attempt_failed(self, causes: Sequence[FailureCause]) -> None:
        """Count the failures of an attempt (one per failed process, or one node/rendezvous)."""
        for cause in causes:
            FAILURES.labels(cause=cause.value).inc()

    def restarting(self, attempt: int) -> None:
        """The job restarts as ``attempt``."""
        RESTARTS.inc()
        self.restarts = attempt
        self._set_state(JobState.RESTARTING)

    def finished(self, state: JobState, failure_summary: str | None = None,
                 failed: Sequence[tuple[str, int]] = ()) -> None:
        """The job ended (succeeded, failed or stopped by a signal)."""
        self.failure_summary = failure_summary
        self.state = state
        self.refresh(failed, force=True)

    def close(self) -> None:
        """Stop the launcher's own ``/metrics`` server (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def snapshot(self) -> dict[str, Any]:
        """The ``job_state.json`` content as of now."""
        with self._lock:
            procs = [asdict(p) for p in self.processes]
        return {
            "name": self.name,
            "run_id": self.run_id,
            "state": self.state.value,
            "attempt": self.attempt,
            "restarts": self.restarts,
            "max_restarts": self.max_restarts,
            "started_at": self.started_at,
            "updated_at": time.time(),
            "launcher_metrics": self.launcher_metrics,
            "processes": procs,
            "failure_summary": self.failure_summary,
        }

    # -- internals -----------------------------------------------------------------------------
    def _set_state(self, state: JobState) -> None:
        self.state = state
        for s in JobState:
            JOB_STATE.labels(state=s.value).set(1 if s is state else 0)
        try:
            write_json_atomic(os.path.join(self.log_dir, JOB_STATE_FILE), self.snapshot())
        except OSError as err:  # a watcher's file must never take the job down
            logger.warning("could not write %s in %s: %s", JOB_STATE_FILE, self.log_dir, err)

    def _record(self, r: Any, failed: Sequence[tuple[str, int]]) -> ProcRecord:
        spec, proc = r.spec, r.proc
        exit_info = proc.exit
        code: int | None = None
        sig: str | None = None
        if exit_info is None:
            state = ProcState.UP
        else:
            if exit_info.returncode < 0:
                sig = signal_name(-exit_info.returncode)
            else:
                code = exit_info.returncode
            # While running, any bad exit is a failure; once the job ended, only the processes
            # that failed on their own are (the others were stopped by fleetrun's teardown).
            failing = (spec.role, spec.rank) in failed or (
                not exit_info.ok and self.state is JobState.RUNNING)
            state = ProcState.FAILED if failing else ProcState.EXITED
        port = getattr(spec, "metrics_port", 0)
        return ProcRecord(
            role=spec.role, rank=spec.rank, host=self.host, pid=proc.pid, state=state.value,
            exit_code=code, signal=sig,
            metrics=f"{self.metrics_host}:{port}" if port else None,
            log=os.path.abspath(spec.log_path),
        )

    def _write_targets(self) -> None:
        if not self.metrics_enabled:
            return
        groups = []
        if self.launcher_metrics:
            groups.append(self._group(self.launcher_metrics, "launcher", self.node_rank))
        for r in self._running:
            port = getattr(r.spec, "metrics_port", 0)
            if port:
                groups.append(self._group(f"{self.metrics_host}:{port}", r.spec.role, r.spec.rank))
        try:
            write_json_atomic(os.path.join(self.log_dir, TARGETS_FILE), groups)
        except OSError as err:
            logger.warning("could not write %s in %s: %s", TARGETS_FILE, self.log_dir, err)

    def _group(self, target: str, role: str, rank: int) -> dict[str, Any]:
        return {"targets": [target],
                "labels": {"job": self.name, "role": role, "rank": str(rank), "host": self.host}}


__all__ = [
    "FAILURES",
    "JOB_STATE",
    "JOB_STATE_FILE",
    "PROCESSES_UP",
    "RESTARTS",
    "TARGETS_FILE",
    "FailureCause",
    "JobMonitor",
    "JobState",
    "ProcRecord",
    "ProcState",
    "cause_of",
    "serve_metrics",
    "write_json_atomic",
]
