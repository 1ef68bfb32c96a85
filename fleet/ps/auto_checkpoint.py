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
  example evens them with ``fleet.metrics.min`` in sync and half-async mode). Async/GEO trainers
  that meet through fleetrun's coordinator are cut by its epochs instead, with no such rule.
- **Failures.** A checkpoint that fails (in async/GEO mode fleetrun restarts a dead server alone
  while the trainers go on: a checkpoint taken meanwhile, or one whose commit waited on that
  server's part, fails) is logged and skipped: the trainers train on and try again an interval
  later; the error reaches every trainer alike (:func:`fleet.ps.recovery.checkpoint` agrees on
  trainer 0's outcome), so none waits for the others in a collective.
- **Async/half-async/GEO trainers restarted alone.** When fleetrun hosts a coordinator
  (:mod:`fleet.base.coordination`; async, half-async or GEO mode) the trainers need not cut at
  the same step: the coordinator opens a checkpoint *epoch* every ``interval_s``; a background thread of
  each trainer learns of it, and at its next step boundary the trainer flushes and cuts with its
  own data position; the lowest cutting rank takes the snapshot with every trainer's position (a
  dead or busy trainer's last reported one) and the others wait for it, as above. The
  checkpoint's step is the largest trainer step. An epoch that opens while the servers still
  write the leader's previous checkpoint is deferred (nobody waits; the next epoch cuts), so a
  disk slower than the interval stretches the interval instead of stalling every trainer at
  every cut. A trainer that fleetrun restarted alone
  (FLEET_PS_RESUME_POSITION: its data position from its progress file) loads no checkpoint: it
  skips the data it had trained and goes on, the servers untouched.
- **The day/pass loop** (``fleet.train_days``, :mod:`fleet.streaming`) turns the interval cuts
  off (``interval_cuts``) and cuts at its pass boundaries itself, reporting each with
  :meth:`AutoCheckpointer.record_cut`; it keeps trainer 0 from being restarted alone
  (``restart_alone``): trainer 0's replayed loop would redo its saves.
- **Progress.** Each trainer keeps ``LOG_DIR/ps_progress.<rank>.json`` (tmp + rename, at most once
  a second): its step and data position, the checkpoint it resumed from and when its first step
  after the resume ran. fleetrun reads it to report the work a recovery redid (:mod:`launcher.recovery.ps_policy`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from collective.env import (
    FLEET_PS_RESUME_POSITION,
    PSCheckpointEnv,
    TrainingRole,
    read_ps_checkpoint_env,
)
from collective.errors import ConfigError, FleetError
from fleet.base import coordination
from fleet.base.data_position import DataPosition, tracker
from fleet.ps import pass_cache, recovery, threads
from fleet.ps.runtime import _require, get_client, get_communicator

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
    alone in async/GEO mode (:mod:`launcher.recovery.ps_policy`)."""
    interval_cuts: bool = True
    """Cut every ``interval_s`` at probe steps. False: the caller cuts and reports each cut with
    :meth:`record_cut` (``fleet.train_days`` cuts at its pass boundaries: :mod:`fleet.streaming`)."""
    resumed_state: Any = None
    """This trainer's state in the checkpoint it resumed from (None: a fresh start)."""
    restart_alone: bool = True
    """False: this trainer may not be restarted alone (its progress file says so, and fleetrun
    restarts every process instead): ``fleet.train_days`` on trainer 0, whose replayed prologue
    would redo its saves (:mod:`fleet.streaming`)."""
    _written: float = 0.0
    client: coordination.CoordinationClient | None = None
    """The coordinator (async/half-async/GEO under fleetrun): cuts by epoch, this trainer
    restartable alone."""
    _epoch_seen: int = 0
    _epoch_handled: int = 0
    _pending_step: int = -1
    _poller: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    # -- resume ----------------------------------------------------------------------------------
    def resume(self) -> None:
        """Load the newest good checkpoint (every trainer calls it); continue after its data
        position. A trainer restarted alone continues after its own position instead."""
        raw = os.environ.get(FLEET_PS_RESUME_POSITION)
        if raw:
            self._resume_alone(raw)
            return
        t0 = time.time()
        result = recovery.load_latest(self.cfg.dir)
        chosen = result.chosen
        if chosen is not None:
            state = chosen.trainer_states.get(self.rank) or {}
            self.resumed_state = state
            position = DataPosition.from_dict(
                state.get("data") if isinstance(state, dict) else None
            )
            tracker().resume(position)
            self.resumed = {
                "checkpoint": chosen.name,
                "step": chosen.step,
                "position": position.to_dict(),
                "skipped": [list(s) for s in result.skipped],
                "load_s": round(time.time() - t0, 3),
            }
            logger.warning(
                "trainer %d resumed from %s (step %d, pass %d, %d steps into it)%s",
                self.rank,
                chosen.name,
                chosen.step,
                position.pass_index,
                position.step_in_pass,
                "; skipped " + "; ".join(f"{n}: {w}" for n, w in result.skipped)
                if result.skipped
                else "",
            )
        self.last_step = tracker().step
        self.next_probe = self.last_step + PROBE_STEPS
        self.last_time = time.monotonic()
        self._write_progress(force=True)

    def _resume_alone(self, raw: str) -> None:
        """fleetrun restarted this trainer alone (the others and the servers went on): skip the
        data it had trained (FLEET_PS_RESUME_POSITION, from its progress file); load nothing."""
        try:
            position = DataPosition.from_dict(json.loads(raw))
        except (TypeError, ValueError) as err:
            raise ConfigError(
                f"{raw!r} is not a data position (pass, step_in_pass, step): {err}; "
                "fleetrun sets it",
                key=FLEET_PS_RESUME_POSITION,
            ) from None
        tracker().resume(position)
        self.resumed = {"alone": True, "step": position.step, "position": position.to_dict()}
        logger.warning(
            "trainer %d restarted alone: resumes at pass %d, %d steps into it (step %d); "
            "the other trainers went on",
            self.rank,
            position.pass_index,
            position.step_in_pass,
            position.step,
        )
        self.last_step = position.step
        self._write_progress(force=True)

    # -- every step ------------------------------------------------------------------------------
    def after_step(self) -> None:
        """A step boundary: count it; at a probe step agree on a checkpoint with the others."""
        track = tracker()
        track.on_step()
        threads.GATE.leave()  # this training thread's step is pushed and counted: cuts may pass
        with threads.CHECKPOINT_LOCK:  # one training thread at a time decides and cuts
            self._after_counted_step(track)

    def _after_counted_step(self, track: Any) -> None:
        if self.first_step_unix is None:
            self.first_step_unix = time.time()
            self._write_progress(force=True)
        else:
            self._write_progress()
        if self.client is not None and self.interval_cuts:
            self._epoch_step(self.client)
            return
        if not self.interval_cuts or track.step < self.next_probe:
            return
        step = track.step
        elapsed = time.monotonic() - self.last_time
        (_, elapsed0, steps0), *_ = recovery._gather((self.rank, elapsed, step - self.last_step))
        rate = steps0 / max(elapsed0, 1e-6)  # trainer 0's steps per second: the same everywhere
        interval = self.cfg.interval_s
        if elapsed0 >= interval * 0.95:
            try:
                with threads.quiesce(), pass_cache.automatic_cut():  # inside a pass: its start
                    position = pass_cache.cut_position(track.position())
                    recovery.checkpoint(
                        self.cfg.dir,
                        step,
                        trainer_state={"data": position.to_dict()},
                        keep=self.cfg.keep,
                    )
                self.checkpoint_step = step
            except FleetError as err:  # every trainer gets the same error (recovery._agree)
                self.failed += 1
                logger.warning(
                    "trainer %d: automatic checkpoint at step %d failed, skipped to "
                    "the next interval: %s",
                    self.rank,
                    step,
                    err,
                )
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

    # -- cuts by epoch (coordinator) -------------------------------------------------------------
    def _epoch_step(self, client: coordination.CoordinationClient) -> None:
        if self._poller is None:  # this trainer takes part in checkpoints from its first step
            self._poller = threading.Thread(
                target=self._poll, args=(client,), daemon=True, name="fleet-ps-checkpoint-epochs"
            )
            self._poller.start()
        epoch = self._epoch_seen
        if epoch > self._epoch_handled:
            self._epoch_handled = epoch
            with threads.quiesce():  # the other training threads at a step boundary
                self._cut(client, epoch)

    def _poll(self, client: coordination.CoordinationClient) -> None:
        """Background: learn of checkpoint epochs (the step boundary only reads an int)."""
        while not self._stop.is_set():
            try:
                epoch, cut = client.poll_epoch(self._epoch_seen)
            except (FleetError, OSError, EOFError) as err:  # the main thread's next round says it
                logger.debug("checkpoint epochs: %s", err)
                return
            if cut and epoch > self._epoch_seen:
                self._epoch_seen = epoch

    def _cut(self, client: coordination.CoordinationClient, epoch: int) -> None:
        """Epoch ``epoch``: flush, cut at this position; the leader snapshots every trainer's."""
        st = _require("automatic checkpoint", TrainingRole.TRAINER)
        get_communicator().flush()  # pushes of the steps before the cut are on the servers
        position = pass_cache.cut_position(tracker().position())  # inside a pass: its start
        got = client.cut(epoch, position.to_dict())
        if not got.get("taken"):
            return
        positions = {int(r): p for r, p in got["positions"].items() if isinstance(p, dict)}
        step = max(int(p.get("step", 0)) for p in positions.values())
        if got["leader"] == self.rank:
            info = self._snapshot(st, step, positions, int(got.get("last_step", -1)))
            client.report(epoch, ("ok", info))
        else:
            info = client.wait_snapshot(epoch)[1]
            info = info if isinstance(info, dict) else {"error": str(info)}
        if "deferred" in info:
            logger.info(
                "trainer %d: automatic checkpoint at step %d deferred to the next interval: the "
                "one at step %s is still being written",
                self.rank,
                step,
                info["deferred"],
            )
        previous = info.get("previous_failed")
        if previous:  # the leader's last checkpoint did not commit (every trainer counts it)
            self.failed += 1
            logger.warning(
                "trainer %d: automatic checkpoint at step %s failed, skipped to the next "
                "interval: %s",
                self.rank,
                previous[0],
                previous[1],
            )
        if info.get("error"):
            self.failed += 1
            logger.warning(
                "trainer %d: automatic checkpoint at step %d failed, skipped to the next "
                "interval: %s",
                self.rank,
                step,
                info["error"],
            )
        elif "snapshot_s" in info:
            self.checkpoint_step = step
            logger.info(
                "checkpoint %s step %d (epoch %d): snapshot taken (%.3fs)",
                self.cfg.dir,
                step,
                epoch,
                info["snapshot_s"],
            )
        self._write_progress(force=True)

    def _snapshot(
        self, st: Any, step: int, positions: dict[int, Any], last_step: int
    ) -> dict[str, Any]:
        """The leader of an epoch: the snapshot of every server with every trainer's position
        (what every trainer learns: ``snapshot_s`` or ``error``, and ``previous_failed``)."""
        info: dict[str, Any] = {}
        pending = st.pending_checkpoint
        if pending is not None and not pending.done():
            # the servers still write the last one: cutting now would hold every trainer until
            # it committed (and, on a slow disk, every later cut too); the next epoch cuts
            info["deferred"] = self._pending_step
            return info
        try:
            recovery.finish_pending(st)  # one at a time; a failed one is counted and skipped
        except FleetError as err:
            info["previous_failed"] = [self._pending_step, f"{type(err).__name__}: {err}"]
        if step <= last_step:  # no trainer went past the last checkpoint's step
            return info
        try:
            pending = get_client().begin_checkpoint(
                self.cfg.dir,
                step,
                keep=self.cfg.keep,
                background=True,
                trainer_states={r: {"data": p} for r, p in positions.items()},
            )
        except FleetError as err:
            info["error"] = f"{type(err).__name__}: {err}"
            return info
        st.pending_checkpoint, self._pending_step = pending, step
        info.update(step=step, snapshot_s=pending.snapshot_s)
        return info

    def finish(self) -> None:
        """Training ended (``fleet.stop_worker``): write the progress file a last time; with the
        coordinator, first leave the checkpoint epochs and wait for this trainer's last snapshot
        to commit (it may be the leader of the last one)."""
        if self.client is not None:
            self._stop.set()
            self.client.leave()
            try:
                recovery.finish_pending(_require("stop_worker()", TrainingRole.TRAINER))
            except FleetError as err:  # best effort, as in stop_worker
                logger.warning("the last automatic checkpoint failed and is skipped: %s", err)
        self._write_progress(force=True)

    def _write_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.log_dir is None or (not force and now - self._written < PROGRESS_PERIOD_S):
            return
        self._written = now
        data = {
            "rank": self.rank,
            "attempt": self.restart_count,
            "step": tracker().step,
            "unix": time.time(),
            "resumed": self.resumed,
            "first_step_unix": self.first_step_unix,
            "mode": self.mode,
            "checkpoints_failed": self.failed,
            "position": tracker().position().to_dict(),
            "alone_ok": self.client is not None and self.restart_alone,
            **(
                {"checkpoint_step": self.checkpoint_step}
                if self.checkpoint_step is not None
                else {}
            ),
        }
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
    auto.client = coordination.active()
    auto.resume()
    st.auto_checkpoint = auto
    return auto


__all__ = ["PROBE_STEPS", "AutoCheckpointer", "start"]
