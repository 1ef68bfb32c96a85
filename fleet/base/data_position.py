"""A trainer's data position: which pass over its data it is in, and how many steps of it are done.

The automatic checkpoints of a PS job (:mod:`fleet.ps.auto_checkpoint`) store this position with
each checkpoint, and a trainer that resumes from one skips what was already trained, with no
change to the training script:

- a *pass* is one iteration over a :mod:`fleet.data` dataset (``for batch in dataset``); passes
  are numbered in the order they start in this process;
- a *step* is one ``optimizer.step()`` of the PS optimizer (a step boundary); ``step_in_pass``
  counts the steps since the current pass started, so a script that reads one batch ahead
  (prefetch) still resumes after the last batch it trained.

On resume, passes before the checkpoint's pass yield nothing and report size 0
(``InMemoryDataset.get_memory_data_size``), and the checkpoint's pass skips its first
``step_in_pass`` batches and reports the examples left: a script that computes its step count
from the dataset's size (as ``examples/ctr/train_ps.py`` does) runs exactly the steps that are
left. Both need the same dataset order as the run that checkpointed: files in the same order and
a seeded shuffle (``set_shuffle_seed``), or none.

One tracker per process (:func:`tracker`), plain data; fleet.data and fleet.ps both use it, so it
lives below them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DataPosition:
    """Where a trainer is in its data, at a step boundary."""

    pass_index: int = 0
    """Passes over fleet.data datasets started before this one (0 = the first)."""
    step_in_pass: int = 0
    """Steps trained since this pass started (= batches of the pass trained)."""
    step: int = 0
    """Steps trained since the start of the job (every pass)."""

    def to_dict(self) -> dict[str, int]:
        return {"pass": self.pass_index, "step_in_pass": self.step_in_pass, "step": self.step}

    @classmethod
    def from_dict(cls, data: Any) -> DataPosition:
        """The position stored in a checkpoint's trainer state (missing keys = 0)."""
        if not isinstance(data, dict):
            return cls()
        return cls(
            int(data.get("pass", 0)), int(data.get("step_in_pass", 0)), int(data.get("step", 0))
        )


class PositionTracker:
    """Counts passes and steps; knows what a resumed trainer must skip."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.passes_started = 0
        self.step_in_pass = 0
        self.step = 0
        self.resume_from: DataPosition | None = None

    def resume(self, position: DataPosition) -> None:
        """Continue after ``position`` (a checkpoint's): the passes of this process, counted from
        its start, skip what it trained. Called before the first pass starts."""
        with self._lock:
            self.resume_from = position
            self.passes_started = 0
            self.step_in_pass = 0
            self.step = position.step

    def skip_batches(self, pass_index: int | None = None) -> int | None:
        """Batches the pass ``pass_index`` (default: the next one to start) skips: 0 without a
        resume point or after it, None for a pass trained entirely before it (skip it all)."""
        with self._lock:
            index = self.passes_started if pass_index is None else pass_index
            at = self.resume_from
        if at is None or index > at.pass_index:
            return 0
        if index < at.pass_index:
            return None
        return at.step_in_pass

    def begin_pass(self) -> int | None:
        """A pass starts: its index is taken; returns :meth:`skip_batches` of it."""
        with self._lock:
            index = self.passes_started
            self.passes_started += 1
            at = self.resume_from
            self.step_in_pass = at.step_in_pass if at is not None and index == at.pass_index else 0
        return self.skip_batches(index)

    def on_step(self) -> None:
        """One optimizer step was trained."""
        with self._lock:
            self.step += 1
            self.step_in_pass += 1

    def position(self) -> DataPosition:
        """The position now (for a checkpoint taken at this step boundary)."""
        with self._lock:
            return DataPosition(max(self.passes_started - 1, 0), self.step_in_pass, self.step)


_tracker = PositionTracker()


def tracker() -> PositionTracker:
    """This process's tracker."""
    return _tracker


def skip_examples(batch_size: int, num_examples: int) -> int:
    """Examples the next pass skips out of ``num_examples`` (all of them for a pass trained
    before the resume point)."""
    skip = _tracker.skip_batches()
    if skip is None:
        return num_examples
    return min(num_examples, skip * batch_size)


__all__ = ["DataPosition", "PositionTracker", "skip_examples", "tracker"]
