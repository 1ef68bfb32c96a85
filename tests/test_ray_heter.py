"""Heter workers on the Ray scheduler: their bundles (``num_gpus`` for cuda devices, none for
cpu) and env from where the actors landed (no cluster), and a heter job run to the end on a
local Ray cluster fleetrun starts bound to 127.0.0.1 (usage stats off)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import SCRIPTS, live_pids, run_fleetrun

from collective.env import read_worker_env
from launcher.attempt import SERVER, TRAINER
from launcher.heter_spec import HETER
from launcher.schedulers.ray.cluster import LOOPBACK_ENV
from launcher.schedulers.ray.plan import AttemptPaths, Placed, make_proc_specs, make_slots
from launcher.spec import build_spec

pytest.importorskip("ray")

SCRIPT = str(SCRIPTS / "launcher_heter_worker.py")
SMALL = {"cpu": 0.5, "memory": "256Mi"}


@pytest.mark.timeout(30)
def test_heter_bundles_and_env_from_placement() -> None:
    spec = build_spec(
        {
            "entrypoint": {"script": "t.py"},
            "scheduler": "ray",
            "sizes": {"server_num": 1, "worker_num": 2, "heter_worker_num": 3},
            "ps": {"heter_devices": "cpu,gpu,cuda:1"},
            "resources": {"heter": {"cpu": 2, "memory": "1Gi"}},
        }
    )
    slots = make_slots(spec)
    assert [s.role for s in slots] == [SERVER, HETER, HETER, HETER, TRAINER, TRAINER]
    assert [s.bundle.get("GPU", 0) for s in slots[1:4]] == [0, 1.0, 2.0]
    assert slots[1].bundle == {"CPU": 2.0, "memory": float(2**30)}
    gpus = [(), (), ("3",), ("4", "5"), (), ()]
    placed = [Placed(s, "10.0.0.1", "a", g, 7000 + i) for i, (s, g) in enumerate(zip(slots, gpus))]
    procs, _ = make_proc_specs(spec, placed, 0, AttemptPaths("rid", 0, 0, "/logs", None))
    heters = [p for p in procs if p.role == HETER]
    envs = [read_worker_env(p.env) for p in heters]
    assert [e.heter_index for e in envs] == [0, 1, 2]
    assert [e.heter_device for e in envs] == ["cpu", "cuda", "cuda:1"]
    assert envs[0].heter_endpoints == ("10.0.0.1:7001", "10.0.0.1:7002", "10.0.0.1:7003")
    assert heters[2].env["CUDA_VISIBLE_DEVICES"] == "4,5" and heters[2].log_path.endswith(
        "heterlog.2"
    )
    trainer = read_worker_env(next(p for p in procs if p.role == TRAINER).env)
    assert trainer.heter_endpoints == envs[0].heter_endpoints


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_heter_job_runs_to_the_end_on_a_local_ray_cluster(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "log"
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "rayheter",
                "scheduler": "ray",
                "entrypoint": {"script": SCRIPT, "args": ["--out", str(out)]},
                "sizes": {"server_num": 1, "worker_num": 2, "heter_worker_num": 1},
                "resources": {"trainer": SMALL, "server": SMALL, "heter": SMALL},
                "log_dir": str(logs),
                "tee": "all",
                "grace_period_s": 2.0,
                "ray": {"placement_timeout_s": 60, "num_cpus": 4},
            }
        )
    )
    r = run_fleetrun("-c", str(job), timeout=200, env={**LOOPBACK_ENV, "RAY_ADDRESS": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    (heter_file,) = out.glob("heter0.*.json")
    heter = json.loads(heter_file.read_text())
    assert heter["heter_device"] == "cpu" and heter["heter_index"] == 0
    for t in range(2):
        env = read_worker_env(json.loads((out / f"trainer{t}.json").read_text())["env"])
        assert list(env.heter_endpoints) == heter["heter_endpoints"]
    assert "[heter 0] heter worker 0 on cpu" in r.stdout
    assert (logs / "heterlog.0").exists()
    state = json.loads((logs / "job_state.json").read_text())
    assert state["state"] == "succeeded"
    assert sorted(p["role"] for p in state["processes"]) == [
        "heter",
        "server",
        "trainer",
        "trainer",
    ]
    assert not live_pids([heter["pid"]])
