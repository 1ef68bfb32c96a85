"""The GraphSAGE graph-table job file (configs/graphsage_ps.yaml, small sizes through overrides)
on the other schedulers:

- Kubernetes: the render of the job file validates against the Kubernetes OpenAPI schemas, the
  servers get their checkpoint roots (and so their default data roots), and each pod's command
  runs as a local process with exactly the manifest's env (tests/scripts/k8s_local.py) to a
  trained model;
- Ray: the job file's plan places 2 servers and 2 trainers with the PS env contract (no
  cluster), and the job runs on the loopback Ray cluster of tests/test_ray_scheduler.py (its
  own temp dir, usage stats off) to a trained model (slow).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, run_fleetrun
from test_k8s_manifests import K8S_VERSIONS, _validate
from test_k8s_pods import _run
from test_ray_scheduler import _assert_nothing_left, cluster  # noqa: F401 - the module's cluster

from launcher.attempt import SERVER, TRAINER
from launcher.schedulers.k8s.render import render_job
from launcher.schedulers.ray.plan import make_slots
from launcher.spec import build_spec

JOB_FILE = REPO / "configs" / "graphsage_ps.yaml"
SMALL = ["--nodes", "400", "--classes", "2", "--epochs", "1", "--fanouts", "4", "2"]
SMALL += ["--hidden", "8", "--batch_size", "64", "--lr", "0.05"]
"""Overrides of the job file's arguments (argparse: the last value wins). The learning rate:
at the job file's 0.01 the 4 steps a trainer takes on this graph leave the model near chance
(0.55 to 0.6 test accuracy with seed 0, in one process too); at 0.05 it reaches 0.83 to 0.94
over seeds 0 to 3 in one process."""
RESOURCES = {r: {"cpu": 0.5, "memory": "512Mi"} for r in ("trainer", "server")}


def _job(tmp: Path, **over: Any) -> dict[str, Any]:
    """The job file with the small sizes, a result file and ``over`` (top-level keys)."""
    data = copy.deepcopy(yaml.safe_load(JOB_FILE.read_text()))
    entry = data["entrypoint"]
    entry["args"] = [*entry["args"], *SMALL, "--json", str(tmp / "result.json")]
    data.update(log_dir=str(tmp / "log"), env={"OMP_NUM_THREADS": "1"}, **over)
    return data


def _trained(tmp: Path, servers: int = 2) -> dict[str, Any]:
    result = json.loads((tmp / "result.json").read_text())
    assert result["mode"] == "ps" and result["servers"] == servers and result["trainers"] == 2
    assert result["nodes"] == 400 and result["steps"] > 0
    assert result["test_acc"] > 0.6, result  # 2 planted classes: chance is 0.5
    return result


@pytest.mark.timeout(60)
def test_graphsage_job_renders_for_k8s(tmp_path: Path) -> None:
    spec = build_spec(_job(tmp_path, scheduler="k8s", name="graphsage"))
    objs = render_job(spec)
    for obj in objs:
        for version in K8S_VERSIONS:
            _validate(obj, version)
    kinds = {o["kind"] for o in objs}
    assert {"Job", "StatefulSet", "Service", "ConfigMap"} <= kinds, kinds
    (sts,) = [o for o in objs if o["kind"] == "StatefulSet"]
    assert sts["spec"]["replicas"] == 2
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FLEET_PS_CHECKPOINT_ROOT"]  # the servers' checkpoint (and default data) roots
    assert "examples/graph/graphsage_ps.py" in container["command"] + container.get("args", [])
    (job,) = [o for o in objs if o["kind"] == "Job"]
    assert job["spec"]["completions"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_graphsage_pods_train(tmp_path: Path) -> None:
    """Each pod's command as a local process with the manifest's env. One server: the local
    harness gives every pod of a StatefulSet the same port on 127.0.0.1."""
    data = _job(tmp_path, scheduler="k8s", name="graphsage-local")
    data["sizes"] = {"server_num": 1, "worker_num": 2}
    codes, outputs = _run(render_job(build_spec(data)), tmp_path, 280)
    assert codes == {
        "graphsage-local-server-0": 0,
        "graphsage-local-trainer-0-x7k2p": 0,
        "graphsage-local-trainer-1-x7k2p": 0,
    }, {n: o[-3000:] for n, o in outputs.items()}
    _trained(tmp_path, servers=1)


def test_graphsage_job_plans_on_ray(tmp_path: Path) -> None:

    spec = build_spec(_job(tmp_path, scheduler="ray", resources=RESOURCES))
    slots = make_slots(spec)
    assert sorted(s.role for s in slots) == sorted([SERVER, SERVER, TRAINER, TRAINER])
    assert all(s.bundle["CPU"] == 0.5 for s in slots)
    assert spec.entrypoint.script == "examples/graph/graphsage_ps.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_graphsage_job_on_ray(cluster: str, tmp_path: Path) -> None:  # noqa: F811
    data = _job(
        tmp_path,
        scheduler="ray",
        resources=RESOURCES,
        tee="none",
        grace_period_s=2.0,
        ray={"placement_timeout_s": 60, "address": cluster},
    )
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    r = run_fleetrun("-c", str(job), timeout=280)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    _trained(tmp_path)
    state = json.loads((tmp_path / "log" / "job_state.json").read_text())
    assert state["state"] == "succeeded"
    assert sorted(p["role"] for p in state["processes"]) == [
        "server",
        "server",
        "trainer",
        "trainer",
    ]
    _assert_nothing_left(cluster, [p["pid"] for p in state["processes"] if p.get("pid")])
