"""A PS job with automatic checkpoints on Kubernetes: the rendered manifest, and its pods run
locally (tests/scripts/k8s_local.py: each pod's container command with exactly the env its
manifest gives it; the PersistentVolumeClaim is one directory every pod shares). The test plays
the kubelet and the Job controller: the server pod's process is SIGKILLed mid-training and started
again with the same command and env; a trainer pod that exits non-zero is started again (the
Indexed Job's replacement pod for its index). The job restores from the checkpoint and finishes.

The checkpoint interval (3 s) is longer than a checkpoint takes to write and commit on a loaded
machine (2 to 2.5 s at a load of 9 to 13 on 2 cores). With a shorter one every cut waits for the
previous commit, and the cuts come every interval of training time, so the time the restarted job
takes grows with the square of the slowdown (more cuts, each waiting longer) instead of in
proportion to it: at 0.5 s nearly every cut waited 1 to 1.5 s at a load of 9 to 11. The pass (250
steps per trainer) is long enough that the first cut, an interval into training, still comes well
before its end on an idle machine: the server is killed mid-pass.

What remains after the kill is in proportion to the CPU the test gets: the pods join the new
generation within seconds, then four processes start again (python and torch imports, the model,
the data: about 30 s from the kill to the first resumed step at a load of 11, 2 minutes beside
busy processes of normal priority, where the restarted job took 272 s in all) and train the rest of
the pass. Hence the waits' bounds: 240 s for the first checkpoint, 360 s from the kill to the end."""

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

from collective.errors import ConfigError
from launcher.schedulers.k8s.render import render_job
from launcher.spec import build_spec

sys.path.insert(0, str(SCRIPTS))
import k8s_local

LINES = 4000
GLOBAL_BATCH = 32
CHECKPOINT_INTERVAL_S = 3.0
CLAIM = {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ps-ckpt"}}
MOUNT = {"name": "ckpt", "mountPath": "/ckpt"}


def _spec(tmp: Path, data: Path | str, **k8s: object) -> object:
    return build_spec(
        {
            "name": "ctr-rec",
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
                    "sync",
                ],
            },
            "sizes": {"server_num": 1, "worker_num": 2},
            "max_restarts": 2,
            "log_dir": str(tmp / "log"),
            "env": {"OMP_NUM_THREADS": "1"},
            "ps_checkpoint": {
                "dir": "/ckpt/ctr-rec",
                "interval_s": CHECKPOINT_INTERVAL_S,
                "keep": 2,
            },
            "k8s": {"volumes": [CLAIM], "volume_mounts": [MOUNT], **k8s},
        }
    )


@pytest.mark.timeout(60)
def test_manifest_carries_checkpoint_volume_env_secret_restarts(tmp_path: Path) -> None:
    import kubernetes_validate

    objs = render_job(_spec(tmp_path, "/data"))
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30", strict=True)
    by_kind = {o["kind"]: o for o in objs}
    assert by_kind["Secret"]["stringData"]["token"]
    server = by_kind["StatefulSet"]["spec"]["template"]["spec"]
    job = by_kind["Job"]["spec"]
    assert server["restartPolicy"] == "Always" and job["backoffLimit"] == 2 * 2
    for pod, role in ((server, "server"), (job["template"]["spec"], "trainer")):
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}
        assert env["FLEET_PS_CHECKPOINT_DIR"] == "/ckpt/ctr-rec"
        assert env["FLEET_PS_CHECKPOINT_KEEP"] == "2"
        assert env["FLEET_PS_TOKEN"] == {
            "secretKeyRef": {"name": "ctr-rec-ps-token", "key": "token"}
        }
        assert ("FLEET_PS_RECONNECT_S" in env) == (role == "trainer")
        assert {"name": "ckpt", "mountPath": "/ckpt"} in pod["containers"][0]["volumeMounts"]
        if role == "server":
            assert "/ckpt" in env["FLEET_PS_CHECKPOINT_ROOT"].split(":")
    assert by_kind["Service"]  # the headless Services: stable names for a restarted server
    with pytest.raises(ConfigError, match="persistentVolumeClaim") as err:
        render_job(_spec(tmp_path, "/data", volumes=[{"name": "ckpt", "emptyDir": {}}]))
    assert err.value.key == "ps_checkpoint.dir"


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_pod(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a pod's processes, all of them (as the container runtime does)."""
    kids = _children(proc.pid)
    for pid in [proc.pid, *kids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(720)  # above the waits' own bounds (data, 240 s, 360 s): they name the phase
def test_server_pod_killed_restarts_and_job_resumes_from_checkpoint(tmp_path: Path) -> None:
    data = tmp_path / "slots"
    gen_slot_files(data, 2, LINES)
    pods = {
        p.name: p
        for p in k8s_local.translate(render_job(_spec(tmp_path, data)), tmp_path / "pods", REPO)
    }
    ckpt = tmp_path / "pods" / "claims" / "ps-ckpt" / "ctr-rec"
    log = tmp_path / "log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    starts = dict.fromkeys(pods, 0)
    all_pids: set[int] = set()

    def start(name: str) -> None:
        starts[name] += 1
        procs[name] = k8s_local.start(pods[name], tmp_path / f"{name}.{starts[name]}.out")
        all_pids.add(procs[name].pid)

    server, coordinator = "ctr-rec-server-0", "ctr-rec-coord-0"
    trainers = sorted(n for n in pods if "trainer" in n)
    try:
        for name in [coordinator, server, *trainers]:  # the trainers' coordinator pod too
            start(name)
        from launcher.recovery.ps_policy import latest_committed

        wait_for(lambda: latest_committed(str(ckpt)), 240, "a committed checkpoint")
        all_pids.update(_children(procs[server].pid))
        _kill_pod(procs[server])
        start(server)  # the kubelet restarts the container: same command, same env
        deadline = time.monotonic() + 360  # the pods' start-ups and the rest of the pass
        codes: dict[str, int] = {}
        while len(codes) < len(trainers) and time.monotonic() < deadline:
            for name in trainers:
                if name in codes or procs[name].poll() is None:
                    continue
                all_pids.update(_children(procs[name].pid))
                if procs[name].returncode == 0:
                    codes[name] = 0
                else:  # the Job controller replaces a failed pod (budget: backoffLimit 4)
                    assert starts[name] < 3, (tmp_path / f"{name}.{starts[name]}.out").read_text()[
                        -3000:
                    ]
                    start(name)
            all_pids.update(c for n in procs for c in _children(procs[n].pid))
            time.sleep(0.2)
        assert codes == dict.fromkeys(trainers, 0), {
            n: (tmp_path / f"{n}.{starts[n]}.out").read_text()[-3000:] for n in trainers
        }
        assert k8s_local.stop(procs[server], signal.SIGTERM) == 0
        assert k8s_local.stop(procs[coordinator], signal.SIGTERM) == 0
    finally:
        for proc in procs.values():
            k8s_local.stop(proc, signal.SIGKILL, 5)
    outputs = "\n".join(p.read_text() for p in tmp_path.glob("*.out"))
    assert starts[server] == 2 and all(starts[t] == 2 for t in trainers), (starts, outputs[-4000:])
    assert "recovery 1 (attempt 0 -> 1): server 0 restarted by Kubernetes" in outputs, outputs[
        -4000:
    ]
    steps = LINES // (GLOBAL_BATCH // 2)
    for rank in (0, 1):  # the second generation resumed from a checkpoint and finished the pass
        p = json.loads((log / f"ps_progress.{rank}.json").read_text())
        assert p["resumed"].get("checkpoint", "").startswith("ckpt-") and p["step"] == steps, p
    import psutil

    left = [p for p in all_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not left, f"orphans: {left}"
