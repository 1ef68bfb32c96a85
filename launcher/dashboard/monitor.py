"""The dashboard's poller: read ``job_state.json``, scrape every process, keep bounded history.

One background thread (:meth:`Monitor.run`) polls every ``poll_interval_s``: it re-reads the
launcher's ``job_state.json`` and ``metrics_targets.json`` in the job's ``log_dir`` (a job of
several nodes: every node's ``job_state.node<R>.json`` / ``metrics_targets.node<R>.json``,
merged by :func:`launcher.telemetry.read_job_states`), scrapes the
``/metrics`` page of every process that is up (in parallel, each bounded by a timeout), and
appends to fixed-size time series (``collections.deque(maxlen=...)``). :meth:`Monitor.snapshot`
turns the latest state into the plain JSON the page polls. Rates (throughput, QPS) and the
step-time breakdown come from the difference of two scrapes ``rate_window_s`` apart, so a
restarted process (counters back at 0) only loses one window.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from launcher.dashboard.config import DashboardConfig
from launcher.dashboard.scrape import (
    COMM_OPS,
    ENTRY_RESULTS,
    PHASES,
    LauncherStats,
    ScrapeError,
    ServerStats,
    TrainerStats,
    fetch_metrics,
    launcher_stats,
    parse_samples,
    server_stats,
    trainer_stats,
)
from launcher.telemetry import read_job_states, read_targets

logger = logging.getLogger(__name__)

TERMINAL_STATES = frozenset({"succeeded", "failed", "stopped"})


@dataclass(frozen=True)
class Target:
    """A process the dashboard knows about (from job_state.json or metrics_targets.json)."""

    role: str
    rank: int
    host: str
    address: str | None
    """``host:port`` of its ``/metrics``, when it has one."""
    info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """The process record from job_state.json (pid, state, exit_code, signal, log)."""

    @property
    def key(self) -> str:
        """The series label: ``rank 1`` for trainers, ``server 0`` for PS servers, ``heter 0`` for
        heter workers."""
        return f"rank {self.rank}" if self.role == "trainer" else f"{self.role} {self.rank}"


def _as_int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def targets_from(job: dict[str, Any] | None, sd: Any) -> list[Target]:
    """Every process: job_state.json's list, plus file_sd entries it lacks (launcher excluded)."""
    out: dict[tuple[str, int], Target] = {}
    for p in (job or {}).get("processes") or []:
        if isinstance(p, dict):
            t = Target(
                str(p.get("role", "?")),
                _as_int(p.get("rank")),
                str(p.get("host", "")),
                p.get("metrics") or None,
                p,
            )
            out[(t.role, t.rank)] = t
    for group in sd if isinstance(sd, list) else []:
        labels = group.get("labels", {}) if isinstance(group, dict) else {}
        role = str(labels.get("role", "?"))
        if role == "launcher":
            continue
        for addr in group.get("targets", []) if isinstance(group, dict) else []:
            key = (role, _as_int(labels.get("rank")))
            if key not in out:
                out[key] = Target(role, key[1], str(labels.get("host", "")), str(addr))
    return sorted(out.values(), key=lambda t: (t.role != "trainer", t.role, t.rank))


def _round(v: float | None, digits: int = 6) -> float | None:
    """``v`` to ``digits`` significant digits; None for None, NaN and infinities (not JSON)."""
    return None if v is None or not math.isfinite(v) else float(f"{v:.{digits}g}")


def thin(points: Any, limit: int) -> list:
    """At most ``limit`` of ``points``, evenly spaced, always with the newest one."""
    pts = list(points)
    if len(pts) <= limit:
        return pts
    step = len(pts) / (limit - 1)
    return [pts[int(i * step)] for i in range(limit - 1)] + [pts[-1]]


def clean(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


class History:
    """Recent scrapes of one process, for rates over a window."""

    def __init__(self, maxlen: int) -> None:
        self.items: deque[tuple[float, Any]] = deque(maxlen=maxlen)

    def add(self, t: float, stats: Any) -> None:
        self.items.append((t, stats))

    def pair(self, window_s: float) -> tuple[tuple[float, Any], tuple[float, Any]] | None:
        """(older, latest) about ``window_s`` apart (the oldest kept if the window is longer)."""
        if len(self.items) < 2:
            return None
        latest = self.items[-1]
        older = self.items[0]
        for item in self.items:
            if latest[0] - item[0] <= window_s:
                older = item
                break
        if older is latest:
            older = self.items[-2]
        return older, latest


def rate(a: float | None, b: float | None, dt: float) -> float | None:
    """Per-second increase of a counter from ``a`` to ``b``; None across a reset."""
    if a is None or b is None or dt <= 0 or b < a:
        return None
    return (b - a) / dt


def breakdown(older: TrainerStats | None, latest: TrainerStats) -> dict[str, float] | None:
    """Mean seconds per step over the window: ``step`` and its parts.

    A trainer that exports ``fleet_trainer_phase_seconds`` gets its phases (:data:`PHASES`;
    they add up to the step), with the all-reduce time shown apart from ``compute`` when the
    trainer has both (a hand-written data-parallel loop); an older trainer gets each comm op
    and ``compute`` (the rest of ``fleet_trainer_step_seconds``)."""
    if latest.phase_sum and latest.phase_count:
        return _phase_breakdown(older, latest)

    def per_step(o: TrainerStats | None) -> tuple[float, float, dict[str, float]] | None:
        if latest.step_count is None or latest.step_sum is None:
            return None
        n, s = latest.step_count, latest.step_sum
        comm = dict(latest.comm_sum)
        if o is not None and o.step_count is not None and o.step_sum is not None:
            n, s = n - o.step_count, s - o.step_sum
            comm = {op: v - o.comm_sum.get(op, 0.0) for op, v in comm.items()}
        return (n, s, comm) if n > 0 and s >= 0 else None

    got = per_step(older) or per_step(None)
    if got is None:
        return None
    n, s, comm = got
    out = {"step": s / n}
    for op in COMM_OPS:
        out[op] = max(0.0, comm.get(op, 0.0) / n)
    out["compute"] = max(0.0, out["step"] - sum(out[op] for op in COMM_OPS))
    return {k: _round(v) for k, v in out.items()}  # type: ignore[misc]


def _phase_breakdown(older: TrainerStats | None, latest: TrainerStats) -> dict[str, float] | None:
    """:func:`breakdown` from the phase histograms (the window's difference, else cumulative)."""
    n = latest.phase_count or 0.0
    sums = dict(latest.phase_sum)
    ar = latest.comm_sum.get("all_reduce", 0.0)
    if older is not None and older.phase_count is not None and 0 < older.phase_count < n:
        n -= older.phase_count
        sums = {p: v - older.phase_sum.get(p, 0.0) for p, v in sums.items()}
        ar -= older.comm_sum.get("all_reduce", 0.0)
    if n <= 0:
        return None
    out = {p: max(0.0, sums.get(p, 0.0) / n) for p in PHASES}
    out["step"] = sum(out.values())
    if ar > 0 and out["compute"] > 0:  # DDP's all-reduce runs inside the loop's compute
        out["all_reduce"] = min(out["compute"], ar / n)
        out["compute"] -= out["all_reduce"]
    return {k: _round(v) for k, v in out.items()}  # type: ignore[misc]


class Monitor:
    """Polls one job's log_dir and holds what the dashboard shows (thread-safe)."""

    def __init__(self, config: DashboardConfig) -> None:
        self.config = config
        self.log_dir = os.path.abspath(config.log_dir)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dashboard-scrape")
        self.job: dict[str, Any] | None = None
        self.job_error: str | None = None
        self.targets: list[Target] = []
        self.scrape_errors: dict[str, str] = {}
        self.last_ok: dict[str, float] = {}
        self.history: dict[str, History] = {}
        self.launcher: LauncherStats | None = None
        self.series: dict[str, dict[str, deque[tuple[float, float]]]] = {}
        self.polls = 0
        self.last_poll: float | None = None

    # ---- polling -------------------------------------------------------------------------
    def _append(self, chart: str, label: str, t: float, v: float | None) -> None:
        if v is None or not math.isfinite(v):
            return
        lines = self.series.setdefault(chart, {})
        line = lines.get(label)
        if line is None:
            line = lines[label] = deque(maxlen=self.config.max_points)
        line.append((round(t, 2), _round(v)))  # type: ignore[arg-type]

    def _scrape(self, address: str) -> tuple[Any, str | None]:
        try:
            return parse_samples(fetch_metrics(address, self.config.scrape_timeout_s)), None
        except ScrapeError as err:
            return None, str(err)

    def poll_once(self) -> None:
        """One round: re-read the state files, scrape every live process, update history."""
        job, job_error = read_job_states(self.log_dir)  # every node's file, merged
        sd = read_targets(self.log_dir)
        with self._lock:
            if self.job is None or (job is not None and job_error is None):
                self.job, self.job_error = job, job_error
            elif job_error:  # keep the last good state through a bad read (of any node), say so
                self.job_error = job_error
            job = self.job
            # the process list changes together with the job state it came from (a snapshot
            # between here and the end of the scrape must not pair a new attempt with old pids)
            targets = self.targets = targets_from(job, sd)
        finished = bool(job) and job.get("state") in TERMINAL_STATES
        wanted = [
            t for t in targets if t.address and t.info.get("state", "up") == "up" and not finished
        ]
        launcher_addr = None if finished else (job or {}).get("launcher_metrics")
        jobs = [(t.key, t.address) for t in wanted]
        if launcher_addr:
            jobs.append(("launcher", str(launcher_addr)))
        results = list(self._pool.map(lambda kv: (kv[0], *self._scrape(kv[1])), jobs))
        now = time.time()
        by_key = {t.key: t for t in targets}
        with self._lock:
            for key in set(self.scrape_errors) - {k for k, _ in jobs}:  # no longer scraped
                del self.scrape_errors[key]
            for key, samples, err in results:
                if err is not None:
                    self.scrape_errors[key] = err
                    continue
                self.scrape_errors.pop(key, None)
                self.last_ok[key] = now
                if key == "launcher":
                    self.launcher = launcher_stats(samples)
                    continue
                role = by_key[key].role
                stats = (  # a heter worker reports as a trainer does (its dense steps)
                    trainer_stats(samples)
                    if role in ("trainer", "heter")
                    else server_stats(samples)
                )
                hist = self.history.setdefault(key, History(self.config.history_scrapes))
                hist.add(now, stats)
                self._record(key, hist, now)
            self.polls += 1
            self.last_poll = now

    def _record(self, key: str, hist: History, now: float) -> None:
        latest = hist.items[-1][1]
        pair = hist.pair(self.config.rate_window_s)
        if isinstance(latest, TrainerStats):
            self._append("loss", key, now, latest.loss)
            if not latest.steps:  # still starting: a throughput of 0 says nothing
                return
            thr = latest.throughput
            if thr is None and pair:
                (t0, a), (t1, b) = pair
                thr = rate(a.samples, b.samples, t1 - t0)
            self._append("throughput", key, now, thr)
            if pair:
                (t0, a), (t1, b) = pair
                self._append("steps_per_s", key, now, rate(a.steps, b.steps, t1 - t0))
        elif isinstance(latest, ServerStats):
            for table, ts in latest.tables.items():
                self._append("ps_rows", f"{table} @ {key}", now, ts.rows)
                if pair:
                    (t0, a), (t1, b) = pair
                    old = a.tables.get(table)
                    self._append(
                        "ps_qps",
                        f"{table} @ {key}",
                        now,
                        rate(old.requests if old else 0.0, ts.requests, t1 - t0),
                    )

    def run(self) -> None:
        """Poll every ``poll_interval_s`` until :meth:`stop` (the caller took the first poll;
        errors in one round are logged, never fatal)."""
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                self.poll_once()
            except Exception:  # the dashboard must outlive one bad round; say what broke
                logger.exception("dashboard poll of %s failed", self.log_dir)

    def stop(self) -> None:
        """Ask :meth:`run` to end after the current round."""
        self._stop.set()

    def close(self) -> None:
        """Stop, and release the scrape threads (call after :meth:`run` returned)."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the JSON the page polls ---------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, as plain JSON-able data."""
        with self._lock:
            job = dict(self.job) if self.job else None
            out = clean(
                {
                    "log_dir": self.log_dir,
                    "now": time.time(),
                    "polls": self.polls,
                    "last_poll": self.last_poll,
                    "job": {k: v for k, v in job.items() if k != "processes"} if job else None,
                    "job_error": self.job_error,
                    "failure_summary": (job or {}).get("failure_summary"),
                    "processes": [self._process_view(t, job) for t in self.targets],
                    "launcher": self._launcher_view(),
                    "breakdown": self._breakdown_view(),
                    "tables": self._tables_view(),
                    "scrape_errors": dict(self.scrape_errors),
                }
            )
            # points are finite by construction (_append): no clean() walk over the bulk
            cfg = self.config
            out["series"] = {}
            for chart, lines in self.series.items():
                limit = max(
                    2, min(cfg.max_points_out, cfg.max_points_per_chart // max(1, len(lines)))
                )
                out["series"][chart] = {
                    label: thin(pts, limit) for label, pts in sorted(lines.items())
                }
            return out

    def _process_view(self, t: Target, job: dict[str, Any] | None) -> dict[str, Any]:
        hist = self.history.get(t.key)
        latest = hist.items[-1][1] if hist and hist.items else None
        info = t.info
        view = {
            "key": t.key,
            "role": t.role,
            "rank": t.rank,
            "host": t.host,
            "metrics": t.address,
            "pid": info.get("pid"),
            "state": info.get("state", "unknown"),
            "exit_code": info.get("exit_code"),
            "signal": info.get("signal"),
            "restarts": (job or {}).get("restarts"),
            "log_url": f"/logs/{t.role}/{t.rank}" if info.get("log") else None,
            "log": info.get("log"),
            "scrape_error": self.scrape_errors.get(t.key),
            "last_scrape": self.last_ok.get(t.key),
        }
        if isinstance(latest, TrainerStats):
            view.update(steps=latest.steps, loss=_round(latest.loss), samples=latest.samples)
        return view

    def _launcher_view(self) -> dict[str, Any] | None:
        s = self.launcher
        if s is None:
            return None
        return {
            "state": s.state,
            "processes_up": s.processes_up,
            "restarts": s.restarts,
            "failures": s.failures,
        }

    def _breakdown_view(self) -> list[dict[str, Any]]:
        out = []
        for key, hist in sorted(self.history.items()):
            if not hist.items or not isinstance(hist.items[-1][1], TrainerStats):
                continue
            pair = hist.pair(self.config.rate_window_s)
            got = breakdown(pair[0][1] if pair else None, hist.items[-1][1])
            if got:
                out.append({"key": key, **got})
        return out

    def _tables_view(self) -> list[dict[str, Any]]:
        agg: dict[str, dict[str, Any]] = {}
        for hist in self.history.values():
            if not hist.items or not isinstance(hist.items[-1][1], ServerStats):
                continue
            latest: ServerStats = hist.items[-1][1]
            pair = hist.pair(self.config.rate_window_s)
            for table, ts in latest.tables.items():
                row = agg.setdefault(
                    table,
                    {
                        "table": table,
                        "servers": 0,
                        "rows": 0.0,
                        "bytes": 0.0,
                        "qps": 0.0,
                        "requests": 0.0,
                        "errors": 0.0,
                        **{r: 0.0 for r in ENTRY_RESULTS},
                        "kind": "",
                        "nodes": None,
                        "edges": None,
                        "samples": 0.0,
                        "sample_ms": None,
                        "_window": [0.0, 0.0],
                    },
                )
                row["servers"] += 1
                if ts.kind == "graph":
                    row["kind"] = "graph"
                    row["nodes"] = (row["nodes"] or 0.0) + (ts.nodes or 0.0)
                    row["edges"] = (row["edges"] or 0.0) + (ts.edges or 0.0)
                    row["samples"] += ts.samples
                    old_g = pair[0][1].tables.get(table) if pair else None
                    row["_window"][0] += ts.sample_seconds - (
                        old_g.sample_seconds if old_g else 0.0
                    )
                    row["_window"][1] += ts.samples - (old_g.samples if old_g else 0.0)
                row["rows"] += ts.rows or 0.0
                row["bytes"] += ts.bytes or 0.0
                row["requests"] += ts.requests
                row["errors"] += ts.errors
                for r in ENTRY_RESULTS:
                    row[r] += ts.entry.get(r, 0.0)
                if pair:
                    (t0, a), (t1, _) = pair
                    old = a.tables.get(table)
                    row["qps"] += rate(old.requests if old else 0.0, ts.requests, t1 - t0) or 0.0
        for row in agg.values():  # mean sampling latency over the rate window (else since start)
            seconds, count = row.pop("_window")
            if count > 0:
                row["sample_ms"] = 1000.0 * seconds / count
        return [
            {k: _round(v) if isinstance(v, float) else v for k, v in row.items()}
            for _, row in sorted(agg.items())
        ]
