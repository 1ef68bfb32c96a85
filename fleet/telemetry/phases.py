"""Step-phase timing: where a step's time went (``fleet_trainer_phase_seconds{phase}``).

``fleet.train_from_dataset`` times every phase of its loop itself (:class:`PhaseTimer`); a
hand-written loop gets what fleet sees without its help: data from the :mod:`fleet.data`
iterators (:func:`phase_clock` / :func:`add_phase`), pull wait and push/optimizer from the PS
communicator (:func:`fleet.telemetry.instrument_communicator`), the rest as ``compute`` when a
step ends (:func:`end_step`, called by :func:`fleet.telemetry.on_step`). The hooks accumulate
while timing is on: metrics on, or a :class:`PhaseTimer` loop running; otherwise
:func:`phase_clock` returns 0.0 after one flag check.

Every name here is also importable from :mod:`fleet.telemetry`.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import HistogramMetricFamily

from fleet.telemetry.state import hooks_lock, recorder

PHASES = ("data", "pull_wait", "forward", "backward", "push_optimizer", "other", "compute")
"""``phase`` label values of ``fleet_trainer_phase_seconds``. ``data``: waiting for the next batch;
``pull_wait``: a forward waiting for PS rows (the communicator's ``pull_sparse`` on the training
thread, a prefetch's wait included); ``forward`` (loss included, pull wait excluded);
``backward``; ``push_optimizer``: ``optimizer.step()`` (the PS push included) and
``zero_grad``; ``other``: the rest of the step (loss bookkeeping, AUC, progress lines).
``compute`` replaces forward + backward + other where fleet cannot tell them apart (a
hand-written loop). The phases of one step add up to its step time."""
LOOP_PHASES = ("data", "pull_wait", "forward", "backward", "push_optimizer", "other")
"""The phases a :class:`PhaseTimer` loop times (``compute`` is split into forward, backward and
other there)."""
SEEN_PHASES = ("data", "pull_wait", "push_optimizer")
"""The phases fleet's hooks accumulate by themselves (a hand-written loop's breakdown)."""
FINE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
"""Seconds, 100 µs to 2.5 s: the bounds the phase and the communication histograms
(``fleet.telemetry.COMM_BUCKETS``) share; each adds its own longer ones."""
PHASE_BUCKETS = (*FINE_BUCKETS, 5.0, 10.0, 60.0)
"""Seconds; :data:`FINE_BUCKETS`, then 5, 10 and 60 s."""


class PhaseHistograms:
    """``fleet_trainer_phase_seconds{phase}``: a histogram per phase, kept as plain bucket
    counts that the training threads write under the hooks' lock (:data:`hooks_lock`, which the
    callers hold: cheaper than a ``prometheus_client`` observation, six of which happen per
    step) and turned into one histogram family when scraped. A scrape may see a step's phases
    half observed."""

    name = "fleet_trainer_phase_seconds"
    doc = "Time of each step spent in a phase (the phases of a step add up to its step time)"

    def __init__(self) -> None:
        self.counts = {p: [0] * (len(PHASE_BUCKETS) + 1) for p in PHASES}
        self.sums = dict.fromkeys(PHASES, 0.0)

    def observe(self, phase: str, seconds: float) -> None:
        """One step's time in ``phase``."""
        self.counts[phase][bisect.bisect_left(PHASE_BUCKETS, seconds)] += 1
        self.sums[phase] += seconds

    def count(self, phase: str) -> int:
        """Observations of ``phase`` so far."""
        return sum(self.counts[phase])

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.doc, labels=["phase"])]

    def collect(self) -> list[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=["phase"])
        for phase in PHASES:
            counts = list(self.counts[phase])
            if not any(counts):
                continue
            buckets, acc = [], 0
            for bound, n in zip((*map(str, PHASE_BUCKETS), "+Inf"), counts):
                acc += n
                buckets.append((bound, acc))
            fam.add_metric([phase], buckets, self.sums[phase])
        return [fam]


PHASE_SECONDS = PhaseHistograms()
REGISTRY.register(PHASE_SECONDS)


class _Phases:
    """Seconds the phase hooks accumulated (totals that only grow; readers keep snapshots)."""

    def __init__(self) -> None:
        self.on = False
        """Hooks accumulate: metrics on, or a :class:`PhaseTimer` loop running."""
        self.loops = 0
        """:class:`PhaseTimer` loops running (they observe their own phases)."""
        self.total = dict.fromkeys(SEEN_PHASES, 0.0)
        self.mark = dict(self.total)
        """``total`` at the last step end (:func:`end_step`)."""


_phases = _Phases()


def update_phase_timing() -> None:
    """Turn the phase hooks on or off after metrics started or stopped (``fleet.telemetry.start``
    / ``stop``) or a :class:`PhaseTimer` loop entered or left."""
    _phases.on = recorder.enabled or _phases.loops > 0


def phase_clock() -> float:
    """``time.perf_counter()`` while phase timing is on, else 0.0 (then :func:`add_phase` does
    nothing): the two calls around a part of the step a hook times."""
    return time.perf_counter() if _phases.on else 0.0


def add_phase(phase: str, since: float) -> None:
    """Add the time since ``since`` (a :func:`phase_clock` value) to ``phase`` (one of
    :data:`SEEN_PHASES`)."""
    if since:
        took = time.perf_counter() - since
        with hooks_lock:
            _phases.total[phase] += took


def pull_wait_seconds() -> float:
    """Seconds this process's training thread waited in PS pulls so far (while timing was on)."""
    return _phases.total["pull_wait"]


def end_step(step_s: float | None) -> None:
    """A step of ``step_s`` seconds ended (None: the first, its start unknown; the caller holds
    :data:`hooks_lock`). Outside a :class:`PhaseTimer` loop (a hand-written loop) observe what
    the hooks saw since the last step end, the rest as ``compute``."""
    total, mark = _phases.total, _phases.mark
    if step_s is not None and not _phases.loops:  # a PhaseTimer loop observes its own phases
        seen = 0.0
        for phase in SEEN_PHASES:
            d = max(0.0, total[phase] - mark[phase])
            seen += d
            PHASE_SECONDS.observe(phase, d)
        PHASE_SECONDS.observe("compute", max(0.0, step_s - seen))
    _phases.mark = dict(total)


class PhaseTimer:
    """The phase clock of a loop that times every phase itself (``fleet.train_from_dataset``).

    Used as a context manager around the loop: inside, the pull-wait hook runs even with
    metrics off, and ``fleet.telemetry.on_step`` leaves the phase histograms to this timer. Each
    :meth:`add` is one step (seconds per :data:`LOOP_PHASES` phase): observed in
    ``fleet_trainer_phase_seconds`` when metrics are on, and summed in :attr:`total` and
    :attr:`period` (the caller resets ``period`` when it prints).
    """

    def __init__(self) -> None:
        self.total = [0.0] * len(LOOP_PHASES)
        self.period = [0.0] * len(LOOP_PHASES)

    def __enter__(self) -> PhaseTimer:
        with hooks_lock:
            _phases.loops += 1
            update_phase_timing()
        return self

    def __exit__(self, *exc: Any) -> None:
        with hooks_lock:
            _phases.loops -= 1
            update_phase_timing()

    def add(self, *seconds: float) -> None:
        """One step's phases, in :data:`LOOP_PHASES` order."""
        with hooks_lock:
            total, period = self.total, self.period
            for i, s in enumerate(seconds):
                total[i] += s
                period[i] += s
            if recorder.enabled:
                for phase, s in zip(LOOP_PHASES, seconds):
                    PHASE_SECONDS.observe(phase, s)

    def reset_period(self) -> None:
        with hooks_lock:
            self.period = [0.0] * len(LOOP_PHASES)


__all__ = [
    "FINE_BUCKETS",
    "LOOP_PHASES",
    "PHASES",
    "PHASE_BUCKETS",
    "PHASE_SECONDS",
    "SEEN_PHASES",
    "PhaseHistograms",
    "PhaseTimer",
    "add_phase",
    "end_step",
    "phase_clock",
    "pull_wait_seconds",
    "update_phase_timing",
]
