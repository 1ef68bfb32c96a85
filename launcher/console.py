"""fleetrun's compact live status line: processes up, steps/s, last loss.

A daemon thread (off the agent's hot path) reads the :class:`~launcher.telemetry.JobMonitor`'s
process list, scrapes the trainers' ``/metrics`` endpoints (1 s timeout each) and prints one
line: with rich, every :data:`TTY_INTERVAL_S` seconds, when stderr is a terminal; plain text
every :data:`PLAIN_INTERVAL_S` seconds otherwise (CI logs, pipes), and only while trainers
report steps. With metrics off there is nothing to scrape and the thread does not start.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

TTY_INTERVAL_S = 5.0
"""Seconds between status lines on a terminal."""
PLAIN_INTERVAL_S = 30.0
"""Seconds between status lines when stderr is not a terminal."""
SCRAPE_TIMEOUT_S = 1.0


def scrape(endpoint: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """``{sample name: value}`` of the label-less samples at ``http://ENDPOINT/metrics``
    (empty when the endpoint does not answer)."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", errors="replace")
    except (OSError, urllib.error.URLError, ValueError):
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = float(sample.value)
    return out


@dataclass(frozen=True)
class Status:
    """One status line's numbers."""

    up: int
    total: int
    steps: float
    steps_per_s: float | None
    loss: float | None
    samples_per_s: float | None
    membership: str | None = None
    """Elastic jobs: ``N membership change(s), last: ...`` (None without changes)."""
    recoveries: str | None = None
    """PS jobs with automatic checkpoints: ``N PS recovery(ies), last: ...`` (None without)."""

    def text(self) -> str:
        """``2/2 up | step 120 | 9.8 steps/s | loss 0.4312 | 640 samples/s``."""
        parts = [f"{self.up}/{self.total} up", f"step {int(self.steps)}"]
        if self.steps_per_s is not None:
            parts.append(f"{self.steps_per_s:.1f} steps/s")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4g}")
        if self.samples_per_s:
            parts.append(f"{self.samples_per_s:.0f} samples/s")
        if self.membership:
            parts.append(self.membership)
        if self.recoveries:
            parts.append(self.recoveries)
        return " | ".join(parts)


class StatusConsole:
    """The status thread; :meth:`start` / :meth:`stop` (bounded join)."""

    def __init__(self, monitor: Any, stream: Any = None) -> None:
        self.monitor = monitor
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = TTY_INTERVAL_S if self.tty else PLAIN_INTERVAL_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[float, float] | None = None  # (time, rank-0 steps)
        self._rich: Any = None

    def start(self) -> None:
        """Start the thread (not with metrics off)."""
        if not self.monitor.metrics_enabled:
            return
        if self.tty:
            try:
                from rich.console import Console

                self._rich = Console(file=self.stream, highlight=False)
            except ImportError:  # rich is an optional extra: plain lines then
                self._rich = None
        self._thread = threading.Thread(target=self._loop, name="fleetrun-status", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (waits at most one scrape round)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def poll(self) -> Status | None:
        """Scrape the trainers once; None while no trainer answers."""
        snap = self.monitor.snapshot()
        procs = snap["processes"]
        changes = snap.get("membership_changes") or []
        membership = (
            f"{len(changes)} membership change(s), last: {changes[-1]}" if changes else None
        )
        recovered = snap.get("recoveries") or []
        recoveries = (
            f"{len(recovered)} PS recovery(ies), last: {recovered[-1]}" if recovered else None
        )
        trainers = sorted(
            (p for p in procs if p["role"] == "trainer" and p["metrics"]), key=lambda p: p["rank"]
        )
        up = sum(1 for p in procs if p["state"] == "up")
        scraped = [scrape(p["metrics"]) for p in trainers if p["state"] == "up"]
        scraped = [s for s in scraped if s]
        if not scraped:
            return None
        steps = scraped[0].get("fleet_trainer_steps_total", 0.0)
        now = time.monotonic()
        rate = None
        if self._last is not None and now > self._last[0] and steps >= self._last[1]:
            rate = (steps - self._last[1]) / (now - self._last[0])
        self._last = (now, steps)
        losses = [s["fleet_trainer_loss"] for s in scraped if "fleet_trainer_loss" in s]
        thr = [s.get("fleet_trainer_throughput_samples_per_second", 0.0) for s in scraped]
        return Status(
            up,
            len(procs),
            steps,
            rate,
            sum(losses) / len(losses) if losses else None,
            sum(thr) or None,
            membership,
            recoveries,
        )

    def _emit(self, status: Status) -> None:
        if self._rich is not None:
            self._rich.print(
                f"[bold cyan]fleetrun[/] [dim]{time.strftime('%H:%M:%S')}[/] {status.text()}"
            )
        else:
            self.stream.write(f"[fleetrun] status: {status.text()}\n")
            self.stream.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                status = self.poll()
                if status is not None and status.steps > 0:
                    self._emit(status)
            except Exception:  # the status line must never take fleetrun down
                logger.debug("status line failed", exc_info=True)


__all__ = ["Status", "StatusConsole", "scrape"]
