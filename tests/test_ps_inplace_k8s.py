"""A PS job with automatic checkpoints on Kubernetes: a dead async server pod restarts alone, in
place; recoveries are counted against ``max_restarts`` on the checkpoint volume; a recovery with
no checkpoint yet, or beyond the budget, fails the job (as locally).

The manifest validates (strict) and carries FLEET_PS_MAX_RESTARTS and the trainers' Job's
``podFailurePolicy``; the pods' decisions are checked on a directory (pure, no process); the pods
run locally (tests/scripts/k8s_local.py: each pod's container command with exactly the env its
manifest gives it, the claim one shared directory): the server pod of an async job is SIGKILLed
mid-training and started again with the same command and env (the test plays the kubelet); it
restores its own shards and the trainer pods, never restarted, finish; a restarted pod with no
checkpoint to restore exits 3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SCRIPTS, gen_slot_files, wait_for

from launcher.schedulers.k8s import ps_recovery as kr
from launcher.schedulers.k8s.render import render_job
from launcher.spec import build_spec

sys.path.insert(0, str(SCRIPTS))
import k8s_local

LINES = 2000
GLOBAL_BATCH = 32
CLAIM = {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ps-ckpt"}}
MOUNT = {"name": "ckpt", "mountPath": "/ckpt"}


def _spec(tmp: Path, data: Path | str, mode: str = "async", max_restarts: int = 2) -> object:
    return build_spec(
        {
            "name": "ctr-alone",
            "scheduler": "k8s",
            "mode": "ps",
            "entrypoint": {
                "script": "examples/ctr/train_ps.py",
                "args": [
                    "--data_dir",
                    str(data),
                    "--test",
                    "500",
                    "--batch_size",
                    str(GLOBAL_BATCH),
                    "--embedding_dim",
                    "8",
                    "--mode",
                    mode,
                ],
            },
            "sizes": {"server_num": 1, "worker_num": 2},
            "max_restarts": max_restarts,
            "log_dir": str(tmp / "log"),
            "env": {"OMP_NUM_THREADS": "1"},
            "ps_checkpoint": {"dir": "/ckpt/ctr-alone", "interval_s": 0.5, "keep": 2},
            "k8s": {"volumes": [CLAIM], "volume_mounts": [MOUNT]},
        }
    )


@pytest.mark.timeout(60)
def test_manifest_budget_env_and_pod_failure_policy(tmp_path: Path) -> None:
    import kubernetes_validate

    objs = render_job(_spec(tmp_path, "/data", max_restarts=3))
    for obj in objs:
        for version in ("1.28", "1.31"):
            kubernetes_validate.validate(obj, version, strict=True)
    by_kind = {o["kind"]: o for o in objs}
    job = by_kind["Job"]["spec"]
    assert job["podFailurePolicy"] == {
        "rules": [
            {
                "action": "FailJob",
                "onPodConditions": [],
                "onExitCodes": {
                    "containerName": "trainer",
                    "operator": "In",
                    "values": [kr.REFUSED_EXIT],
                },
            }
        ]
    }
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    server = by_kind["StatefulSet"]["spec"]["template"]["spec"]
    assert server["restartPolicy"] == "Always"
    for pod in (server, job["template"]["spec"]):
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env[kr.MAX_RESTARTS_ENV] == "3"


def _ckpt(root: Path, step: int) -> None:
    d = root / f"ckpt-{step:06d}"
    d.mkdir(parents=True)
    (d / "checkpoint.json").write_text("{}")


def _gen(root: Path, who: str, max_restarts: int = 2) -> kr.PodGeneration:
    members = ("server-0", "trainer-0", "trainer-1")
    return kr.PodGeneration(str(root / ".pods" / "r"), str(root), who, members, max_restarts)


def _joined(root: Path, generation: int) -> None:
    """Every pod's marker at ``generation`` (what their joins write)."""
    pods = root / ".pods" / "r"
    pods.mkdir(parents=True, exist_ok=True)
    for who in ("server-0", "trainer-0", "trainer-1"):
        (pods / who).write_text(json.dumps({"generation": generation}))


def _progress(root: Path, generation: int, mode: str, steps: tuple[int, int]) -> None:
    pods = root / ".pods" / "r"
    for rank, step in enumerate(steps):
        (pods / f"progress.trainer-{rank}").write_text(
            json.dumps({"rank": rank, "step": step, "mode": mode, "generation": generation})
        )


@pytest.mark.timeout(30)
def test_pod_decisions_in_place_restart_all_budget_and_no_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _joined(root, 0)  # generation 0: every pod joined
    # no checkpoint yet: the restarted server refuses, and every pod sees why
    with pytest.raises(kr.RecoveryRefused, match="no committed checkpoint"):
        _gen(root, "server-0").join(5)
    assert "no committed checkpoint" in (kr.read_refusal(str(root / ".pods" / "r")) or "")
    os.remove(root / ".pods" / "r" / "failed")

    _ckpt(root, 10)
    _progress(root, 0, "async", (25, 24))
    server = _gen(root, "server-0")
    server.join(5)  # async: in place, no new generation, the process restores its shards
    assert server.alone and server.generation == 0
    assert server.process_env() == {"FLEET_PS_RESTORE_LATEST": str(root)}
    text = server.recovery.text()
    assert text.startswith(
        "recovery 1 (attempt 0, in place): server 0 restarted by Kubernetes at step ~25"
    )
    assert "restarted: server 0 only, restored its shard from ckpt-000010 (step 10)" in text, text

    trainer = _gen(root, "trainer-1")  # a trainer died: every pod restarts (generation 1)
    with pytest.raises(Exception, match="did not join generation 1"):
        trainer.join(0.3)  # the others have not joined it yet
    assert trainer.recovery.text() == (
        "recovery 2 (attempt 0 -> 1): trainer 1 restarted by "
        "Kubernetes at step ~25; restarted: every process, restored "
        "ckpt-000010 (step 10); ~15 steps redone"
    )
    _joined(root, 1)
    with pytest.raises(kr.RecoveryRefused, match=r"budget is spent \(2 of max_restarts 2"):
        _gen(root, "server-0").join(5)  # a third recovery: refused, every pod stops
    with pytest.raises(kr.RecoveryRefused, match="budget is spent"):
        _gen(root, "trainer-0").join(5)


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.timeout(60)
def test_restarted_pod_without_checkpoint_exits_3(tmp_path: Path) -> None:
    pods = {
        p.name: p
        for p in k8s_local.translate(render_job(_spec(tmp_path, "/data")), tmp_path / "pods", REPO)
    }
    pod_dir = tmp_path / "pods" / "claims" / "ps-ckpt" / "ctr-alone" / ".pods" / "ctr-alone"
    pod_dir.mkdir(parents=True)
    (pod_dir / "trainer-1").write_text(json.dumps({"generation": 0}))  # it ran and died
    (name,) = [n for n in pods if "trainer-1" in n]
    proc = k8s_local.start(pods[name], tmp_path / "trainer.out")
    try:
        code = proc.wait(45)
    finally:
        k8s_local.stop(proc, signal.SIGKILL, 5)
    out = (tmp_path / "trainer.out").read_text()
    assert code == kr.REFUSED_EXIT, out[-3000:]
    assert (
        "no PS recovery: trainer 1 was restarted by Kubernetes but there is no committed checkpoint"
        in out
    )


@pytest.mark.timeout(240)
def test_async_server_pod_killed_restarts_alone(tmp_path: Path) -> None:
    import psutil

    data = tmp_path / "slots"
    gen_slot_files(data, 2, LINES)
    pods = {
        p.name: p
        for p in k8s_local.translate(render_job(_spec(tmp_path, data)), tmp_path / "pods", REPO)
    }
    ckpt = tmp_path / "pods" / "claims" / "ps-ckpt" / "ctr-alone"
    log = tmp_path / "log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    outs: dict[str, Path] = {}
    all_pids: set[int] = set()
    server, coordinator = "ctr-alone-server-0", "ctr-alone-coord-0"
    trainers = sorted(n for n in pods if "trainer" in n)

    def start(name: str, n: int) -> None:
        outs[name] = tmp_path / f"{name}.{n}.out"
        procs[name] = k8s_local.start(pods[name], outs[name])
        all_pids.add(procs[name].pid)

    def copied_async() -> bool:  # both trainers' progress on the volume says async
        got = [ckpt / ".pods" / "ctr-alone" / f"progress.trainer-{i}" for i in (0, 1)]
        return all(p.exists() and json.loads(p.read_text()).get("mode") == "async" for p in got)

    try:
        for name in [coordinator, server, *trainers]:  # the trainers' coordinator pod too
            start(name, 1)
        from launcher.recovery.ps_policy import latest_committed

        wait_for(
            lambda: latest_committed(str(ckpt)) and copied_async(),
            150,
            "a committed checkpoint and the trainers' progress on the volume",
        )
        trainer_pids = {n: procs[n].pid for n in trainers}
        all_pids.update(_children(procs[server].pid))
        for pid in [procs[server].pid, *_children(procs[server].pid)]:  # as the runtime does
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        procs[server].wait(10)
        start(server, 2)  # the kubelet restarts the container: same command, same env
        deadline = time.monotonic() + 180
        while any(procs[n].poll() is None for n in trainers) and time.monotonic() < deadline:
            all_pids.update(c for n in procs for c in _children(procs[n].pid))
            time.sleep(0.2)
        codes = {n: procs[n].poll() for n in trainers}
        assert codes == dict.fromkeys(trainers, 0), {
            n: outs[n].read_text()[-3000:] for n in trainers
        }
        assert {n: procs[n].pid for n in trainers} == trainer_pids  # never restarted
        assert k8s_local.stop(procs[server], signal.SIGTERM) == 0
        assert k8s_local.stop(procs[coordinator], signal.SIGTERM) == 0
    finally:
        for proc in procs.values():
            k8s_local.stop(proc, signal.SIGKILL, 5)
    restarted = outs[server].read_text()
    assert "recovery 1 (attempt 0, in place): server 0 restarted by Kubernetes" in restarted, (
        restarted[-3000:]
    )
    assert "restarted: server 0 only" in restarted and "0 steps redone" in restarted
    assert "server 0 restored its shards from ckpt-" in (log / "serverlog.0").read_text()
    assert not (ckpt / ".pods" / "ctr-alone" / "gen-1").exists()  # no pod restarted the others
    steps = LINES // (GLOBAL_BATCH // 2)
    for rank in (0, 1):  # trained every step once, never resumed
        p = json.loads((log / f"ps_progress.{rank}.json").read_text())
        assert not p["resumed"] and p["step"] == steps and p["mode"] == "async", p
    left = [p for p in all_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not left, f"orphans: {left}"
