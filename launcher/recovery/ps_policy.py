"""Recovery of a PS job from its automatic checkpoints (local scheduler; the Ray driver calls the same
:class:`PSRecovery`, and the Kubernetes pods log its :class:`Recovery` lines:
:mod:`launcher.schedulers.k8s.ps_recovery`).

A PS job started with ``--ps_checkpoint_dir`` (``ps_checkpoint: {dir, interval_s, keep}``) is
checkpointed by its trainers (:mod:`fleet.ps.auto_checkpoint`). When one of its processes dies
(a server or a trainer; SIGKILL, OOM kill, an error) the agent asks :meth:`PSRecovery.recover`:

- a checkpoint exists and ``max_restarts`` has a unit left → recover: every process of the
  attempt is stopped and started again, the servers **on the same endpoints**; at
  ``fleet.distributed_optimizer`` trainer 0 loads the newest good checkpoint into every server
  (falling back past a partial or corrupt one) and every trainer skips the data it had trained
  (:mod:`fleet.base.data_position`), so servers and trainers roll to the same cut. One line per
  recovery (who died and how, the checkpoint restored, the steps redone) goes to the console,
  ``job_state.json`` (``recoveries``), the final summary, and ``fleet_ps_recoveries_total``;
- **in place** (:meth:`PSRecovery.recover_alone`): in async/GEO mode (every trainer's progress
  file says so) the death of one server, with a checkpoint and a unit of the budget, restarts
  that server alone, on its endpoint, in the same attempt, with FLEET_PS_RESTORE_LATEST=dir: it
  restores its own shards from the newest good checkpoint before listening
  (``ps_server.PSServer.restore_latest``: falls back past one whose part for this server does not
  load). The other servers and the trainers keep running: the trainers' calls to that server wait
  for it (FLEET_PS_RECONNECT_S, set here for every trainer; APPLY/GEO pushes are re-sent too, and
  same-host shared memory re-attached: ``ps_server.rpc.rpc_client``), and an automatic checkpoint
  that fails meanwhile is skipped (:mod:`fleet.ps.auto_checkpoint`). Lost: that shard's updates
  since its checkpoint (one interval at most, plus the commit); redone: nothing. Async PS
  training tolerates a shard stepping back (Monolith restores a failed PS from its last snapshot
  while training goes on): it is staleness of the kind async training already has, and cheaper
  than stopping every trainer. Listed as ``restarted: server N only`` with the work lost;
- no checkpoint yet, or no restart left → the job fails as any failed job (root cause first,
  every process stopped), the recoveries so far listed in the summary.

- **a trainer in place** (:meth:`PSRecovery.recover_alone`; local scheduler, Ray, Kubernetes):
  the agent (on Ray the driver, which re-creates the trainer's actor alone:
  :mod:`launcher.schedulers.ray.ps_recovery`; on Kubernetes a pod of its own:
  :mod:`launcher.schedulers.k8s.coordinator`) hosts the trainers' coordinator
  (:mod:`launcher.recovery.coordinator`); async, half-async and GEO trainers meet through it instead
  of a gloo group (every progress file says so: ``alone_ok``). A dead trainer is started again
  alone, same rank and attempt, with FLEET_PS_RESUME_POSITION = its data position from its
  progress file: it loads no checkpoint, replays its prologue's rounds from the
  coordinator's record and trains on from there; checkpoints meanwhile complete without it (its
  position stands for it). Half-async barriers are rounds numbered by the trainer's global step
  (:mod:`fleet.base.coordination`): the barriers the restarted trainer passes again answer from
  the record, the next one waits for every trainer, so the survivors wait for it at their next
  barrier. Listed as ``restarted: trainer N only, resumed at its data position``.

- **a heter worker in place** (:meth:`PSRecovery.recover_alone`; local scheduler): in async or
  half-async mode (every trainer's progress file says so) a dead heter worker, with a unit of
  the budget, is started again alone, on its endpoint, with the same environment; the trainers
  and servers keep running and the trainers' calls to it wait for it (:mod:`fleet.heter`). In
  sync mode every process restarts, as for a server. Listed as ``restarted: heter worker N
  only``.

Where this differs from the issue's plan, and why: in sync mode the surviving servers and
trainers are restarted too. A surviving sync server
holds SYNC rounds and barriers half-filled by trainers that are gone or by pushes the restored
server never saw, which would corrupt the next rounds (the mean and the round boundary), so sync
servers and trainers roll back to one cut together; sync trainers meet in a gloo group every step, which
cannot admit a replacement. A dead half-async *server* still restarts every process
(:data:`ALONE_MODES`: not measured in that mode yet).

Work redone comes from the trainers' progress files (``LOG_DIR/ps_progress.<rank>.json``, at
most a second old) minus the restored checkpoint's step. Checkpoints are found by their committed
marker ``ckpt-<step>/checkpoint.json`` (:mod:`ps_server.checkpoint.series`; not imported: the
launcher loads no numpy at start).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from collective.env import (
    FLEET_PS_COORDINATOR,
    FLEET_PS_RESUME_POSITION,
    PSCheckpointEnv,
    ps_checkpoint_env,
)
from launcher.heter_spec import HETER
from launcher.recovery.coordinator import Coordinator
from launcher.spec import JobSpec, Mode

logger = logging.getLogger(__name__)

_CKPT = re.compile(r"^ckpt-(\d+)$")
COMMITTED = "checkpoint.json"
"""The file a job checkpoint's commit writes last (``ps_server.checkpoint.series.TOP_MANIFEST``)."""
RESTORE_LATEST_ENV = "FLEET_PS_RESTORE_LATEST"
"""``ps_server.server.RESTORE_LATEST_ENV`` (not imported: numpy)."""
RECONNECT_ENV = "FLEET_PS_RECONNECT_S"
"""``ps_server.rpc.rpc_client.RECONNECT_ENV``."""
RECONNECT_S = 120.0
"""How long a trainer's calls wait for a server restarted alone (start-up plus restore; the agent
fails the job sooner if the server dies again with no budget left)."""
ALONE_MODES = frozenset({"async", "geo"})
"""Communicator modes in which a dead server is restarted alone."""
HETER_ALONE_MODES = frozenset({"async", "half-async"})
"""Communicator modes in which a dead heter worker is restarted alone (in sync mode every
process restarts, as for a server)."""


@dataclass
class Recovery:
    """One recovery of the job."""

    number: int
    attempt: int
    """The attempt that failed (the recovery runs as attempt + 1)."""
    died: str
    """Who died and how, e.g. ``server 1 exited by signal 9 (SIGKILL)``."""
    role: str
    checkpoint: str
    """The checkpoint the trainers load (the newest committed; corrected from the trainers'
    progress files when they fell back past it)."""
    checkpoint_step: int
    step_at_failure: int | None
    """Trainer steps done when the process died (from the progress files), None if unknown."""
    alone: str = ""
    """Set when only the dead process was restarted (async/GEO server death), e.g.
    ``server 1``; empty: every process of the job was."""
    position: dict[str, int] | None = None
    """A trainer restarted alone: the data position it resumes at (its progress file)."""

    @property
    def redone(self) -> int | None:
        """Steps trained again (those after the restored checkpoint; none when restarted
        alone: the trainers went on)."""
        if self.step_at_failure is None:
            return None
        return 0 if self.alone else max(0, self.step_at_failure - self.checkpoint_step)

    @property
    def lost(self) -> int | None:
        """Steps whose updates to the restarted server's shard are lost (restarted alone)."""
        if (
            self.step_at_failure is None
            or not self.alone
            or self.position is not None
            or self.role == HETER
        ):
            return None
        return max(0, self.step_at_failure - self.checkpoint_step)

    def text(self) -> str:
        at = "" if self.step_at_failure is None else f" at step ~{self.step_at_failure}"
        if self.position is not None:
            p = self.position
            return (
                f"recovery {self.number} (attempt {self.attempt}, in place): {self.died}{at}; "
                f"restarted: {self.alone} only, resumed at its data position (pass "
                f"{p.get('pass', 0)}, step {p.get('step_in_pass', 0)} of it; step {p.get('step', 0)}); "
                "0 steps redone by the others"
            )
        if self.alone and self.role == HETER:
            return (
                f"recovery {self.number} (attempt {self.attempt}, in place): {self.died}{at}; "
                f"restarted: {self.alone} only, on its endpoint with the same environment; "
                "0 steps redone by the others"
            )
        if self.alone:
            lost = "unknown" if self.lost is None else f"~{self.lost}"
            return (
                f"recovery {self.number} (attempt {self.attempt}, in place): {self.died}{at}; "
                f"restarted: {self.alone} only, "
                f"restored its shard from {self.checkpoint} (step {self.checkpoint_step}); "
                f"work lost: that shard's updates of {lost} steps; 0 steps redone"
            )
        redone = "unknown" if self.redone is None else f"~{self.redone}"
        return (
            f"recovery {self.number} (attempt {self.attempt} -> {self.attempt + 1}): {self.died}"
            f"{at}; restarted: every process, "
            f"restored {self.checkpoint} (step {self.checkpoint_step}); {redone} steps redone"
        )


def latest_committed(directory: str) -> tuple[str, int] | None:
    """(name, step) of the newest committed checkpoint of ``directory``, or None."""
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    best: tuple[str, int] | None = None
    for name in names:
        m = _CKPT.match(name)
        if m and os.path.isfile(os.path.join(directory, name, COMMITTED)):
            step = int(m.group(1))
            if best is None or step > best[1]:
                best = (name, step)
    return best


def read_progress(log_dir: str) -> list[dict[str, Any]]:
    """The trainers' progress files (unreadable ones left out)."""
    out = []
    for path in sorted(glob.glob(os.path.join(log_dir, "ps_progress.*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out.append(data)
    return out


class PSRecovery:
    """The recovery side of one PS job's agent (None-able: :func:`make_recovery`)."""

    def __init__(self, spec: JobSpec) -> None:
        cfg = spec.ps_checkpoint
        assert cfg.dir is not None
        self.dir = os.path.abspath(cfg.dir)
        self.config = PSCheckpointEnv(self.dir, cfg.interval_s, cfg.keep)
        self.log_dir = spec.log_dir
        self.num_trainers = len(spec.ps.workers) or spec.sizes.worker_num
        self.recoveries: list[Recovery] = []
        self.coordinator: Coordinator | None = None
        """The trainers' coordinator (:meth:`start_coordinator`: the local agent's or the Ray
        driver's)."""

    def trainer_env(self) -> dict[str, str]:
        """FLEET_PS_CHECKPOINT_* for every trainer, and FLEET_PS_RECONNECT_S: a trainer's calls
        to a server restarted alone wait for it (:data:`RECONNECT_S`); FLEET_PS_COORDINATOR when
        the coordinator runs."""
        coord = (
            {} if self.coordinator is None else {FLEET_PS_COORDINATOR: self.coordinator.endpoint}
        )
        return {**ps_checkpoint_env(self.config), RECONNECT_ENV: repr(RECONNECT_S), **coord}

    def heter_env(self) -> dict[str, str]:
        """FLEET_PS_CHECKPOINT_* (where the job's checkpoints are) and FLEET_PS_RECONNECT_S for
        every heter worker; no coordinator: heter workers take no part in the trainers'
        rounds."""
        return {**ps_checkpoint_env(self.config), RECONNECT_ENV: repr(RECONNECT_S)}

    def start_coordinator(self, token: str, host: str = "127.0.0.1") -> None:
        """Host the trainers' coordinator (:mod:`launcher.recovery.coordinator`) in this process:
        async/half-async/GEO trainers then meet through it and a dead one is restarted alone
        (:meth:`recover_alone`). ``host``: the address it listens on, which every trainer must reach (the local agent:
        127.0.0.1; the Ray driver: its node's IP)."""
        self.coordinator = Coordinator(token, self.num_trainers, self.config.interval_s, host)

    def begin_attempt(self, attempt: int) -> None:
        """Every process starts again: the coordinator forgets the rounds of earlier attempts."""
        if self.coordinator is not None:
            self.coordinator.reset(attempt)

    def close(self) -> None:
        """The job ended: stop the coordinator."""
        if self.coordinator is not None:
            self.coordinator.close()

    def trainer_position(self, attempt: int, rank: int, budget_left: bool) -> dict[str, Any] | None:
        """Where dead trainer ``rank`` of ``attempt`` would resume when restarted alone, or None
        when it cannot be: the coordinator runs, the budget has a unit, every trainer of the
        attempt says (progress file) it meets through the coordinator, and the dead one's file
        has its data position. Nothing recorded (the Ray driver asks before it re-creates the
        trainer's actor)."""
        if self.coordinator is None or not budget_left:
            return None
        progress = {
            p.get("rank"): p for p in read_progress(self.log_dir) if p.get("attempt") == attempt
        }
        if len(progress) < self.num_trainers or not all(
            p.get("alone_ok") for p in progress.values()
        ):
            return None
        position = (progress.get(rank) or {}).get("position")
        return position if isinstance(position, dict) else None

    def _trainer_alone(
        self, attempt: int, died: str, rank: int, budget_left: bool
    ) -> Recovery | None:
        """A dead trainer restarted alone (:meth:`trainer_position`), recorded; the coordinator
        learns of the death (checkpoints go on without it)."""
        position = self.trainer_position(attempt, rank, budget_left)
        if position is None or self.coordinator is None:
            return None
        latest = latest_committed(self.dir) or ("", 0)
        rec = Recovery(
            len(self.recoveries) + 1,
            attempt,
            died,
            "trainer",
            latest[0],
            latest[1],
            int(position.get("step", 0)),
            alone=f"trainer {rank}",
            position=position,
        )
        self.recoveries.append(rec)
        self.coordinator.trainer_died(rank, position)
        return rec

    def resume_env(self, rec: Recovery) -> dict[str, str]:
        """The env added to a trainer restarted alone: where its data resumes."""
        return {FLEET_PS_RESUME_POSITION: json.dumps(rec.position)}

    def restore_env(self) -> dict[str, str]:
        """The env added to a server restarted alone: it restores its shards from the newest
        good checkpoint (``ps_server.server.RESTORE_LATEST_ENV``)."""
        return {RESTORE_LATEST_ENV: self.dir}

    def recover_alone(
        self, attempt: int, died: str, role: str, rank: int, budget_left: bool
    ) -> Recovery | None:
        """After one process of ``attempt`` died (and only one): the :class:`Recovery` that
        restarts it alone, or None when the whole job must restart instead (or fail). Only a
        server, only when every trainer of the attempt reports async or GEO mode (its progress
        file), a committed checkpoint exists and the budget has a unit left. A trainer, when
        the trainers meet through the coordinator (:meth:`_trainer_alone`)."""
        if role == "trainer":
            return self._trainer_alone(attempt, died, rank, budget_left)
        if not self.alone_possible(attempt, role, budget_left):
            return None
        if role == HETER:
            latest = latest_committed(self.dir) or ("", 0)
            rec = Recovery(
                len(self.recoveries) + 1,
                attempt,
                died,
                role,
                latest[0],
                latest[1],
                self._progress_step(attempt),
                alone=f"heter worker {rank}",
            )
            self.recoveries.append(rec)
            return rec
        latest = latest_committed(self.dir)
        if latest is None:
            return None
        rec = Recovery(
            len(self.recoveries) + 1,
            attempt,
            died,
            role,
            latest[0],
            latest[1],
            self._progress_step(attempt),
            alone=f"server {rank}",
        )
        self.recoveries.append(rec)
        return rec

    def alone_possible(self, attempt: int, role: str, budget_left: bool, rank: int = -1) -> bool:
        """Whether :meth:`recover_alone` would restart the dead process alone (nothing recorded:
        the Ray driver asks before it re-creates the process's actor); a trainer: ``rank``'s
        :meth:`trainer_position`."""
        if role == "trainer":
            return self.trainer_position(attempt, rank, budget_left) is not None
        if role == HETER:  # its endpoint and env are kept; the trainers' calls wait for it
            return budget_left and self._modes_in(attempt, HETER_ALONE_MODES)
        if role != "server" or not budget_left or latest_committed(self.dir) is None:
            return False
        return self._modes_in(attempt, ALONE_MODES)

    def _modes_in(self, attempt: int, modes: frozenset[str]) -> bool:
        """Whether every trainer of ``attempt`` reports (progress file) one of ``modes``."""
        progress = [p for p in read_progress(self.log_dir) if p.get("attempt") == attempt]
        return len(progress) >= self.num_trainers and all(p.get("mode") in modes for p in progress)

    def server_roots(self, roots: str) -> str:
        """The servers' FLEET_PS_CHECKPOINT_ROOT with the checkpoint directory added."""
        parts = [p for p in roots.split(os.pathsep) if p]
        return os.pathsep.join(dict.fromkeys([*parts, self.dir]))

    def _progress_step(self, attempt: int) -> int | None:
        steps = [
            int(p["step"])
            for p in read_progress(self.log_dir)
            if p.get("attempt") == attempt and isinstance(p.get("step"), int)
        ]
        return max(steps) if steps else None

    def _settle_last(self, attempt: int) -> None:
        """Correct the last recovery's restored checkpoint from what the trainers of ``attempt``
        (the attempt it started) say they resumed from."""
        if not self.recoveries or self.recoveries[-1].attempt + 1 != attempt:
            return
        for p in read_progress(self.log_dir):
            resumed = p.get("resumed") or {}
            if p.get("attempt") == attempt and p.get("rank") == 0 and resumed.get("checkpoint"):
                last = self.recoveries[-1]
                last.checkpoint, last.checkpoint_step = (
                    str(resumed["checkpoint"]),
                    int(resumed["step"]),
                )

    def recover(self, attempt: int, died: str, role: str, budget_left: bool) -> Recovery | str:
        """After ``attempt`` failed (``died``: the root cause's label and exit): the
        :class:`Recovery` to run, or why there is none (the job then fails)."""
        self._settle_last(attempt)
        latest = latest_committed(self.dir)
        if latest is None:
            return (
                f"no PS recovery: no committed checkpoint in {self.dir} yet (the first is "
                f"taken after ~{self.config.interval_s:g} s of training)"
            )
        if not budget_left:
            return "no PS recovery: the restart budget (--max_restarts) is spent"
        rec = Recovery(
            len(self.recoveries) + 1,
            attempt,
            died,
            role,
            latest[0],
            latest[1],
            self._progress_step(attempt),
        )
        self.recoveries.append(rec)
        return rec

    def finish(self, attempt: int) -> str:
        """Lines listing every recovery (empty without any), for the console and the summary."""
        self._settle_last(attempt)
        if not self.recoveries:
            return ""
        return "PS recoveries:\n" + "\n".join(f"  {r.text()}" for r in self.recoveries)


def make_recovery(spec: JobSpec) -> PSRecovery | None:
    """The job's :class:`PSRecovery`: PS mode with ``ps_checkpoint.dir``; else None."""
    if spec.mode is not Mode.PS or not spec.ps_checkpoint.dir:
        return None
    return PSRecovery(spec)


__all__ = [
    "ALONE_MODES",
    "COMMITTED",
    "HETER_ALONE_MODES",
    "PSRecovery",
    "Recovery",
    "latest_committed",
    "make_recovery",
    "read_progress",
]
