"""Automatic checkpoints of a PS job and the resume from them, with no change to the training
script (fleetrun ``--ps_checkpoint_dir/--ps_checkpoint_interval/--ps_checkpoint_keep``, handed
to the trainers as FLEET_PS_CHECKPOINT_*).

- **Resume.** When the script builds its optimizer (``fleet.distributed_optimizer``, after
  ``fleet.init_worker``), every trainer calls :func:`fleet.ps.load_latest`: trainer 0 loads the
  newest good checkpoint of the directory into every server (falling back past a partial or
  corrupt one, and saying so), and each trainer continues from its data position stored in that
  checkpoint (:mod:`fleet.base.data_position`: the fleet.data datasets skip the batches already
  trained). No checkpoint: a fresh start.
- **Cuts.** Every ``optimizer.step()`` is a step boundary. The trainers agree on the steps to cut
  at without a collective per step: at a *probe* step (first :data:`PROBE_STEPS`, then each
  computed) they gather trainer 0's elapsed time since the last checkpoint; when it reached
  ``interval_s`` they checkpoint (:func:`fleet.ps.checkpoint`: a consistent cut, written in the
  background), and from trainer 0's step rate every trainer computes the same next probe step.
  Every trainer must therefore run the same number of steps (as sync mode needs anyway; the CTR
  example evens them with ``fleet.metrics.min``).
- **Failures.** A checkpoint that fails (in async/GEO mode fleetrun restarts a dead server alone
  while the trainers go on: a checkpoint taken meanwhile, or one whose commit waited on that
  server's part, fails) is logged and skipped: the trainers train on and try again an interval
  later; the error reaches every trainer alike (:func:`fleet.ps.recovery.checkpoint` agrees on
  trainer 0's outcome), so none waits for the others in a collective.
- **Progress.** Each trainer keeps ``LOG_DIR/ps_progress.<rank>.json`` (tmp + rename, at most once
  a second): its step, the checkpoint it resumed from and when its first step after the resume
  ran. fleetrun reads it to report the work a recovery redid (:mod:`launcher.ps_recovery`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from collective.env import PSCheckpointEnv, TrainingRole, read_ps_checkpoint_env
from collective.errors import FleetError
from fleet.base.data_position import DataPosition, tracker
from fleet.ps import recovery
from fleet.ps.runtime import _require

logger = logging.getLogger(__name__)

PROBE_STEPS = 10
"""The first step at which the trainers compare notes on time (then as computed)."""
PROGRESS_PERIOD_S = 1.0
"""Least seconds between two writes of the progress file."""


@dataclass
class AutoCheckpointer:
    """One trainer's side of the automatic checkpoints."""

    cfg: PSCheckpointEnv
    rank: int
    log_dir: str | None
    restart_count: int = 0
    next_probe: int = PROBE_STEPS
    last_time: float = field(default_factory=time.monotonic)
    last_step: int = 0
    resumed: dict[str, Any] = field(default_factory=dict)
    first_step_unix: float | None = None
    checkpoint_step: int | None = None
    """Step of the last checkpoint this process took part in (its commit may still run)."""
    failed: int = 0
    """Checkpoints that failed and were skipped (e.g. a server restarted while it was taken, or
    the previous one's commit lost a server's part)."""
    mode: str = ""
    """The communicator's mode (``sync``/``async``/``geo``...): fleetrun restarts a dead server
    alone in async/GEO mode (:mod:`launcher.ps_recovery`)."""
    interval_cuts: bool = True
    """Cut every ``interval_s`` at probe steps. False: the caller cuts and reports each cut with
    :meth:`record_cut` (``fleet.train_days`` cuts at its pass boundaries: :mod:`fleet.streaming`)."""
    resumed_state: Any = None
    """This trainer's state in the checkpoint it resumed from (None: a fresh start)."""
    _written: float = 0.0

    # -- resume ----------------------------------------------------------------------------------
    def resume(self) -> None:
        """Load the newest good checkpoint (every trainer calls it); continue after its data
        position."""
        t0 = time.time()
        result = recovery.load_latest(self.cfg.dir)
        chosen = result.chosen
        if chosen is not None:
            state = chosen.trainer_states.get(self.rank) or {}
            self.resumed_state = state
            position = DataPosition.from_dict(state.get("data") if isinstance(state, dict) else None)
            tracker().resume(position)
            self.resumed = {"checkpoint": chosen.name, "step": chosen.step,
                            "position": position.to_dict(), "skipped": [list(s) for s in result.skipped],
                            "load_s": round(time.time() - t0, 3)}
            logger.warning("trainer %d resumed from %s (step %d, pass %d, %d steps into it)%s",
                           self.rank, chosen.name, chosen.step, position.pass_index,
                           position.step_in_pass,
                           "; skipped " + "; ".join(f"{n}: {w}" for n, w in result.skipped)
                           if result.skipped else "")
        self.last_step = tracker().step
        self.next_probe = self.last_step + PROBE_STEPS
        self.last_time = time.monotonic()
        self._write_progress(force=True)

    # -- every step ------------------------------------------------------------------------------
    def after_step(self) -> None:
        """A step boundary: count it; at a probe step agree on a checkpoint with the others."""
        track = tracker()
        track.on_step()
        if self.first_step_unix is None:
            self.first_step_unix = time.time()
            self._write_progress(force=True)
        else:
            self._write_progress()
        if not self.interval_cuts or track.step < self.next_probe:
            return
        step = track.step
        elapsed = time.monotonic() - self.last_time
        (_, elapsed0, steps0), *_ = recovery._gather((self.rank, elapsed, step - self.last_step))
        rate = steps0 / max(elapsed0, 1e-6)  # trainer 0's steps per second: the same everywhere
        interval = self.cfg.interval_s
        if elapsed0 >= interval * 0.95:
            position = track.position()
            try:
                recovery.checkpoint(self.cfg.dir, step, trainer_state={"data": position.to_dict()},
                                    keep=self.cfg.keep)
                self.checkpoint_step = step
            except FleetError as err:  # every trainer gets the same error (recovery._agree)
                self.failed += 1
                logger.warning("trainer %d: automatic checkpoint at step %d failed, skipped to "
                               "the next interval: %s", self.rank, step, err)
            self.last_time, self.last_step = time.monotonic(), step
            self.next_probe = step + max(1, round(interval * rate))
            self._write_progress(force=True)
        else:
            self.next_probe = step + max(1, round((interval - elapsed0) * rate))

    def record_cut(self, step: int | None) -> None:
        """The caller took a checkpoint at ``step`` (None: it failed) with ``interval_cuts`` off:
        the progress file says so (fleetrun's recovery report reads it)."""
        if step is None:
            self.failed += 1
        else:
            self.checkpoint_step = step
            self.last_time, self.last_step = time.monotonic(), tracker().step
        self._write_progress(force=True)

    def finish(self) -> None:
        """Training ended (``fleet.stop_worker``): write the progress file a last time."""
        self._write_progress(force=True)

    def _write_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.log_dir is None or (not force and now - self._written < PROGRESS_PERIOD_S):
            return
        self._written = now
        data = {"rank": self.rank, "attempt": self.restart_count, "step": tracker().step,
                "unix": time.time(), "resumed": self.resumed, "first_step_unix": self.first_step_unix,
                "mode": self.mode, "checkpoints_failed": self.failed,
                **({"checkpoint_step": self.checkpoint_step} if self.checkpoint_step is not None else {})}
        path = os.path.join(self.log_dir, f"ps_progress.{self.rank}.json")
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError as err:  # progress is for the launcher's report only
            logger.debug("progress file %s not written: %s", path, err)


def start() -> AutoCheckpointer | None:
    """The trainer's automatic checkpointer, resumed (once per process); None when the job has
    no FLEET_PS_CHECKPOINT_DIR."""
    st = _require("distributed_optimizer()", TrainingRole.TRAINER)
    if st.auto_checkpoint is not None:
        return st.auto_checkpoint
    cfg = read_ps_checkpoint_env()
    if cfg is None:
        return None
    auto = AutoCheckpointer(cfg, st.env.rank, st.env.log_dir, st.env.restart_count)
    auto.mode = st.communicator.mode if st.communicator is not None else ""
    auto.resume()
    st.auto_checkpoint = auto
    return auto


__all__ = ["PROBE_STEPS", "AutoCheckpointer", "start"]
