"""fleetrun with heter workers (heterogeneous PS): flags and job-file keys, the env of every
role, logs ``heterlog.N``, the end of the job, a heter worker's failure named, and a heter
worker killed and restarted alone on its endpoint in an async job with recovery."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS, live_pids, run_fleetrun, start_fleetrun, wait_for

from collective.env import find_free_port, read_worker_env
from collective.errors import ConfigError
from launcher.dashboard.monitor import Target
from launcher.heter_spec import heter_devices, parse_heter_devices
from launcher.recovery.ps_policy import PSRecovery, make_recovery
from launcher.schedulers.local.plan import Placement, PSPlan
from launcher.spec import build_spec

SCRIPT = str(SCRIPTS / "launcher_heter_worker.py")
PS = {"sizes": {"server_num": 1, "worker_num": 2, "heter_worker_num": 2}}


def _heter_recs(out: Path, index: int) -> list[dict]:
    """What heter worker ``index`` wrote, one record per start, oldest first."""
    files = sorted(out.glob(f"heter{index}.*.json"), key=lambda f: f.stat().st_mtime_ns)
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("data", "key", "words"),
    [
        (
            {"sizes": {"nproc_per_node": 2, "heter_worker_num": 1}},
            "sizes.heter_worker_num",
            "no servers",
        ),
        (
            {
                "mode": "collective",
                "sizes": {"server_num": 1, "worker_num": 1, "heter_worker_num": 1},
            },
            "mode",
            "collective",
        ),
        (
            {**PS, "ps": {"heter_devices": "cpu,cuda,cuda"}},
            "ps.heter_devices",
            "3 devices for 2 heter workers",
        ),
        (
            {**PS, "ps": {"heter_devices": ["tpu"]}},
            r"ps.heter_devices\[0\]",
            "not a heter worker device",
        ),
        ({**PS, "ps": {"heter_devices": "cpu:1"}}, r"ps.heter_devices\[0\]", "cuda:N"),
        (
            {
                "sizes": {"heter_worker_num": 3},
                "ps": {
                    "servers": ["127.0.0.1:1"],
                    "workers": ["127.0.0.1:2"],
                    "heter_workers": ["127.0.0.1:3", "127.0.0.1:4"],
                },
            },
            "sizes.heter_worker_num",
            "lists 2",
        ),
        (
            {"sizes": {"server_num": 1, "worker_num": 1}, "ps": {"heter_workers": ["127.0.0.1:3"]}},
            "ps.heter_workers",
            "static",
        ),
        (
            {"sizes": {"server_num": 1, "worker_num": 1}, "ps": {"heter_devices": "cuda"}},
            "ps.heter_devices",
            "no heter workers",
        ),
        ({**PS, "ps": {"heter_workers": "127.0.0.1"}}, r"ps.heter_workers\[0\]", "ip:port"),
    ],
)
def test_bad_heter_settings_are_named(data: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError, match=key) as err:
        build_spec(data)
    assert words in str(err.value)


@pytest.mark.timeout(30)
def test_devices_one_for_all_or_one_each_gpu_read_as_cuda() -> None:
    assert parse_heter_devices("gpu, GPU:1 ,cpu", "k") == ("cuda", "cuda:1", "cpu")
    assert heter_devices(build_spec(PS)) == ("cpu", "cpu")
    assert heter_devices(build_spec({**PS, "ps": {"heter_devices": "gpu"}})) == ("cuda", "cuda")
    each = build_spec({**PS, "ps": {"heter_devices": ["cuda:1", "cuda:0"]}})
    assert heter_devices(each) == ("cuda:1", "cuda:0")


@pytest.mark.timeout(30)
def test_static_lists_run_this_nodes_heter_workers(tmp_path: Path) -> None:
    ports = [find_free_port("127.0.0.1") for _ in range(4)]
    spec = build_spec(
        {
            "ps": {
                "servers": f"127.0.0.1:{ports[0]}",
                "workers": f"127.0.0.1:{ports[1]},10.254.0.9:{ports[1]}",
                "heter_workers": [f"10.254.0.9:{ports[2]}", f"127.0.0.1:{ports[3]}"],
                "heter_devices": "cpu,gpu:0",
                "pod_ip": "127.0.0.1",
            },
            "entrypoint": {"script": SCRIPT},
            "log_dir": str(tmp_path / "log"),
            "env": {"FLEET_PS_TOKEN": "t" * 32},
        }
    )
    plan = PSPlan(spec, Placement(1, 0, "127.0.0.1", None, "127.0.0.1", "r1"), None)
    os.makedirs(spec.log_dir)
    specs = {(s.role, s.rank): s for s in plan.specs(0)}
    assert sorted(specs) == [("heter", 1), ("server", 0), ("trainer", 0)]
    heter = specs[("heter", 1)]
    env = read_worker_env(heter.env)
    assert env.training_role == "HETER_TRAINER" and env.heter_index == 1
    assert env.heter_device == "cuda:0" and env.current_endpoint == f"127.0.0.1:{ports[3]}"
    assert heter.log_path.endswith("heterlog.1") and heter.label == "heter worker 1"
    trainer_env = read_worker_env(specs[("trainer", 0)].env)
    assert trainer_env.heter_endpoints == env.heter_endpoints == tuple(spec.ps.heter_workers)


@pytest.mark.timeout(90)
def test_local_heter_job_env_logs_and_clean_stop(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "log"
    job = tmp_path / "job.yaml"
    job.write_text(f"""
entrypoint: {{script: {SCRIPT}, args: ["--out", "{out}", "--heter_stays"]}}
sizes: {{server_num: 1, worker_num: 2, heter_worker_num: 2}}
ps: {{heter_devices: [cpu, "gpu:1"], server_grace_s: 0.5}}
log_dir: {logs}
tee: all
""")
    r = run_fleetrun("-c", str(job), timeout=75)
    assert r.returncode == 0, r.stderr
    heters = [_heter_recs(out, i)[0] for i in range(2)]
    endpoints = heters[0]["heter_endpoints"]
    assert len(endpoints) == 2 and [h["current_endpoint"] for h in heters] == endpoints
    assert [h["heter_device"] for h in heters] == ["cpu", "cuda:1"]
    assert [h["heter_index"] for h in heters] == [0, 1] and heters[0]["world_size"] == 2
    assert heters[0]["env"]["TRAINING_ROLE"] == "HETER_TRAINER"
    servers = heters[0]["pserver_endpoints"]
    for t in range(2):
        raw = json.loads((out / f"trainer{t}.json").read_text())["env"]
        env = read_worker_env(raw)
        assert env.training_role == "TRAINER" and env.rank == t
        assert list(env.heter_endpoints) == endpoints and list(env.pserver_endpoints) == servers
    assert "[heter 1] heter worker 1 on cuda:1" in r.stdout
    assert (logs / "heterlog.0").exists() and (logs / "heterlog.1").exists()
    assert f"heter 1 {endpoints[1]}" in (logs / "endpoints.log").read_text()
    procs = json.loads((logs / "job_state.json").read_text())["processes"]
    assert sorted(p["role"] for p in procs) == ["heter", "heter", "server", "trainer", "trainer"]
    heter = next(p for p in procs if p["role"] == "heter")
    assert Target("heter", heter["rank"], heter["host"], heter["metrics"]).key.startswith("heter ")
    targets = json.loads((logs / "metrics_targets.json").read_text())
    assert sum(g["labels"]["role"] == "heter" for g in targets) == 2
    assert "1 server(s) + 2 trainer(s) + 2 heter worker(s) (cpu,cuda:1)" in r.stderr
    # the heter workers never stop on their own: stopped after server_grace_s, a clean end
    assert not live_pids([h["pid"] for h in heters])


@pytest.mark.timeout(60)
def test_heter_worker_failure_is_the_named_root_cause(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_fleetrun(
        "--server_num", "1", "--worker_num", "1", "--heter_worker_num", "2",
        "--log_dir", str(tmp_path / "log"),
        SCRIPT, "--out", str(out), "--fail_heter", "1", "--steps", "0",
        timeout=45,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "heter    : index 1" in r.stderr and "found no device" in r.stderr
    assert "heter worker 1" in r.stderr or "heterlog.1" in r.stderr
    assert not live_pids([json.loads(f.read_text())["pid"] for f in out.glob("*.json")])


@pytest.mark.timeout(30)
def test_heter_worker_alone_only_in_async_or_half_async(tmp_path: Path) -> None:
    spec = build_spec(
        {**PS, "ps_checkpoint": {"dir": str(tmp_path / "ck")}, "log_dir": str(tmp_path)}
    )
    rec = make_recovery(spec)
    assert isinstance(rec, PSRecovery)
    for mode, alone in (("sync", False), ("async", True), ("half-async", True)):
        for rank in range(2):
            (tmp_path / f"ps_progress.{rank}.json").write_text(
                json.dumps({"rank": rank, "attempt": 0, "step": 5, "mode": mode})
            )
        assert rec.alone_possible(0, "heter", True) is alone, mode
        assert rec.alone_possible(0, "heter", False) is False  # no restart left
    got = rec.recover_alone(0, "heter worker 1 signal SIGKILL (9)", "heter", 1, True)
    assert got is not None and "restarted: heter worker 1 only" in got.text()
    assert "FLEET_PS_COORDINATOR" not in rec.heter_env()


@pytest.mark.timeout(120)
def test_heter_worker_killed_is_restarted_alone_on_its_endpoint(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "log"
    p = start_fleetrun(
        "--server_num", "1", "--worker_num", "2", "--heter_worker_num", "1",
        "--ps_checkpoint_dir", str(tmp_path / "ck"), "--max_restarts", "1",
        "--log_dir", str(logs),
        SCRIPT, "--out", str(out), "--steps", "0", "--progress_mode", "async",
    )  # fmt: skip
    try:
        wait_for(
            lambda: len(list(logs.glob("ps_progress.*.json"))) == 2 and _heter_recs(out, 0),
            60,
            "the trainers stepping and the heter worker up",
        )
        first = _heter_recs(out, 0)[0]
        trainers = [json.loads((out / f"trainer{t}.json").read_text())["pid"] for t in range(2)]
        os.kill(first["pid"], signal.SIGKILL)
        wait_for(lambda: len(_heter_recs(out, 0)) == 2, 60, "the heter worker restarted")
        again = next(r for r in _heter_recs(out, 0) if r["pid"] != first["pid"])
        assert again["current_endpoint"] == first["current_endpoint"]
        assert again["env"]["PADDLE_HETER_TRAINER_DEVICE"] == "cpu"
        assert again["restart_count"] == first["restart_count"] == 0  # same env, same attempt
        assert not [t for t in trainers if t not in live_pids(trainers)]  # trainers went on
        time.sleep(0.3)
        (out / "finish").touch()
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 0, err
    assert "restarted: heter worker 0 only" in err
    state = json.loads((logs / "job_state.json").read_text())
    assert state["restarts"] == 1 and "heter worker 0" in state["recoveries"][0]
    assert "restarted alone" in (logs / "heterlog.0").read_text()
