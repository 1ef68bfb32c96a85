"""The launcher's Prometheus metrics and the two files it keeps in ``log_dir`` for watchers.

Metrics (``fleet_launcher_*``, served by the launcher itself on a free 127.0.0.1 port):

* ``fleet_launcher_job_state{state}`` — 1 for the current :class:`JobState`, 0 for the others;
* ``fleet_launcher_processes_up{role}`` — processes of this node running now, by role;
* ``fleet_launcher_restarts_total`` — job restarts done (a process restarted alone in place counts one);
* ``fleet_launcher_failures_total{cause}`` — failed processes / attempts by :class:`FailureCause`.
* ``fleet_launcher_membership_changes_total{cause}`` — elastic jobs: rounds whose nodes differ from the
  previous round's, by cause (``failure`` or ``join``;
  :mod:`launcher.schedulers.local.elastic_agent`).
* ``fleet_ps_recoveries_total{role}`` — PS recoveries from a checkpoint, by the role of the
  process that died (:mod:`launcher.recovery.ps_policy`).

Files (formats documented in README "Metrics"; the dashboard reads them):

* ``metrics_targets.json`` — Prometheus file-based service discovery, one group per process
  (and one for the launcher), rewritten when an attempt starts;
* ``job_state.json`` — the job and every process, rewritten atomically (tmp + ``os.replace``)
  on every state change.

Both are node-scoped: a job of several nodes (``nnodes > 1``) may share one ``log_dir`` (NFS, a
Kubernetes volume), so there **every** node, node 0 included, writes ``job_state.node<R>.json``
and ``metrics_targets.node<R>.json`` (:func:`job_state_file`, :func:`targets_file`); readers
take every ``job_state*.json`` (:func:`read_job_states`, :func:`merge_job_states`) and
Prometheus file-SD the glob ``metrics_targets*.json``.

:class:`JobMonitor` is the one object the agent (local scheduler) and the Ray driver talk to; it
holds no torch and no locks the agent's hot loop waits on (the console thread reads a snapshot
under a short lock). What it needs of a process is a :class:`MemberView`; the local scheduler's
``Running`` objects are viewed by :meth:`JobMonitor.view_running`, the Ray driver passes its own
``view`` function.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import Counter, Gauge

from collective.env import StrEnum, find_free_port
from collective.metrics_http import serve_metrics, stop_metrics
from launcher.process import ExitInfo, signal_name

logger = logging.getLogger(__name__)

JOB_STATE_FILE = "job_state.json"
TARGETS_FILE = "metrics_targets.json"
JOB_STATE_GLOB = "job_state*.json"
TARGETS_GLOB = "metrics_targets*.json"
"""What readers (dashboard, ``fleetrun status``, Prometheus file-SD) take: every node's file."""


def node_file(name: str, node_rank: int, num_nodes: int) -> str:
    """``name`` of a file one node writes in a ``log_dir`` the nodes may share:
    ``endpoints.log`` → ``endpoints.node1.log`` on node 1 of 2; unchanged on a single node."""
    if num_nodes <= 1:
        return name
    stem, ext = os.path.splitext(name)
    return f"{stem}.node{node_rank}{ext}"


def job_state_file(node_rank: int = 0, num_nodes: int = 1) -> str:
    """``job_state.json`` on one node; ``job_state.node<R>.json`` on every node of several."""
    return node_file(JOB_STATE_FILE, node_rank, num_nodes)


def targets_file(node_rank: int = 0, num_nodes: int = 1) -> str:
    """``metrics_targets.json`` on one node; ``metrics_targets.node<R>.json`` on several."""
    return node_file(TARGETS_FILE, node_rank, num_nodes)


_NODE_FILE = re.compile(r"^job_state(?:\.node(\d+))?\.json$")


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


ROLES = ("trainer", "server", "heter")

# -- metric definitions (the naming test scans this module) -----------------------------------
JOB_STATE = Gauge(
    "fleet_launcher_job_state", "1 for the job's current state, 0 for the others", ["state"]
)
PROCESSES_UP = Gauge("fleet_launcher_processes_up", "Processes of this node running now", ["role"])
RESTARTS = Counter("fleet_launcher_restarts", "Job restarts done by this launcher")
FAILURES = Counter("fleet_launcher_failures", "Failures seen by this launcher, by cause", ["cause"])
MEMBERSHIP_CHANGES = Counter(
    "fleet_launcher_membership_changes",
    "Elastic jobs: rounds whose nodes differ from the previous round's, by cause",
    ["cause"],
)
PS_RECOVERIES = Counter(
    "fleet_ps_recoveries",
    "PS job recoveries from a checkpoint, by the role of the process that died",
    ["role"],
)

for _s in JobState:
    JOB_STATE.labels(state=_s.value)
for _r in ROLES:
    PROCESSES_UP.labels(role=_r)
for _c in FailureCause:
    FAILURES.labels(cause=_c.value)
for _r in ROLES:
    PS_RECOVERIES.labels(role=_r)


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


@dataclass(frozen=True)
class MemberView:
    """What :class:`JobMonitor` needs of one process, whichever scheduler started it."""

    role: str
    rank: int
    log_path: str
    metrics_port: int
    """0 = no ``/metrics`` endpoint."""
    pid: int | None
    exit: ExitInfo | None
    """How it ended; None while it runs (or when it is gone without a known exit)."""
    host: str
    """The node it runs on (``job_state.json``'s ``host``, the targets' ``host`` label)."""
    metrics_host: str
    """The address its ``/metrics`` endpoint binds."""
    gone: bool = False
    """Gone without a known exit status (its Ray actor or node died, or it was stopped and
    its exit was not seen): shows as failed or exited with no exit code / signal."""


def write_json_atomic(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` via a temporary file and ``os.replace`` (readers never
    see a half-written file)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


class JobMonitor:
    """Keeps the launcher's metrics and the ``log_dir`` files in step with the agent.

    The agent calls: :meth:`metrics_port` while building process specs, :meth:`attempt_started`
    after starting them, :meth:`refresh` whenever a process may have exited,
    :meth:`attempt_failed` / :meth:`restarting` / :meth:`finished`, and :meth:`close`.
    """

    def __init__(
        self,
        name: str,
        run_id: str,
        max_restarts: int,
        log_dir: str,
        host: str,
        node_rank: int = 0,
        metrics: bool = True,
        metrics_host: str = "127.0.0.1",
        num_nodes: int = 1,
        view: Callable[[Any], MemberView] | None = None,
    ) -> None:
        self.name, self.run_id, self.max_restarts = name, run_id, max_restarts
        self.log_dir, self.host, self.node_rank = log_dir, host, node_rank
        self.num_nodes = num_nodes
        self.metrics_enabled, self.metrics_host = metrics, metrics_host
        self.view: Callable[[Any], MemberView] = view or self.view_running
        self.state_path = os.path.join(log_dir, job_state_file(node_rank, num_nodes))
        self.targets_path = os.path.join(log_dir, targets_file(node_rank, num_nodes))
        self.state = JobState.STARTING
        self.attempt = 0
        self.restarts = 0
        self.started_at = time.time()
        self.failure_summary: str | None = None
        self.membership_changes: list[str] = []
        self.recoveries: list[str] = []
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
        """The processes of ``attempt`` are started (``running``: launcher.attempt.Running, or
        whatever the ``view`` function given to the constructor takes)."""
        self.attempt = attempt
        self._running = list(running)
        self._write_targets()
        self.state = JobState.RUNNING
        self.refresh(force=True)

    def refresh(self, failed: Sequence[tuple[str, int]] = (), force: bool = False) -> None:
        """Re-read the processes' exits; write ``job_state.json`` if anything changed.
        ``failed``: (role, rank) of the processes that failed on their own (the rest of the
        non-zero exits were stopped by fleetrun and show as ``exited``)."""
        records = [self._record(self.view(r), failed) for r in self._running]
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

    def restarting(self, restarts: int) -> None:
        """The job restarts (a new attempt); ``restarts``: the restarts spent so far, this one and
        in-place ones (:meth:`restarted_in_place`) included."""
        RESTARTS.inc()
        self.restarts = restarts
        self._set_state(JobState.RESTARTING)

    def restarted_in_place(self, restarts: int) -> None:
        """One process was restarted alone while the others go on in the same attempt (a PS
        server or trainer in async/GEO mode, locally or on Ray): a restart spent like any other
        (``restarts``: spent so far, this one included), the state stays running."""
        RESTARTS.inc()
        self.restarts = restarts
        self._set_state(self.state)

    def recovered(self, role: str, text: str) -> None:
        """A PS recovery (one line: who died, what was restored, work redone) is under way."""
        PS_RECOVERIES.labels(role=role).inc()
        with self._lock:
            self.recoveries.append(text)

    def membership_changed(self, cause: str, text: str) -> None:
        """An elastic job re-formed with other nodes (``text``: who left/joined, old -> new
        world size)."""
        MEMBERSHIP_CHANGES.labels(cause=cause).inc()
        with self._lock:
            self.membership_changes.append(text)
        self._set_state(self.state)

    def finished(
        self,
        state: JobState,
        failure_summary: str | None = None,
        failed: Sequence[tuple[str, int]] = (),
    ) -> None:
        """The job ended (succeeded, failed or stopped by a signal)."""
        self.failure_summary = failure_summary
        self.state = state
        self.refresh(failed, force=True)

    def close(self) -> None:
        """Stop the launcher's own ``/metrics`` server (idempotent)."""
        if self._server is not None:
            stop_metrics(self._server)
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
            "membership_changes": list(self.membership_changes),
            "recoveries": list(self.recoveries),
        }

    # -- internals -----------------------------------------------------------------------------
    def _set_state(self, state: JobState) -> None:
        self.state = state
        for s in JobState:
            JOB_STATE.labels(state=s.value).set(1 if s is state else 0)
        try:
            write_json_atomic(self.state_path, self.snapshot())
        except OSError as err:  # a watcher's file must never take the job down
            logger.warning("could not write %s: %s", self.state_path, err)

    def view_running(self, r: Any) -> MemberView:
        """The view of a local ``launcher.attempt.Running`` (this node's host and metrics host)."""
        return MemberView(
            r.spec.role,
            r.spec.rank,
            r.spec.log_path,
            r.spec.metrics_port,
            r.proc.pid,
            r.proc.exit,
            self.host,
            self.metrics_host,
        )

    def _record(self, v: MemberView, failed: Sequence[tuple[str, int]]) -> ProcRecord:
        exit_info = v.exit
        code: int | None = None
        sig: str | None = None
        if exit_info is None and not v.gone:
            state = ProcState.UP
        else:
            if exit_info is not None and exit_info.returncode < 0:
                sig = signal_name(-exit_info.returncode)
            elif exit_info is not None:
                code = exit_info.returncode
            bad = exit_info is None or not exit_info.ok
            # While running, any bad exit is a failure; once the job ended, only the processes
            # that failed on their own are (the others were stopped by fleetrun's teardown).
            failing = (v.role, v.rank) in failed or (bad and self.state is JobState.RUNNING)
            state = ProcState.FAILED if failing else ProcState.EXITED
        return ProcRecord(
            role=v.role,
            rank=v.rank,
            host=v.host,
            pid=v.pid,
            state=state.value,
            exit_code=code,
            signal=sig,
            metrics=f"{v.metrics_host}:{v.metrics_port}" if v.metrics_port else None,
            log=os.path.abspath(v.log_path),
        )

    def _write_targets(self) -> None:
        if not self.metrics_enabled:
            return
        groups = []
        if self.launcher_metrics:
            groups.append(self._group(self.launcher_metrics, "launcher", self.node_rank, self.host))
        for v in map(self.view, self._running):
            if v.metrics_port:
                groups.append(
                    self._group(f"{v.metrics_host}:{v.metrics_port}", v.role, v.rank, v.host)
                )
        try:
            write_json_atomic(self.targets_path, groups)
        except OSError as err:
            logger.warning("could not write %s: %s", self.targets_path, err)

    def _group(self, target: str, role: str, rank: int, host: str) -> dict[str, Any]:
        return {
            "targets": [target],
            "labels": {"job": self.name, "role": role, "rank": str(rank), "host": host},
        }


# -- readers (dashboard, ``fleetrun status``) ----------------------------------------------------
def job_state_paths(log_dir: str) -> list[tuple[int, str]]:
    """Every node's ``job_state*.json`` in ``log_dir`` as (node rank, path), in node order: the
    plain file (one node: rank 0) and/or the ``job_state.node<R>.json`` files (several)."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(log_dir), JOB_STATE_GLOB)):
        m = _NODE_FILE.match(os.path.basename(path))
        if m:
            found.append((int(m.group(1)) if m.group(1) else 0, path))
    return sorted(found)


_STATE_ORDER = [
    JobState.FAILED,
    JobState.STOPPED,
    JobState.RESTARTING,
    JobState.STARTING,
    JobState.RUNNING,
    JobState.SUCCEEDED,
]
"""Merged job state: the first of these that any node reports (a failed node fails the job; the
job succeeded only when every node did)."""


def merge_job_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``job_state.json``-shaped dict from several nodes' (given in node order): processes
    in (role, rank) order, the worst state, the first failure summary, ``launcher_metrics`` of
    the first node, plus ``launchers`` listing every node's launcher endpoint."""
    if len(states) == 1:
        return states[0]
    ordered = list(states)
    seen = {str(s.get("state")) for s in ordered}
    state = next((x.value for x in _STATE_ORDER if x.value in seen), str(ordered[0].get("state")))
    procs = [p for s in ordered for p in s.get("processes") or [] if isinstance(p, dict)]
    procs.sort(
        key=lambda p: (str(p.get("role")), p.get("rank") if isinstance(p.get("rank"), int) else 0)
    )
    summaries = [s["failure_summary"] for s in ordered if s.get("failure_summary")]
    merged = dict(ordered[0])
    merged.update(
        state=state,
        processes=procs,
        failure_summary=summaries[0] if summaries else None,
        attempt=max(int(s.get("attempt") or 0) for s in ordered),
        restarts=max(int(s.get("restarts") or 0) for s in ordered),
        started_at=min(float(s.get("started_at") or 0) for s in ordered),
        updated_at=max(float(s.get("updated_at") or 0) for s in ordered),
        launchers=[s.get("launcher_metrics") for s in ordered if s.get("launcher_metrics")],
    )
    return merged


def read_job_states(log_dir: str) -> tuple[dict[str, Any] | None, str | None]:
    """(merged job state of every node's file in ``log_dir``, error text); (None, why) when no
    file is there or none is readable. A file that cannot be read (torn write, not JSON) is
    named in the error text and left out."""
    paths = job_state_paths(log_dir)
    if not paths:
        return None, f"no {JOB_STATE_FILE} (or {JOB_STATE_GLOB}) in {log_dir} yet"
    states, errors = [], []
    for _node, path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as err:
            errors.append(f"cannot read {path}: {err}")
            continue
        if not isinstance(data, dict):
            errors.append(f"{path} is not a JSON object")
            continue
        states.append(data)
    if not states:
        return None, "; ".join(errors)
    return merge_job_states(states), "; ".join(errors) or None


def read_targets(log_dir: str) -> list[Any]:
    """Every node's ``metrics_targets*.json`` groups in ``log_dir``, concatenated (files that
    cannot be read are skipped: the next poll reads them again)."""
    groups: list[Any] = []
    for path in sorted(glob.glob(os.path.join(glob.escape(log_dir), TARGETS_GLOB))):
        if ".tmp." in os.path.basename(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, list):
            groups.extend(data)
    return groups


__all__ = [
    "FAILURES",
    "JOB_STATE",
    "JOB_STATE_FILE",
    "JOB_STATE_GLOB",
    "PROCESSES_UP",
    "RESTARTS",
    "TARGETS_FILE",
    "TARGETS_GLOB",
    "FailureCause",
    "JobMonitor",
    "JobState",
    "MemberView",
    "ProcRecord",
    "ProcState",
    "cause_of",
    "job_state_file",
    "job_state_paths",
    "merge_job_states",
    "node_file",
    "read_job_states",
    "read_targets",
    "targets_file",
    "write_json_atomic",
]
