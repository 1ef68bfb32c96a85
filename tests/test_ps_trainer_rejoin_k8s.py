"""A dead async/GEO trainer pod restarts alone on Kubernetes, through the
trainers' coordinator pod the job renders (launcher/schedulers/k8s/coordinator.py).

- the manifest: the coordinator's headless Service and 1-replica StatefulSet, FLEET_PS_COORDINATOR
  in every pod, the token from the Secret; it validates (strict, 1.28 / 1.30 / 1.31);
- the pods' decisions on a directory, against a real coordinator over its socket: a restarted
  trainer restarts alone (its progress copy's position, one unit of the budget) when every
  copy says ``alone_ok`` and the coordinator greeted it; otherwise, as locally, every pod
  restarts (sync / opted out, no progress yet, a coordinator that does not hold its rounds or
  cannot be reached) or the job fails (budget spent);
- the coordinator pod's own process (its container command and env, run locally): restarted, it
  starts a new generation and serves it; SIGTERM ends it with 0, a refusal with 3;
- the rendered pods run locally (tests/scripts/k8s_local.py: each pod's command with the env its
  manifest gives it, the claim one shared directory): trainer 1's pod is SIGKILLed mid-pass and
  started again with the same command and env (the test plays the Job controller); it resumes
  alone at its data position, trainer 0 never restarts, every pod finishes, nothing is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, SCRIPTS, gen_slot_files, wait_for

from collective.errors import FleetError
from fleet.base.coordination import CoordinationClient
from launcher.recovery.coordinator import Coordinator
from launcher.schedulers.k8s import ps_recovery as kr
from launcher.schedulers.k8s.render import render_job
from launcher.spec import build_spec

sys.path.insert(0, str(SCRIPTS))
import k8s_local

LINES = 1500
GLOBAL_BATCH = 32
CLAIM = {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ps-ckpt"}}
MOUNT = {"name": "ckpt", "mountPath": "/ckpt"}
NAME = "ctr-rejoin"


def _spec(tmp: Path, data: Path | str, ckpt: bool = True) -> Any:
    return build_spec(
        {
            "name": NAME,
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
                    "async",
                ],
            },
            "sizes": {"server_num": 1, "worker_num": 2},
            "max_restarts": 2,
            "log_dir": str(tmp / "log"),
            "env": {"OMP_NUM_THREADS": "1"},
            **(
                {"ps_checkpoint": {"dir": f"/ckpt/{NAME}", "interval_s": 0.5, "keep": 2}}
                if ckpt
                else {}
            ),
            "k8s": {"volumes": [CLAIM], "volume_mounts": [MOUNT]},
        }
    )


@pytest.mark.timeout(60)
def test_manifest_renders_the_coordinator_pod(tmp_path: Path) -> None:
    import kubernetes_validate

    objs = render_job(_spec(tmp_path, "/data"))
    for obj in objs:
        for version in ("1.28", "1.30", "1.31"):
            kubernetes_validate.validate(obj, version, strict=True)
    named = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    svc = named[("Service", f"{NAME}-coord")]["spec"]
    assert svc["clusterIP"] == "None" and svc["ports"][0]["port"] == 6179
    coord = named[("StatefulSet", f"{NAME}-coord")]["spec"]
    assert coord["replicas"] == 1 and coord["serviceName"] == f"{NAME}-coord"
    pod = coord["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["restartPolicy"] == "Always"
    assert container["command"] + container["args"][:2] == [
        "python",
        "-m",
        "launcher.schedulers.k8s.coordinator",
    ]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["FLEET_PS_TOKEN"] == {"secretKeyRef": {"name": f"{NAME}-ps-token", "key": "token"}}
    assert env["FLEET_PS_CHECKPOINT_DIR"] == f"/ckpt/{NAME}" and env["FLEET_PS_MAX_RESTARTS"] == "2"
    assert MOUNT in container["volumeMounts"] and CLAIM in pod["volumes"]
    endpoint = f"{NAME}-coord-0.{NAME}-coord.default.svc:6179"
    for kind, name in (("StatefulSet", f"{NAME}-server"), ("Job", f"{NAME}-trainer")):
        c = named[(kind, name)]["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "FLEET_PS_COORDINATOR", "value": endpoint} in c["env"], (kind, c["env"])
    plain = render_job(_spec(tmp_path, "/data", ckpt=False))  # no ps_checkpoint: no coordinator
    assert not [o for o in plain if "coord" in o["metadata"]["name"]]


def _ckpt(root: Path, step: int) -> None:
    d = root / f"ckpt-{step:06d}"
    d.mkdir(parents=True)
    (d / "checkpoint.json").write_text("{}")


MEMBERS = ("server-0", "trainer-0", "trainer-1", kr.COORDINATOR_POD)


def _gen(root: Path, who: str, endpoint: str, max_restarts: int = 2) -> kr.PodGeneration:
    return kr.PodGeneration(
        str(root / ".pods" / "r"),
        str(root),
        who,
        MEMBERS,
        max_restarts,
        coordinator=endpoint,
        token="secret",
    )


def _joined(root: Path, generation: int) -> None:
    pods = root / ".pods" / "r"
    pods.mkdir(parents=True, exist_ok=True)
    for who in MEMBERS:
        (pods / who).write_text(json.dumps({"generation": generation}))


def _progress(
    root: Path, generation: int, alone_ok: tuple[bool, bool], steps: tuple[int, int] = (30, 20)
) -> None:
    pods = root / ".pods" / "r"
    for rank, (ok, step) in enumerate(zip(alone_ok, steps)):
        (pods / f"progress.trainer-{rank}").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "step": step,
                    "mode": "async",
                    "alone_ok": ok,
                    "generation": generation,
                    "position": {"pass": 0, "step_in_pass": step, "step": step},
                }
            )
        )


def _reset(root: Path) -> None:
    """Back to generation 0, every pod in it (a decision's files removed)."""
    pods = root / ".pods" / "r"
    for f in pods.iterdir():
        if f.name.startswith(("gen-", "alone-", "failed")):
            f.unlink()
    _joined(root, 0)


@pytest.mark.timeout(60)
def test_trainer_pod_decisions_alone_and_every_fallback(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    coord = Coordinator("secret", world=2, interval_s=3600.0)
    clients: list[CoordinationClient] = []
    try:
        clients += [CoordinationClient(coord.endpoint, "secret", r, 2, 0) for r in (0, 1)]
        _joined(root, 0)
        # no checkpoint needed: trainer 1 restarts alone at its position (the coordinator
        # greeted it)
        _progress(root, 0, (True, True))
        trainer = _gen(root, "trainer-1", coord.endpoint)
        trainer.join(5)
        assert trainer.alone and trainer.generation == 0 and 1 in coord.dead
        assert trainer.process_env() == {
            "FLEET_PS_RESUME_POSITION": json.dumps({"pass": 0, "step_in_pass": 20, "step": 20})
        }
        assert trainer.recovery is not None and trainer.recovery.text() == (
            "recovery 1 (attempt 0, in place): trainer 1 restarted by Kubernetes at step ~20; "
            "restarted: trainer 1 only, resumed at its data position (pass 0, step 20 of it; "
            "step 20); 0 steps redone by the others"
        )
        assert (root / ".pods" / "r" / "alone-1").exists() and trainer.used() == 1
        _reset(root)
        _ckpt(root, 10)
        # fallbacks: every pod restarts (a new generation, from the checkpoint)
        cases = {
            "opted out / sync (alone_ok false)": ((True, False), coord.endpoint),
            "no progress copy of trainer 0 yet": (None, coord.endpoint),
            "the coordinator cannot be reached": ((True, True), "127.0.0.1:1"),
        }
        for what, (alone_ok, endpoint) in cases.items():
            for f in (root / ".pods" / "r").glob("progress.*"):
                f.unlink()
            if alone_ok is not None:
                _progress(root, 0, alone_ok)
            else:
                _progress(root, 0, (True, True))
                (root / ".pods" / "r" / "progress.trainer-0").unlink()
            trainer = _gen(root, "trainer-1", endpoint)
            with pytest.raises(Exception, match="did not join generation 1"):
                trainer.join(0.3)  # the others have not joined the new generation
            assert trainer.recovery is not None and not trainer.alone, what
            assert (root / ".pods" / "r" / "gen-1").exists(), what
            _reset(root)
        # a restarted coordinator does not hold trainer 1's rounds: it says no
        _progress(root, 0, (True, True))
        fresh = Coordinator("secret", world=2, interval_s=3600.0)
        try:
            assert kr.ask_restart_alone(fresh.endpoint, "secret", 1, 0, {"step": 1})[0] is False
            trainer = _gen(root, "trainer-1", fresh.endpoint)
            with pytest.raises(Exception, match="did not join generation 1"):
                trainer.join(0.3)
            assert not trainer.alone and (root / ".pods" / "r" / "gen-1").exists()
        finally:
            fresh.close()
        assert kr.ask_restart_alone(coord.endpoint, "wrong", 1, 0, {"step": 1})[0] is False
        assert kr.ask_restart_alone(coord.endpoint, "secret", 1, 7, {"step": 1}) == (
            False,
            "attempt 7 is over (now 0)",
        )
        # budget spent (gen-1 and alone-1 used 2 of 2): the job fails, even for a trainer
        _create_alone(root)
        with pytest.raises(kr.RecoveryRefused, match=r"budget is spent \(2 of max_restarts 2"):
            _gen(root, "trainer-0", coord.endpoint).join(5)
    finally:
        for c in clients:
            c.close()
        coord.close()


def _create_alone(root: Path) -> None:
    (root / ".pods" / "r" / "alone-1").write_text("a recovery\n")
    _joined(root, 1)


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _pods(tmp_path: Path, data: Path | str) -> dict[str, k8s_local.LocalPod]:
    return {
        p.name: p
        for p in k8s_local.translate(render_job(_spec(tmp_path, data)), tmp_path / "pods", REPO)
    }


@pytest.mark.timeout(60)
def test_coordinator_pod_restarted_starts_a_generation_and_serves_it(tmp_path: Path) -> None:
    pods = _pods(tmp_path, "/data")
    coord_pod = pods[f"{NAME}-coord-0"]
    volume = tmp_path / "pods" / "claims" / "ps-ckpt" / NAME
    pod_dir = volume / ".pods" / NAME
    pod_dir.mkdir(parents=True)
    _ckpt(volume, 12)
    for who in MEMBERS:  # every pod ran in generation 0; the coordinator's process died
        (pod_dir / who).write_text(json.dumps({"generation": 0}))
    out = tmp_path / "coord.out"
    proc = k8s_local.start(coord_pod, out)
    token = coord_pod.env["FLEET_PS_TOKEN"]
    endpoint = next(p.env["FLEET_PS_COORDINATOR"] for n, p in pods.items() if "trainer-0" in n)
    try:
        wait_for(
            lambda: json.loads((pod_dir / kr.COORDINATOR_POD).read_text())["generation"] == 1,
            30,
            "the coordinator joining the generation it started",
        )
        assert "coordinator 0 restarted by Kubernetes" in (pod_dir / "gen-1").read_text()
        with pytest.raises(FleetError, match="stale"):
            CoordinationClient(endpoint, token, 0, 2, 0)  # a trainer of generation 0
        client = CoordinationClient(endpoint, token, 0, 2, 1)  # generation 1 is served
        client.close()
        (pod_dir / "gen-2").write_text("another recovery\n")  # it follows a newer generation
        wait_for(
            lambda: json.loads((pod_dir / kr.COORDINATOR_POD).read_text())["generation"] == 2,
            30,
            "the coordinator following generation 2",
        )
        CoordinationClient(endpoint, token, 1, 2, 2).close()
        (pod_dir / "failed").write_text("no PS recovery: the budget is spent\n")
        assert proc.wait(30) == kr.REFUSED_EXIT
    finally:
        k8s_local.stop(proc, signal.SIGKILL, 5)
    text = out.read_text()
    assert "recovery 1 (attempt 0 -> 1): coordinator 0 restarted by Kubernetes" in text, text
    assert "fleetrun coordinator: no PS recovery: the budget is spent" in text, text
    # a first start (no marker): serves generation 2, and SIGTERM (the pod deleted) exits 0
    (pod_dir / "failed").unlink()
    (pod_dir / kr.COORDINATOR_POD).unlink()
    proc = k8s_local.start(coord_pod, out)
    try:
        wait_for(lambda: (pod_dir / kr.COORDINATOR_POD).exists(), 30, "the coordinator's marker")
        assert k8s_local.stop(proc, signal.SIGTERM) == 0
    finally:
        k8s_local.stop(proc, signal.SIGKILL, 5)


@pytest.mark.timeout(200)
def test_trainer_pod_killed_mid_pass_restarts_alone(tmp_path: Path) -> None:
    import psutil

    data = tmp_path / "slots"
    gen_slot_files(data, 2, LINES)
    pods = _pods(tmp_path, data)
    pod_dir = tmp_path / "pods" / "claims" / "ps-ckpt" / NAME / ".pods" / NAME
    log = tmp_path / "log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    outs: dict[str, Path] = {}
    all_pids: set[int] = set()
    trainers = sorted(n for n in pods if "trainer" in n)
    others = [n for n in pods if n not in trainers]  # the server and the coordinator

    def start(name: str, n: int) -> None:
        outs[name] = tmp_path / f"{name}.{n}.out"
        procs[name] = k8s_local.start(pods[name], outs[name])
        all_pids.add(procs[name].pid)

    def trainer1_mid_pass() -> bool:  # both copies say alone_ok; trainer 1 is 20 steps in
        got = [json.loads((pod_dir / f"progress.trainer-{i}").read_text()) for i in (0, 1)]
        return all(p.get("alone_ok") for p in got) and got[1]["step"] >= 20

    try:
        for name in [*others, *trainers]:
            start(name, 1)
        wait_for(trainer1_mid_pass, 150, "trainer 1 at step 20 with both progress copies alone_ok")
        dead = json.loads((pod_dir / "progress.trainer-1").read_text())["position"]
        pid0 = procs[trainers[0]].pid
        victim = procs[trainers[1]]
        kids = _children(victim.pid)
        all_pids.update(kids)
        for pid in [victim.pid, *kids]:  # the node's runtime kills every process of the pod
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        victim.wait(10)
        start(trainers[1], 2)  # the Job controller's replacement pod: same command, same env
        deadline = time.monotonic() + 150
        while any(procs[n].poll() is None for n in trainers) and time.monotonic() < deadline:
            all_pids.update(c for n in procs for c in _children(procs[n].pid))
            time.sleep(0.2)
        codes = {n: procs[n].poll() for n in trainers}
        assert codes == dict.fromkeys(trainers, 0), {
            n: outs[n].read_text()[-3000:] for n in trainers
        }
        assert procs[trainers[0]].pid == pid0  # trainer 0's pod never restarted
        for name in others:  # the server holds, the coordinator serves: until deleted
            assert k8s_local.stop(procs[name], signal.SIGTERM) == 0, outs[name].read_text()[-3000:]
    finally:
        for proc in procs.values():
            k8s_local.stop(proc, signal.SIGKILL, 5)
    restarted = outs[trainers[1]].read_text()
    assert "recovery 1 (attempt 0, in place): trainer 1 restarted by Kubernetes" in restarted, (
        restarted[-3000:]
    )
    assert "restarted: trainer 1 only, resumed at its data position" in restarted
    assert "0 steps redone by the others" in restarted
    assert (pod_dir / "alone-1").exists() and not (pod_dir / "gen-1").exists()  # no restart-all
    steps = LINES // (GLOBAL_BATCH // 2)
    p0 = json.loads((log / "ps_progress.0.json").read_text())
    p1 = json.loads((log / "ps_progress.1.json").read_text())
    assert p0["resumed"] == {} and p0["step"] == steps and p0["attempt"] == 0, p0
    assert p1["resumed"]["alone"] and p1["resumed"]["position"]["step"] >= dead["step"], (p1, dead)
    assert p1["step"] == steps, p1  # resumed at its position, trained the rest of its pass once
    log1 = (log / "workerlog.1").read_text()
    assert "restarted alone: resumes at pass 0" in log1
    assert any("replayed from the record" in ln for ln in log1.splitlines()), log1[-3000:]
    left = [p for p in all_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not left, f"orphans: {left}"
