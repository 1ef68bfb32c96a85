"""Elastic collective jobs on Kubernetes: the rendered manifests (one elastic
agent per pod, up to MAX pods of a NonIndexed Job that replaces lost pods, the job's own etcd
as the stable rendezvous endpoint, or a given one) validate against the Kubernetes schemas;
``fleetrun k8s scale JOB N`` sends the Job's new parallelism through the official client (to
the in-memory stand-in of the API server, tests/scripts/k8s_fake_api.py) and refuses N outside
MIN..MAX; the pods' commands, run as local processes with the env their manifest gives them
(tests/scripts/k8s_local.py) and the job's etcd replaced by a local one (scripts/etcd.sh),
meet in an elastic rendezvous and train examples/dp/train.py --elastic to the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from conftest import REPO, SCRIPTS, base_env, fleetrun_cmd

from collective.errors import ConfigError, LaunchError
from launcher.schedulers.k8s import client as k8s_client
from launcher.schedulers.k8s.render import render_job, to_yaml
from launcher.spec import build_spec

sys.path.insert(0, str(SCRIPTS))
import k8s_local
from k8s_fake_api import FakeAPI

K8S_VERSIONS = ("1.28.0", "1.31.0")
NS = "ml"


def _spec(**over: Any) -> Any:
    data: dict[str, Any] = {
        "name": "dp",
        "scheduler": "k8s",
        "entrypoint": {"script": "examples/dp/train.py", "args": ["--elastic"]},
        "sizes": {"nnodes": "1:4"},
        "elastic": {"rdzv_backend": "etcd-v2", "rdzv_endpoint": "dp-etcd"},
        "max_restarts": 2,
        "k8s": {"namespace": NS},
    }
    data.update(over)
    return build_spec(data)


def _by_kind(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


@pytest.mark.timeout(60)
def test_elastic_manifests_render_agents_etcd_and_a_replacing_job() -> None:
    objs = render_job(_spec(k8s={"namespace": NS, "gang": True}, strategy={"amp": False}))
    for obj in objs:
        if obj["kind"] != "PodGroup":
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
    kinds = _by_kind(objs)
    assert [o["kind"] for o in objs] == ["ConfigMap", "Service", "StatefulSet", "PodGroup", "Job"]
    assert ("Service", "dp-trainer") not in kinds  # the agents meet at etcd, not through DNS
    etcd = kinds[("StatefulSet", "dp-etcd")]["spec"]["template"]["spec"]["containers"][0]
    assert "--enable-v2=true" in etcd["command"]  # torch's etcd handlers speak etcd's v2 API
    assert kinds[("Service", "dp-etcd")]["spec"]["ports"][0]["port"] == 2379
    assert kinds[("PodGroup", "dp")]["spec"]["minMember"] == 1  # a round may start with MIN
    job = kinds[("Job", "dp-trainer")]
    assert job["metadata"]["annotations"] == {
        "fleetrun.io/min-nodes": "1",
        "fleetrun.io/max-nodes": "4",
    }
    spec = job["spec"]
    assert spec["completionMode"] == "NonIndexed" and spec["parallelism"] == 4
    assert "completions" not in spec  # a lost pod is replaced until one succeeds
    assert spec["backoffLimit"] == 2
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [2]
    assert rules[1] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and "subdomain" not in pod
    (container,) = pod["containers"]
    args = container["args"]
    assert container["command"] == ["fleetrun"]
    assert args[:10] == [
        "--nnodes",
        "1:4",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "etcd-v2",
        "--rdzv_endpoint",
        "dp-etcd.ml.svc:2379",
        "--rdzv_id",
        "dp",
    ]
    assert args[args.index("--strategy") + 1] == "/etc/fleetrun/strategy.yaml"
    assert args[args.index("--") + 1 :] == ["examples/dp/train.py", "--elastic"]
    assert not any(e["name"] == "FLEET_POD_INDEX" for e in container["env"])  # ranks: rendezvous
    assert "dp-etcd.ml.svc:2379" in to_yaml(objs)

    # Paddle's spelling; an etcd of one's own: used as given, nothing rendered for it
    mine = render_job(
        _spec(
            elastic={"rdzv_endpoint": "etcd://etcd.infra.svc:2379"},
            sizes={"nnodes": "2:3"},
            run_id="run-7",
        )
    )
    for obj in mine:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    assert [o["kind"] for o in mine] == ["ConfigMap", "Job"]
    args = mine[-1]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:10] == [
        "--nnodes",
        "2:3",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "etcd",
        "--rdzv_endpoint",
        "etcd.infra.svc:2379",
        "--rdzv_id",
        "run-7",
    ]


@pytest.mark.timeout(60)
def test_elastic_manifest_bad_input_names_the_key() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^elastic\.rdzv_backend: .*serves rdzv_backend etcd "
        r"and etcd-v2, not c10d",
    ):
        render_job(_spec(elastic={"rdzv_backend": "c10d", "rdzv_endpoint": "dp-etcd:2379"}))
    with pytest.raises(
        ConfigError,
        match=r"^elastic\.rdzv_endpoint: .*not a place the pods can "
        r"reach.*--rdzv_endpoint dp-etcd",
    ):
        render_job(_spec(elastic={"rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:29400"}))
    with pytest.raises(ConfigError, match=r"^elastic\.rdzv_endpoint: "):
        render_job(_spec(elastic={"standalone": True}))


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAPI]:
    fake = FakeAPI()
    kubeconfig = tmp_path / "kubeconfig"
    fake.write_kubeconfig(kubeconfig)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    for var in (
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
        "HTTPS_PROXY",
        "HTTP_PROXY",
        "https_proxy",
        "http_proxy",
    ):
        monkeypatch.delenv(var, raising=False)
    yield fake
    fake.close()


@pytest.mark.timeout(90)
def test_k8s_scale_patches_parallelism_within_the_node_range(api: FakeAPI, tmp_path: Path) -> None:
    k8s_client.apply(render_job(_spec()), NS)
    sent = len(api.requests)
    assert "4 -> 2 trainer pod(s) (node range 1..4)" in k8s_client.scale_job("dp", NS, 2)
    method, path, body = api.requests[-1]
    assert (method, body) == ("PATCH", {"spec": {"parallelism": 2}})
    assert path == f"/apis/batch/v1/namespaces/{NS}/jobs/dp-trainer"
    assert api.objects[("jobs", NS, "dp-trainer")]["spec"]["parallelism"] == 2
    assert len(api.requests) == sent + 2  # one read, one patch

    for bad in (0, 5):  # outside MIN..MAX: refused before any change is sent
        with pytest.raises(
            ConfigError,
            match=rf"^N: {bad} is outside job 'dp''s node range "
            r"1\.\.4 \(--nnodes 1:4\)",
        ):
            k8s_client.scale_job("dp", NS, bad)
    assert [m for m, _, _ in api.requests[sent + 2 :]] == ["GET", "GET"]
    with pytest.raises(LaunchError, match="no job 'nope' in namespace ml"):
        k8s_client.scale_job("nope", NS, 2)
    fixed = build_spec(
        {
            "name": "fixed",
            "scheduler": "k8s",
            "k8s": {"namespace": NS},
            "entrypoint": {"script": "examples/dp/train.py"},
        }
    )
    k8s_client.apply(render_job(fixed), NS)
    with pytest.raises(ConfigError, match="job 'fixed' is not an elastic job"):
        k8s_client.scale_job("fixed", NS, 2)

    # the command line: exit 2 and the message for a bad N, the new count otherwise
    env = {**base_env(), "KUBECONFIG": os.environ["KUBECONFIG"]}
    bad = subprocess.run(
        fleetrun_cmd("k8s", "scale", "dp", "7", "-n", NS),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "7 is outside job 'dp''s node range 1..4" in bad.stderr
    good = subprocess.run(
        fleetrun_cmd("k8s", "scale", "dp", "3", "-n", NS),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert good.returncode == 0 and "2 -> 3 trainer pod(s)" in good.stdout, good.stderr


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    """A local etcd (scripts/etcd.sh: private data dir, free port); its endpoint."""
    proc = subprocess.Popen(
        ["bash", str(REPO / "scripts" / "etcd.sh"), str(tmp_path / "etcd")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**base_env(), "PYTHON": sys.executable},
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("ETCD_ENDPOINT="):
            pytest.skip(f"scripts/etcd.sh could not start etcd: {line!r}")
        endpoint = line.strip().split("=", 1)[1]
        host, port = endpoint.split(":")
        deadline = time.monotonic() + 30
        while True:  # etcd answers its v2 API
            try:
                import urllib.request

                urllib.request.urlopen(f"http://{endpoint}/v2/keys", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "etcd did not come up in 30 s"
                time.sleep(0.2)
        yield endpoint
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.timeout(300)
def test_elastic_pods_run_locally_meet_at_etcd_and_train(tmp_path: Path, etcd: str) -> None:
    ckpt = tmp_path / "ckpt"
    spec = _spec(
        # MIN = MAX = 2: the first round waits for both pods (with MIN 1 a pod started late
        # could find the job already finished by the other)
        sizes={"nnodes": "2:2"},
        entrypoint={
            "script": "examples/dp/train.py",
            "args": [
                "--elastic",
                "--ckpt_dir",
                str(ckpt),
                "--steps",
                "20",
                "--save_every",
                "10",
                "--log_every",
                "10",
            ],
        },
        backend="gloo",
        log_dir=str(tmp_path / "log"),
        env={"OMP_NUM_THREADS": "1"},
        rendezvous={"timeout_s": 120},
    )
    objs = render_job(spec)
    runnable = [o for o in objs if o["metadata"]["name"] != "dp-etcd"]  # etcd: the local one
    pods = k8s_local.translate(runnable, tmp_path / "pods", REPO)
    assert [p.name for p in pods] == ["dp-trainer-x7k2a", "dp-trainer-x7k2b"]
    procs = []
    try:
        for pod in pods:
            i = pod.argv.index("--rdzv_endpoint")
            assert pod.argv[i + 1] == "127.0.0.1:2379"  # the Service's name, as k8s_local maps it
            pod.argv[i + 1] = etcd
            assert "JOB_COMPLETION_INDEX" not in pod.env  # a NonIndexed Job's pods have none
            procs.append((pod, k8s_local.start(pod, tmp_path / f"{pod.name}.out")))
        codes = {pod.name: proc.wait(240) for pod, proc in procs}
    finally:
        for _, proc in procs:
            k8s_local.stop(proc, signal.SIGKILL, 5)
    outputs = {pod.name: (tmp_path / f"{pod.name}.out").read_text() for pod, _ in procs}
    assert codes == {"dp-trainer-x7k2a": 0, "dp-trainer-x7k2b": 0}, outputs
    text = "\n".join(outputs.values())
    assert "training on 2 worker(s)" in text and "done: loss" in text, text
    saved = json.loads((ckpt / "step_00000020" / "elastic.json").read_text())
    assert saved["step"] == 20 and saved["world_size"] == 2
