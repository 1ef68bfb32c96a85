"""Heter workers on Kubernetes: the rendered manifests validate against the Kubernetes schemas
(strict), heter pods are their own StatefulSet with GPU resources for cuda devices, every pod
learns the heter workers' endpoints, bad heter settings are named; and the rendered pods, run
as local processes (tests/scripts/k8s_local.py), complete a heter job."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from conftest import REPO, SCRIPTS

from collective.env import read_worker_env
from collective.errors import ConfigError
from launcher.schedulers.k8s.render import render_job
from launcher.spec import build_spec

sys.path.insert(0, str(SCRIPTS))
import k8s_local

K8S_VERSIONS = ("1.28.0", "1.31.0")
SCRIPT = str(SCRIPTS / "launcher_heter_worker.py")


def _spec(**over: Any) -> Any:
    data: dict[str, Any] = {
        "name": "heter-a",
        "scheduler": "k8s",
        "entrypoint": {"script": SCRIPT, "args": ["--out", "/tmp/x"]},
        "sizes": {"server_num": 2, "worker_num": 3, "heter_worker_num": 2},
    }
    data.update(over)
    return build_spec(data)


def _by_name(objs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("over", "gpus"),
    [
        ({"ps": {"heter_devices": "gpu"}}, "1"),
        ({"ps": {"heter_devices": ["cuda:1", "cuda:0"]}, "k8s": {"gang": True}}, "2"),
        ({}, None),
    ],
    ids=["cuda", "cuda-N-gang", "cpu"],
)
def test_heter_manifests_validate_with_device_resources(over: dict, gpus: str | None) -> None:
    objs = render_job(_spec(**over))
    for obj in objs:
        for version in K8S_VERSIONS:
            if obj["kind"] != "PodGroup":  # a Volcano CRD (tests/test_k8s_manifests.py)
                kubernetes_validate.validate(obj, version, strict=True)
    named = _by_name(objs)
    heter = named[("StatefulSet", "heter-a-heter")]
    assert heter["spec"]["replicas"] == 2 and heter["spec"]["serviceName"] == "heter-a-heter"
    assert ("Service", "heter-a-heter") in named
    (container,) = heter["spec"]["template"]["spec"]["containers"]
    assert heter["spec"]["template"]["metadata"]["labels"]["fleetrun.io/role"] == "heter"
    assert container["ports"][0] == {"name": "heter", "containerPort": 8600}
    assert container["resources"]["limits"].get("nvidia.com/gpu") == gpus
    assert container["resources"]["requests"].get("nvidia.com/gpu") == gpus
    server = named[("StatefulSet", "heter-a-server")]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in server["containers"][0]["resources"]["limits"]
    trainer = named[("Job", "heter-a-trainer")]["spec"]["template"]["spec"]["containers"][0]
    for args in (container["args"], server["containers"][0]["args"], trainer["args"]):
        assert _arg(args, "--heters") == "2" and _arg(args, "--heter_port") == "8600"
        assert _arg(args, "--heter_host") == "heter-a-heter-{index}.heter-a-heter.default.svc"
    assert _arg(container["args"], "--role") == "heter"
    if ("PodGroup", "heter-a") in named:  # every pod of the job: 2 servers, 2 heter, 3 trainers
        assert named[("PodGroup", "heter-a")]["spec"]["minMember"] == 7


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("over", "key"),
    [
        ({"ps": {"heter_devices": "cpu,cuda"}}, "ps.heter_devices"),
        ({"k8s": {"heter_port": 8500}}, "metrics_port"),
    ],
)
def test_bad_heter_settings_on_kubernetes_are_named(over: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        render_job(_spec(**over))


@pytest.mark.timeout(30)
def test_no_heter_objects_without_heter_workers() -> None:
    objs = render_job(_spec(sizes={"server_num": 1, "worker_num": 1}))
    assert not [o for o in objs if o["metadata"]["name"].endswith("-heter")]
    trainer = _by_name(objs)[("Job", "heter-a-trainer")]["spec"]["template"]["spec"]
    assert "--heter_host" not in trainer["containers"][0]["args"]


@pytest.mark.timeout(120)
def test_heter_pods_run_a_heter_job(tmp_path: Path) -> None:
    """1 server + 1 heter worker + 2 trainers as local processes with their manifests' env."""
    out = tmp_path / "out"
    spec = _spec(
        entrypoint={"script": SCRIPT, "args": ["--out", str(out)]},
        sizes={"server_num": 1, "worker_num": 2, "heter_worker_num": 1},
        ps={"heter_devices": "cpu"},
        log_dir=str(tmp_path / "log"),
    )
    codes, outputs = k8s_local.run_pods(render_job(spec), tmp_path, REPO, 90)
    assert set(codes.values()) == {0}, outputs
    (heter_file,) = out.glob("heter0.*.json")
    heter = json.loads(heter_file.read_text())
    env = read_worker_env(heter["env"])
    assert env.training_role == "HETER_TRAINER" and env.heter_index == 0
    assert env.heter_device == "cpu" and env.pod_ip == "127.0.0.1"
    for t in range(2):
        trainer = read_worker_env(json.loads((out / f"trainer{t}.json").read_text())["env"])
        assert trainer.heter_endpoints == env.heter_endpoints == (env.current_endpoint,)
    assert (tmp_path / "log" / "heterlog.0").exists()
    assert "heter stopped cleanly" in outputs["heter-a-heter-0"]
