"""Recovery of a PS job with automatic checkpoints on Kubernetes: the pods' side.

Kubernetes restarts a dead pod (the servers' StatefulSet: ``restartPolicy: Always``, same pod
name, same DNS name through the headless Service; the trainers' Indexed Job: a new pod for the
failed index), and the pods decide what that restart means through files on the checkpoint
volume every pod mounts (``FLEET_PS_CHECKPOINT_DIR``, a ReadWriteMany PersistentVolumeClaim)::

    DIR/.pods/RUN_ID/gen-N                 generation N exists (created O_EXCL: one pod makes it)
    DIR/.pods/RUN_ID/server-I              {"generation": N, ...}: server pod I runs in generation N
    DIR/.pods/RUN_ID/trainer-I             the same for trainer pod I
    DIR/.pods/RUN_ID/progress.trainer-I    trainer I's progress (LOG_DIR/ps_progress.I.json, copied
                                           by its pod every WATCH_PERIOD_S) with its generation
    DIR/.pods/RUN_ID/coordinator-0         the same for the trainers' coordinator pod (if any)
    DIR/.pods/RUN_ID/alone-K               in-place recovery K (a server or trainer restarted alone)
    DIR/.pods/RUN_ID/failed                why the job cannot recover: every pod stops, exit 3

A pod starting finds its own marker at the current generation: it is a restart of a pod that
died (a SIGKILL, an OOM kill, a node loss; the pod cannot tell which). Then, as the local agent
(:mod:`launcher.recovery.ps_policy`) decides:

* **no committed checkpoint yet, or the budget spent** (restarts used = generations + in-place
  recoveries, against FLEET_PS_MAX_RESTARTS = ``max_restarts``) → the job fails: the pod writes
  ``failed`` with the reason and exits :data:`REFUSED_EXIT`; every other pod sees it, stops its
  process and exits :data:`REFUSED_EXIT` too; the trainers' Job fails at once on that exit code
  (its ``podFailurePolicy``), and ``fleetrun`` prints the termination message;
* **a trainer, in async, half-async or GEO mode** (every trainer's progress copy of this generation says it
  meets through the coordinator, ``alone_ok``, and this trainer's has its data position), a unit
  of the budget left, and the coordinator pod grants it (``restart_alone``: it greeted that
  trainer in this generation, so it holds its rounds; a coordinator that was itself restarted
  does not) → in place: only this trainer restarts (``alone-K``), its process gets
  FLEET_PS_RESUME_POSITION from its progress copy and replays its prologue's rounds from the
  coordinator's record, as locally (:mod:`launcher.recovery.ps_policy`); the servers and the other
  trainers keep running. Logged as locally: ``recovery 1 (attempt 0, in place): trainer 1
  restarted by Kubernetes at step ~119; restarted: trainer 1 only, resumed at its data position
  (pass 0, step 119 of it; step 119); 0 steps redone by the others``. No committed checkpoint is
  needed (nothing is restored);
* **a server, and every trainer's progress of this generation says async or GEO** → in place:
  only this server restarts (``alone-K``), its process gets FLEET_PS_RESTORE_LATEST=DIR and
  restores its own shards from the newest good checkpoint before it listens; the trainers keep
  running, their calls to it wait (FLEET_PS_RECONNECT_S) on its unchanged DNS name. Logged as
  locally: ``recovery 2 (attempt 0, in place): server 0 restarted by Kubernetes at step ~61;
  restarted: server 0 only, restored its shard from ckpt-000044 (step 44); work lost: ...``;
* **otherwise** (sync mode, a trainer not restartable alone, the coordinator pod
  restarted: its rounds are lost) → every pod restarts: the pod creates generation
  N + 1 and logs the recovery line with the steps redone (from the progress copies); every pod
  watches the generation (every :data:`WATCH_PERIOD_S`), and a newer one stops its process and
  the pod exits 143, so the kubelet / the Job controller restarts it. A pod starting joins the
  newest generation and waits until every server and trainer pod has joined it (bounded by
  ``--rdzv_timeout``) before it starts its process: no server of the new generation serves
  while a trainer of the old one can still push to it; then trainer 0 loads the newest good
  checkpoint into the servers.

The budget is counted here, not by Kubernetes: a StatefulSet restarts a container without
bound, and a Job's ``backoffLimit`` counts pod failures, not recoveries. ``backoffLimit`` stays
``max_restarts x trainers`` as an outer bound (one restart-all recovery costs each trainer pod
one failure). Trainers get FLEET_PS_RECONNECT_S.

Not like the local scheduler: a recovery after some trainer pods finished (exit 0) waits for them
at the barrier until ``--rdzv_timeout`` and fails; the pods of one run id share ``.pods`` (a job
re-applied with the same name and run id should get a fresh ``ps_checkpoint.dir``).

What the manifest gets for this (the volume check, the pods' env, the ``podFailurePolicy``) is
:mod:`launcher.schedulers.k8s.ps_manifest`; its names are importable from here too.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from typing import Any

from collective import ps_coordination as wire
from collective.env import FLEET_PS_COORDINATOR, FLEET_PS_RESUME_POSITION
from collective.errors import ConfigError, LaunchError
from launcher.recovery.ps_policy import ALONE_MODES, RESTORE_LATEST_ENV, Recovery, latest_committed
from launcher.schedulers.k8s.ps_manifest import (
    MAX_RESTARTS_ENV,
    RECONNECT_ENV,
    RECONNECT_S,
    REFUSED_EXIT,
    check_checkpoint_volume,
    checkpoint_env,
    pod_failure_policy,
)

logger = logging.getLogger(__name__)

PODS_DIR = ".pods"
"""Directory of the generation files inside the checkpoint directory."""
WATCH_PERIOD_S = 0.5
"""Seconds between two looks at the generation while the pod's process runs."""
CHECKPOINT_DIR_ENV = "FLEET_PS_CHECKPOINT_DIR"
FAILED_FILE = "failed"
COORDINATOR_POD = "coordinator-0"
"""The trainers' coordinator pod among a generation's members (when the job has one)."""
TOKEN_ENV = "FLEET_PS_TOKEN"
ASK_TIMEOUT_S = 10.0
"""Longest a restarted trainer pod waits for the coordinator's answer (none: every pod restarts)."""


class RecoveryRefused(LaunchError):
    """The job cannot recover from a pod's death (no checkpoint yet, budget spent): the pod exits
    :data:`REFUSED_EXIT`."""


def _generation(directory: str) -> int:
    """The newest generation of ``directory`` (0 when none was created yet)."""
    return max(_numbered(directory, "gen-"), default=0)


def _numbered(directory: str, prefix: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [
        int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit()
    ]


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker(directory: str, who: str) -> int | None:
    data = _read_json(os.path.join(directory, who))
    try:
        return int(data["generation"]) if data else None
    except (KeyError, TypeError, ValueError):
        return None


def _create(path: str, text: str) -> bool:
    """Create ``path`` with ``text`` unless it exists (O_EXCL: one pod wins); True if created."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def ask_restart_alone(
    endpoint: str, token: str, rank: int, generation: int, position: dict[str, Any]
) -> tuple[bool, str]:
    """Ask the coordinator at ``endpoint`` whether trainer ``rank`` of ``generation`` may restart
    alone at ``position`` (``restart_alone``; granted: the coordinator counts it as dead until it
    greets again). (False, why) when it says no or cannot be asked within :data:`ASK_TIMEOUT_S`."""
    try:
        conn = wire.connect(endpoint, token.encode(), ASK_TIMEOUT_S)
    except (OSError, EOFError, AuthenticationError) as err:
        return False, f"the coordinator at {endpoint} cannot be reached ({err})"
    try:
        wire.send(
            conn, {"op": "restart_alone", "rank": rank, "attempt": generation, "position": position}
        )
        if not conn.poll(ASK_TIMEOUT_S):
            return False, f"the coordinator at {endpoint} did not answer within {ASK_TIMEOUT_S:g} s"
        reply, _ = wire.recv(conn)
    except (OSError, EOFError, ValueError) as err:
        return False, f"the coordinator at {endpoint} failed ({err})"
    finally:
        conn.close()
    if not reply.get("ok"):
        return False, str(reply.get("error", "refused"))
    return bool(reply.get("granted")), str(reply.get("why", ""))


def read_refusal(directory: str) -> str | None:
    """Why the job cannot recover (the ``failed`` file), or None."""
    try:
        with open(os.path.join(directory, FAILED_FILE), encoding="utf-8") as f:
            return f.read().strip() or "the job cannot recover"
    except OSError:
        return None


@dataclass
class PodGeneration:
    """One pod's membership in its job's generations (see the module docstring)."""

    directory: str
    """``CHECKPOINT_DIR/.pods/RUN_ID``."""
    checkpoint_dir: str
    who: str
    """``server-I`` or ``trainer-I``."""
    members: tuple[str, ...]
    """Every pod of the job (``server-0``..., ``trainer-0``...)."""
    max_restarts: int = 0
    """Recoveries the job may make (``max_restarts``)."""
    log_dir: str = ""
    """The pod's log directory (a trainer copies its progress file from there)."""
    coordinator: str = ""
    """The trainers' coordinator (FLEET_PS_COORDINATOR, ``host:port``); empty: none rendered."""
    token: str = ""
    """The job's token (FLEET_PS_TOKEN): what the coordinator admits."""
    generation: int = 0
    recovery: Recovery | None = None
    """The recovery this pod started (it is a restart), else None."""
    refused: str = ""
    """Set when the pod stopped because the job cannot recover (``failed``)."""
    _stop: threading.Event | None = None

    @property
    def alone(self) -> bool:
        """This pod is a server or trainer restarted alone (in place)."""
        return self.recovery is not None and bool(self.recovery.alone)

    def process_env(self) -> dict[str, str]:
        """Env added to the pod's process: FLEET_PS_RESTORE_LATEST for a server restarted
        alone (it restores its own shards before it listens), FLEET_PS_RESUME_POSITION for a
        trainer restarted alone (its data position; it loads no checkpoint)."""
        if not self.alone or self.recovery is None:
            return {}
        if self.recovery.position is not None:
            return {FLEET_PS_RESUME_POSITION: json.dumps(self.recovery.position)}
        return {RESTORE_LATEST_ENV: self.checkpoint_dir}

    def progress(self, generation: int) -> list[dict[str, Any]]:
        """The trainers' progress copies of ``generation``."""
        out = []
        for m in self.members:
            if m.startswith("trainer-"):
                data = _read_json(os.path.join(self.directory, f"progress.{m}"))
                if data and data.get("generation") == generation:
                    out.append(data)
        return out

    def used(self) -> int:
        """Recoveries made so far: generations started plus servers restarted alone."""
        return _generation(self.directory) + len(_numbered(self.directory, "alone-"))

    def refuse(self, reason: str) -> RecoveryRefused:
        """Record that the job cannot recover (every pod stops); the error to raise."""
        _create(os.path.join(self.directory, FAILED_FILE), reason)
        self.refused = read_refusal(self.directory) or reason
        return RecoveryRefused(self.refused)

    def _restarted(self, current: int) -> None:
        """This pod ran in generation ``current`` and died: recover (in place or every pod) or
        refuse."""
        role, _, index = self.who.partition("-")
        refusal = read_refusal(self.directory)
        if refusal:
            raise self.refuse(refusal)
        died = f"{role} {index} restarted by Kubernetes"
        if role == "trainer" and self.used() < self.max_restarts:
            rec = self._trainer_alone(current, int(index), died)
            if rec is not None:
                self._record_alone(rec)
                return
        latest = latest_committed(self.checkpoint_dir)
        if latest is None:
            raise self.refuse(
                f"no PS recovery: {role} {index} was restarted by Kubernetes but "
                f"there is no committed checkpoint in {self.checkpoint_dir} yet (as "
                "locally, the job fails; the first is taken after "
                "ps_checkpoint.interval_s of training)"
            )
        used = self.used()
        if used >= self.max_restarts:
            raise self.refuse(
                f"no PS recovery: {role} {index} was restarted by Kubernetes but "
                f"the restart budget is spent ({used} of max_restarts "
                f"{self.max_restarts} used); raise --max_restarts to allow more"
            )
        progress = self.progress(current)
        steps = [int(p["step"]) for p in progress if isinstance(p.get("step"), int)]
        step = max(steps) if steps else None
        num_trainers = sum(m.startswith("trainer-") for m in self.members)
        alone = (
            role == "server"
            and len(progress) == num_trainers
            and all(p.get("mode") in ALONE_MODES for p in progress)
        )
        if alone:
            self._record_alone(
                Recovery(
                    used + 1,
                    current,
                    died,
                    role,
                    latest[0],
                    latest[1],
                    step,
                    alone=f"{role} {index}",
                )
            )
            return
        rec = Recovery(used + 1, current, died, role, latest[0], latest[1], step)
        if _create(os.path.join(self.directory, f"gen-{current + 1}"), rec.text()):
            self.recovery = rec
            logger.warning("PS %s; every pod of the job restarts", rec.text())
        # else another restarted pod made it first: join that one

    def _trainer_alone(self, current: int, rank: int, died: str) -> Recovery | None:
        """Trainer ``rank`` of generation ``current`` restarted alone (as
        ``PSRecovery._trainer_alone`` locally): the coordinator runs, every trainer's progress copy
        says it meets through it (``alone_ok``: async/GEO, not opted out), this one's has its data
        position, and the coordinator grants it (it holds the rounds); else None."""
        if not self.coordinator:
            return None
        progress = {p.get("rank"): p for p in self.progress(current)}
        num_trainers = sum(m.startswith("trainer-") for m in self.members)
        if len(progress) < num_trainers or not all(p.get("alone_ok") for p in progress.values()):
            return None  # sync (gloo), opted out (train_days trainer 0), no progress yet
        position = (progress.get(rank) or {}).get("position")
        if not isinstance(position, dict):
            return None
        granted, why = ask_restart_alone(self.coordinator, self.token, rank, current, position)
        if not granted:
            logger.warning("PS recovery: trainer %d cannot restart alone: %s", rank, why)
            return None
        latest = latest_committed(self.checkpoint_dir) or ("", 0)
        return Recovery(
            self.used() + 1,
            current,
            died,
            "trainer",
            latest[0],
            latest[1],
            int(position.get("step", 0)),
            alone=f"trainer {rank}",
            position=position,
        )

    def _record_alone(self, rec: Recovery) -> None:
        """An in-place recovery: ``alone-K`` on the volume (a unit of the budget), logged."""
        k = len(_numbered(self.directory, "alone-")) + 1
        while not _create(os.path.join(self.directory, f"alone-{k}"), rec.text()):
            k += 1  # bounded by the files there: another pod restarted alone at once
        self.recovery = rec
        logger.warning("PS %s", rec.text())

    def _mark(self) -> None:
        _write_json(
            os.path.join(self.directory, self.who),
            {"generation": self.generation, "pid": os.getpid(), "unix": time.time()},
        )

    def join(
        self, timeout_s: float, wait: bool = True, ready: Callable[[int], None] | None = None
    ) -> None:
        """Recover (or refuse) if this pod is a restart; join the newest generation; wait until
        every pod joined it (``wait``). ``ready(generation)`` runs before this pod's marker says
        it joined (the coordinator pod: serve that generation first)."""
        os.makedirs(self.directory, exist_ok=True)
        current = _generation(self.directory)
        if _marker(self.directory, self.who) == current:  # this pod ran in it and died
            self._restarted(current)
        deadline = time.monotonic() + timeout_s
        served: int | None = None
        while True:
            newest = _generation(self.directory)
            if ready is not None and newest != served:
                ready(newest)
                served = newest
            self.generation = newest
            self._mark()
            missing = [m for m in self.members if _marker(self.directory, m) != self.generation]
            if not missing or not wait:
                return
            refusal = read_refusal(self.directory)
            if refusal:
                raise self.refuse(refusal)
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"PS recovery: pods {', '.join(missing)} did not join generation "
                    f"{self.generation} within {timeout_s:g} s ({self.directory}); a pod that "
                    "finished or cannot be scheduled holds the job back"
                )
            time.sleep(0.2)

    def follow(self, ready: Callable[[int], None]) -> str:
        """The coordinator pod, after :meth:`join`: follow the job's generations — a newer one is
        served (``ready``) and joined at once, the coordinator stays up — until the job cannot
        recover; returns why (Interrupted, the pod's SIGTERM, ends it sooner)."""
        while True:
            time.sleep(WATCH_PERIOD_S)
            refusal = read_refusal(self.directory)
            if refusal:
                self.refused = refusal
                return refusal
            newest = _generation(self.directory)
            if newest > self.generation:
                ready(newest)
                self.generation = newest
                self._mark()
                logger.info(
                    "PS recovery: generation %d started; the coordinator serves it afresh", newest
                )

    def copy_progress(self) -> None:
        """A trainer pod: copy its process's progress file to the volume, with the generation
        (what a restarted pod reads for the mode and the steps redone)."""
        role, _, index = self.who.partition("-")
        if role != "trainer" or not self.log_dir:
            return
        data = _read_json(os.path.join(self.log_dir, f"ps_progress.{index}.json"))
        if data is not None:
            try:
                _write_json(
                    os.path.join(self.directory, f"progress.{self.who}"),
                    {**data, "generation": self.generation},
                )
            except OSError as err:  # progress is for the recovery's report and mode only
                logger.debug("progress of %s not copied: %s", self.who, err)

    def watch(self) -> None:
        """Until :meth:`close`: copy the progress (a trainer); when a newer generation appears or
        the job cannot recover, SIGTERM this pod's fleetrun (its process is stopped; it exits
        non-zero, and Kubernetes restarts it or the Job fails)."""
        self._stop = threading.Event()

        def loop(stop: threading.Event) -> None:
            while not stop.wait(WATCH_PERIOD_S):
                self.copy_progress()
                refusal = read_refusal(self.directory)
                if refusal:
                    logger.error("PS recovery: %s; stopping this pod (%s)", refusal, self.who)
                    self.refused = refusal
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                newer = _generation(self.directory)
                if newer > self.generation:
                    logger.warning(
                        "PS recovery: generation %d started (%s); restarting this pod",
                        newer,
                        self.who,
                    )
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

        threading.Thread(target=loop, args=(self._stop,), name="ps-generation", daemon=True).start()

    def close(self) -> None:
        """Stop watching (a trainer's progress copied a last time)."""
        if self._stop is not None:
            self._stop.set()
        self.copy_progress()


def make_generation(
    role: str, index: int, run_id: str, servers: int, trainers: int, log_dir: str = ""
) -> PodGeneration | None:
    """This pod's :class:`PodGeneration` from its env (FLEET_PS_CHECKPOINT_DIR,
    FLEET_PS_MAX_RESTARTS, FLEET_PS_COORDINATOR — its pod is then a member too — and
    FLEET_PS_TOKEN); None without automatic checkpoints."""
    checkpoint_dir = os.environ.get(CHECKPOINT_DIR_ENV, "")
    if not checkpoint_dir:
        return None
    raw = os.environ.get(MAX_RESTARTS_ENV, "0")
    if not raw.isdigit():
        raise ConfigError(f"must be a whole number >= 0, got {raw!r}", key=MAX_RESTARTS_ENV)
    coordinator = os.environ.get(FLEET_PS_COORDINATOR, "")
    members = tuple(
        [f"server-{i}" for i in range(servers)]
        + [f"trainer-{i}" for i in range(trainers)]
        + ([COORDINATOR_POD] if coordinator else [])
    )
    return PodGeneration(
        os.path.join(checkpoint_dir, PODS_DIR, run_id),
        checkpoint_dir,
        f"{role}-{index}",
        members,
        int(raw),
        log_dir,
        coordinator,
        os.environ.get(TOKEN_ENV, ""),
    )


def enter(
    role: str,
    index: int,
    run_id: str,
    servers: int,
    trainers: int,
    timeout_s: float,
    log_dir: str = "",
) -> PodGeneration | None:
    """For a PS pod with FLEET_PS_CHECKPOINT_DIR: recover or refuse if this pod is a restart,
    join the job's newest generation and watch it; None without automatic checkpoints.
    :class:`RecoveryRefused` when the job cannot recover."""
    gen = make_generation(role, index, run_id, servers, trainers, log_dir)
    if gen is None:
        return None
    gen.join(timeout_s)
    gen.watch()
    return gen


__all__ = [
    "CHECKPOINT_DIR_ENV",
    "COORDINATOR_POD",
    "MAX_RESTARTS_ENV",
    "PODS_DIR",
    "RECONNECT_ENV",
    "RECONNECT_S",
    "REFUSED_EXIT",
    "PodGeneration",
    "RecoveryRefused",
    "ask_restart_alone",
    "check_checkpoint_volume",
    "checkpoint_env",
    "enter",
    "make_generation",
    "pod_failure_policy",
    "read_refusal",
]
