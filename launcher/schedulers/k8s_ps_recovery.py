"""Recovery of a PS job with automatic checkpoints on Kubernetes: the pods' side.

The local design (:mod:`launcher.ps_recovery`) restarts every process of the job when one dies,
the servers on the same endpoints, and trainer 0 loads the newest good checkpoint. On Kubernetes
Kubernetes restarts the dead pod (the servers' StatefulSet: ``restartPolicy: Always``, same pod
name, same DNS name through the headless Service; the trainers' Indexed Job: a new pod for the
failed index while ``backoffLimit`` lasts), and the pods restart each other through **generations**
kept on the checkpoint volume every pod mounts (``FLEET_PS_CHECKPOINT_DIR``, a ReadWriteMany
PersistentVolumeClaim)::

    DIR/.pods/RUN_ID/gen-N          generation N exists (created O_EXCL: one pod makes it)
    DIR/.pods/RUN_ID/server-I       {"generation": N, ...}: server pod I runs in generation N
    DIR/.pods/RUN_ID/trainer-I      the same for trainer pod I

* A pod starting finds its own marker at the current generation: it is a restart of a pod that
  died (a SIGKILL, an OOM kill, a node loss; the pod cannot tell which) → it creates generation
  N + 1 and logs one recovery line (:class:`launcher.ps_recovery.Recovery`: who, the checkpoint
  the trainers will load).
* Every pod joins the newest generation (writes its marker), then waits until every server and
  trainer pod has joined it (bounded by ``--rdzv_timeout``) before starting its process: no
  server of the new generation serves while a trainer of the old one can still push to it, and
  trainer 0 loads the checkpoint only into servers that will not restart again.
* While its process runs, a pod watches the generation (every :data:`WATCH_PERIOD_S`); a newer
  one stops the process and the pod exits non-zero (SIGTERM to itself → 143): a server's
  container is restarted by the kubelet, a trainer's pod is replaced by the Job controller.

So one recovery costs each trainer pod one failure: ``backoffLimit = max_restarts x trainers``
is the budget (when spent the Job fails; the StatefulSet's servers restart without bound, the
launcher deletes them with the Job). Trainers get FLEET_PS_RECONNECT_S: a call that finds a
server restarting waits for it instead of failing at once.

Not like the local scheduler: a recovery before the first checkpoint restarts the job from the
beginning (the local agent fails the job then); a recovery after some trainer pods finished
(exit 0) waits for them at the barrier until ``--rdzv_timeout`` and fails.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from typing import Any

from collective.env import PSCheckpointEnv, ps_checkpoint_env
from collective.errors import ConfigError, LaunchError
from launcher.ps_recovery import Recovery, latest_committed
from launcher.spec import JobSpec

logger = logging.getLogger(__name__)

PODS_DIR = ".pods"
"""Directory of the generation files inside the checkpoint directory."""
WATCH_PERIOD_S = 0.5
"""Seconds between two looks at the generation while the pod's process runs."""
CHECKPOINT_DIR_ENV = "FLEET_PS_CHECKPOINT_DIR"
RECONNECT_ENV = "FLEET_PS_RECONNECT_S"
"""PSClient's reconnect time (``ps_server.rpc.rpc_client.RECONNECT_ENV``; not imported: the
launcher loads no grpc)."""
RECONNECT_S = 60.0
"""The trainers' FLEET_PS_RECONNECT_S (unless the job's env sets it): a restarting server pod
(container start, imports, tables) is waited for this long."""


# -- rendering (launcher.schedulers.k8s_render calls these) ---------------------------------------
def check_checkpoint_volume(spec: JobSpec) -> None:
    """ConfigError unless ``ps_checkpoint.dir`` is an absolute path on a writable mount of a
    PersistentVolumeClaim (every pod, servers and trainers, must see the same files)."""
    directory = spec.ps_checkpoint.dir
    if not directory:
        return
    claims = {v.get("name") for v in spec.k8s.volumes if "persistentVolumeClaim" in v}
    example = ("e.g. k8s: {volumes: [{name: ckpt, persistentVolumeClaim: {claimName: ps-ckpt}}], "
               "volume_mounts: [{name: ckpt, mountPath: /ckpt}]} and ps_checkpoint.dir: /ckpt/JOB; "
               "the claim must be ReadWriteMany (NFS, CephFS, a cloud file store) and exist before "
               "the job is applied")
    if not os.path.isabs(directory):
        raise ConfigError(f"{directory!r} must be an absolute path inside the pods on a mounted "
                          f"PersistentVolumeClaim shared by every pod; {example}", key="ps_checkpoint.dir")
    for mount in spec.k8s.volume_mounts:
        path = str(mount.get("mountPath", "")).rstrip("/")
        if (mount.get("name") in claims and not mount.get("readOnly")
                and (directory == path or directory.startswith(path + "/"))):
            return
    raise ConfigError(f"{directory!r} is on no writable k8s.volume_mounts entry of a "
                      f"persistentVolumeClaim volume: servers and trainers must share it; {example}",
                      key="ps_checkpoint.dir")


def checkpoint_env(spec: JobSpec, role: str) -> list[dict[str, Any]]:
    """FLEET_PS_CHECKPOINT_* of every pod (the servers use the directory for the generations)
    and the trainers' FLEET_PS_RECONNECT_S; empty without ``ps_checkpoint.dir``."""
    cfg = spec.ps_checkpoint
    if not cfg.dir:
        return []
    env = ps_checkpoint_env(PSCheckpointEnv(cfg.dir, cfg.interval_s, cfg.keep))
    if role == "trainer" and RECONNECT_ENV not in spec.env:
        env[RECONNECT_ENV] = f"{RECONNECT_S:g}"
    return [{"name": k, "value": v} for k, v in env.items() if k not in spec.env]


def _generation(directory: str) -> int:
    """The newest generation of ``directory`` (0 when none was created yet)."""
    best = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if name.startswith("gen-") and name[4:].isdigit():
            best = max(best, int(name[4:]))
    return best


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _marker(directory: str, who: str) -> int | None:
    try:
        with open(os.path.join(directory, who), encoding="utf-8") as f:
            return int(json.load(f)["generation"])
    except (OSError, ValueError, KeyError, TypeError):
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
    generation: int = 0
    recovery: Recovery | None = None
    """The recovery this pod started (it is a restart), else None."""
    _stop: threading.Event | None = None

    def join(self, timeout_s: float) -> None:
        """Create the next generation if this pod is a restart; join the newest; wait until every
        pod joined it."""
        os.makedirs(self.directory, exist_ok=True)
        current = _generation(self.directory)
        if _marker(self.directory, self.who) == current:  # this pod ran in it and died
            role, _, index = self.who.partition("-")
            latest = latest_committed(self.checkpoint_dir)
            name, step = latest if latest else ("no checkpoint (a fresh start)", 0)
            rec = Recovery(current + 1, current, f"{role} {index} restarted by Kubernetes", role,
                           name, step, None)
            try:
                fd = os.open(os.path.join(self.directory, f"gen-{current + 1}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pass  # another restarted pod made it first: join that one
            else:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(rec.text() + "\n")
                self.recovery = rec
                logger.warning("PS %s; every pod of the job restarts", rec.text())
        deadline = time.monotonic() + timeout_s
        while True:
            self.generation = _generation(self.directory)
            _write_json(os.path.join(self.directory, self.who),
                        {"generation": self.generation, "pid": os.getpid(), "unix": time.time()})
            missing = [m for m in self.members if _marker(self.directory, m) != self.generation]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"PS recovery: pods {', '.join(missing)} did not join generation "
                    f"{self.generation} within {timeout_s:g} s ({self.directory}); a pod that "
                    "finished or cannot be scheduled holds the job back")
            time.sleep(0.2)

    def watch(self) -> None:
        """Until :meth:`close`: when a newer generation appears, SIGTERM this pod's fleetrun (its
        process is stopped and it exits non-zero, so Kubernetes restarts it)."""
        self._stop = threading.Event()

        def loop(stop: threading.Event) -> None:
            while not stop.wait(WATCH_PERIOD_S):
                newer = _generation(self.directory)
                if newer > self.generation:
                    logger.warning("PS recovery: generation %d started (%s); restarting this pod",
                                   newer, self.who)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

        threading.Thread(target=loop, args=(self._stop,), name="ps-generation", daemon=True).start()

    def close(self) -> None:
        """Stop watching."""
        if self._stop is not None:
            self._stop.set()


def enter(role: str, index: int, run_id: str, servers: int, trainers: int,
          timeout_s: float) -> PodGeneration | None:
    """For a PS pod with FLEET_PS_CHECKPOINT_DIR: join the job's newest generation (after starting
    a new one if this pod is a restart) and watch it; None without automatic checkpoints."""
    checkpoint_dir = os.environ.get(CHECKPOINT_DIR_ENV, "")
    if not checkpoint_dir:
        return None
    members = tuple([f"server-{i}" for i in range(servers)] + [f"trainer-{i}" for i in range(trainers)])
    gen = PodGeneration(os.path.join(checkpoint_dir, PODS_DIR, run_id), checkpoint_dir,
                        f"{role}-{index}", members)
    gen.join(timeout_s)
    gen.watch()
    return gen


__all__ = ["PODS_DIR", "PodGeneration", "check_checkpoint_volume", "checkpoint_env", "enter"]
