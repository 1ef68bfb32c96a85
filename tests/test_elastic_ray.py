"""Elastic collective jobs on Ray, on a real loopback Ray cluster
(``ray start --head`` on 127.0.0.1, 2 CPUs, private temp dir, usage stats off).

``fleetrun --scheduler ray --nnodes 1:2`` while another driver holds one of the two CPUs: the
job forms with the one node it can place (world size 1 < MAX). Its worker actor is SIGKILLed
mid-training: the job re-forms with what it can still place (a failure: one restart spent) and
resumes from its checkpoint. The other driver releases its CPU: the job's growth probe is
placed, and the job re-forms at world size 2 (no restart spent), resumes, and finishes with
exit 0. Steps are continuous from each checkpoint; job_state.json lists the membership change;
nothing of the job is left on the cluster.

Not tested here: a 2 -> 1 shrink when an actor is lost while nothing else claims its CPU (on
one Ray node the freed CPU comes straight back, so the job re-forms at 2), and a whole Ray node
lost (a second raylet on loopback: ``ray start`` refuses it, ``ray.cluster_utils`` timed out
starting one on this loaded machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import SCRIPTS, base_env, live_pids, start_fleetrun, wait_for

from collective.env import find_free_port
from launcher.schedulers.ray.cluster import LOOPBACK_ENV

pytest.importorskip("ray")

SCRIPT = str(SCRIPTS / "elastic_resume_ray.py")
HOLD = str(SCRIPTS / "elastic_resume_ray_hold.py")
STATE = str(SCRIPTS / "ray_cluster_state.py")
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _env() -> dict[str, str]:
    return {**base_env(), **LOOPBACK_ENV}


@pytest.fixture
def cluster() -> Iterator[str]:
    """``ray start --head --block`` on 127.0.0.1 with 2 CPUs; yields its address."""
    temp = tempfile.mkdtemp(prefix="fre-")  # short: Ray's unix socket paths must fit 107 bytes
    port = find_free_port()
    log = open(os.path.join(temp, "head.log"), "wb")  # noqa: SIM115 - closed below
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
            "--temp-dir",
            temp,
        ],
        env=_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert head.poll() is None, Path(temp, "head.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "ray head did not come up in 90 s"
                time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # ray start --block stops its cluster on SIGTERM
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _steps(out: Path) -> list[dict]:
    rows = []
    for path in sorted(out.glob("steps.rank*.jsonl")):
        rank = int(path.name.split(".")[1][4:])
        rows += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines()]
    return rows


@pytest.mark.timeout(420)
def test_actor_lost_job_reforms_with_what_it_places_then_grows(
    cluster: str, tmp_path: Path
) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    hold = subprocess.Popen(
        [sys.executable, HOLD, cluster, "1"],
        env=_env(),
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "hold.err", "w"),  # noqa: SIM115
        start_new_session=True,
    )
    p = None
    pids: list[int] = []
    try:
        assert hold.stdout is not None and hold.stdin is not None
        assert hold.stdout.readline().strip() == "HOLDING", (  # 1 of the 2 CPUs is taken
            (tmp_path / "hold.err").read_text()
        )
        job = tmp_path / "job.yaml"
        job.write_text(
            yaml.safe_dump(
                {
                    "name": "elastic-ray",
                    "scheduler": "ray",
                    "entrypoint": {
                        "script": SCRIPT,
                        "args": [
                            "--out",
                            str(out),
                            "--ckpt",
                            str(ckpt),
                            "--steps",
                            "20",
                            "--hold_step",
                            "10",
                        ],
                    },
                    "sizes": {"nnodes": "1:2"},
                    "elastic": {"standalone": True},
                    "max_restarts": 1,
                    "log_dir": str(tmp_path / "log"),
                    "grace_period_s": 2.0,
                    "tee": "all",
                    "resources": {"trainer": {"cpu": 1, "memory": "256Mi"}},
                    "ray": {"address": cluster, "placement_timeout_s": 90},
                    "env": {"OMP_NUM_THREADS": "1"},
                }
            )
        )
        p = start_fleetrun("-c", str(job))

        def trained(round_no: int, world: int, n: int) -> bool:
            assert p is not None and p.poll() is None, p.communicate()
            return (
                len(
                    [
                        r
                        for r in _steps(out)
                        if r["rank"] == 0 and r["round"] == round_no and r["world"] == world
                    ]
                )
                >= n
            )

        # (a rank at world size 1 holds at step 10 until the launcher re-forms the job)
        wait_for(lambda: trained(0, 1, 4), 180, "4 steps of round 0 at world size 1")
        pids += [json.loads(f.read_text())["pid"] for f in out.glob("proc.*.json")]
        actor = psutil.Process(json.loads((out / "proc.rank0.round0.json").read_text())["ppid"])
        assert "ProcessActor" in " ".join(actor.cmdline()), actor.cmdline()
        actor.kill()  # as when its node dies: the actor and its trainer are gone
        wait_for(
            lambda: p.poll() is None and (out / "proc.rank0.round1.json").exists(),
            180,
            "round 1 to start",
        )
        hold.stdin.write("release\n")
        hold.stdin.flush()
        assert hold.stdout.readline().strip() == "RELEASED"
        _, err = p.communicate(timeout=240)
    finally:
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if hold.poll() is None:
            hold.stdin.close() if hold.stdin else None
            try:
                hold.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(hold.pid, signal.SIGKILL)
                hold.wait()
    pids += [json.loads(f.read_text())["pid"] for f in out.glob("proc.*.json")]
    assert p.returncode == 0, err
    procs = {f.name: json.loads(f.read_text())["world"] for f in out.glob("proc.*.json")}
    assert procs == {
        "proc.rank0.round0.json": 1,
        "proc.rank0.round1.json": 1,
        "proc.rank0.round2.json": 2,
        "proc.rank1.round2.json": 2,
    }, procs
    rank0 = [r for r in _steps(out) if r["rank"] == 0]
    assert rank0[-1] == {"step": 20, "world": 2, "round": 2, "rank": 0}
    for prev, cur in zip(rank0, rank0[1:]):
        if cur["round"] == prev["round"]:
            assert cur["step"] == prev["step"] + 1
        else:  # a new round resumes right after a checkpoint (every 2 steps; a step is logged
            # after its save, so the newest save is the last logged step, or one before or after)
            resumed = cur["step"] - 1
            assert resumed % 2 == 0 and abs(resumed - prev["step"]) <= 1, (prev, cur)
    state = json.loads((tmp_path / "log" / "job_state.json").read_text())
    assert state["state"] == "succeeded" and state["restarts"] == 1  # the loss; growth is free
    assert any("(join)" in c and "world 1 -> 2" in c for c in state["membership_changes"]), state
    assert "membership change" in err
    deadline = time.monotonic() + 20
    while live_pids(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_pids(pids), f"orphans: {live_pids(pids)}"
    r = subprocess.run(
        [sys.executable, STATE, cluster],
        capture_output=True,
        text=True,
        timeout=90,
        env=_env(),
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"actors": [], "placement_groups": []}
