"""The trainer recorder's per-process state, shared by the metrics hooks (:mod:`fleet.telemetry`)
and the step-phase clock (:mod:`fleet.telemetry.phases`): whether metrics are on, the step
counters, and the lock both parts' hooks hold. Both import it; it imports neither."""

from __future__ import annotations

import threading
from typing import Any


class RecorderState:
    """Per-process recorder state (touched by the training thread only, except ``loss``)."""

    def __init__(self) -> None:
        self.enabled = False
        """Metrics are on: an endpoint serves ``/metrics`` and the hooks record."""
        self.server: Any = None
        self.port = 0
        self.last_step: float | None = None
        self.forward_samples = 0
        self.samples_reported = False
        """True once the script called report(samples=...): the forward count is ignored."""
        self.window_start: float | None = None
        self.window_samples = 0
        self.window_steps = 0
        self.throughput_set = False
        self.loss: Any = None
        self.models: list[Any] = []
        """weakrefs of the DDP models whose runtime stats give the all-reduce time."""
        self.seen_iteration: dict[int, int] = {}
        self.steps = 0


recorder = RecorderState()
"""This process's recorder state."""
hooks_lock = threading.RLock()
"""Held by every hook that updates the step counters and phase totals: with
``train_from_dataset(thread_num=N)`` several training threads call them at once, and
``x += 1`` on shared state loses updates between threads."""

__all__ = ["RecorderState", "hooks_lock", "recorder"]
