"""Kubernetes manifests: every rendered object and every file in deploy/k8s validates against the
Kubernetes OpenAPI schemas (kubernetes-validate, pinned versions, strict: unknown fields fail);
dry-run output; config errors; the Dockerfile; the client's errors without a cluster."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import REPO

from collective.errors import ConfigError, LaunchError
from launcher.schedulers.k8s.pod import _metrics as _pod_metrics
from launcher.schedulers.k8s.pod import pod_index
from launcher.schedulers.k8s.render import GROUP_ANNOTATION, render_job, to_yaml
from launcher.spec import build_spec

K8S_VERSIONS = ("1.28.0", "1.31.0")
"""Oldest Kubernetes fleetrun supports (Indexed Job pod hostnames, suspend, podFailure fields
GA) and the pinned reference version; both ship with kubernetes-validate 1.37."""
DEPLOY = REPO / "deploy" / "k8s"
EXAMPLE_TOKEN = "CHANGE-ME-render-your-own-with-fleetrun-dry_run"
"""The placeholder token of deploy/k8s/examples/ps.yaml (see deploy/k8s/README.md)."""
PODGROUP_SPEC_KEYS = {"minMember", "minResources", "minTaskMember", "queue", "priorityClassName"}


def _validate(obj: dict[str, Any], version: str) -> None:
    if obj.get("kind") == "PodGroup":  # a Volcano CRD: no schema ships with kubernetes-validate
        assert obj["apiVersion"] == "scheduling.volcano.sh/v1beta1"
        assert set(obj["metadata"]) <= {"name", "namespace", "labels", "annotations"}
        assert set(obj["spec"]) <= PODGROUP_SPEC_KEYS, obj["spec"]
        assert isinstance(obj["spec"]["minMember"], int) and obj["spec"]["minMember"] >= 1
        return
    kubernetes_validate.validate(obj, version, strict=True)


def _spec(**over: Any) -> Any:
    data: dict[str, Any] = {
        "name": "job-a",
        "scheduler": "k8s",
        "entrypoint": {"script": "examples/dp/train.py", "args": ["--steps", "5"]},
    }
    data.update(over)
    return build_spec(data)


VARIANTS = {
    "collective": {},
    "collective-2x2-gpu": {
        "sizes": {"nnodes": 2, "nproc_per_node": 2},
        "backend": "nccl",
        "resources": {"trainer": {"cpu": 0.5, "memory": "3Gi", "gpu": 1}},
        "strategy": {"gradient_merge": True},
        "max_restarts": 2,
    },
    "collective-gang-volumes-tolerations": {
        "sizes": {"nnodes": 3},
        "env": {"NCCL_DEBUG": "INFO"},
        "k8s": {
            "gang": True,
            "namespace": "team-x",
            "service_account": "trainer",
            "node_selector": {"pool": "gpu"},
            "image_pull_policy": "Always",
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "volumes": [
                {"name": "data", "persistentVolumeClaim": {"claimName": "imagenet"}},
                {"name": "shm", "emptyDir": {"medium": "Memory"}},
            ],
            "volume_mounts": [
                {"name": "data", "mountPath": "/data", "readOnly": True},
                {"name": "shm", "mountPath": "/dev/shm"},
            ],
            "ttl_seconds_after_finished": 600,
            "cleanup": "never",
        },
    },
    "ps": {
        "mode": "ps",
        "sizes": {"server_num": 2, "worker_num": 3},
        "entrypoint": {"script": "examples/ctr/train_ps.py"},
    },
    "ps-gang-volumes-tolerations": {
        "mode": "ps",
        "sizes": {"server_num": 1, "worker_num": 2},
        "strategy": "configs/strategy_dp.yaml",
        "entrypoint": {"module": "examples.ctr.train_ps", "args": ["--mode", "async"]},
        "k8s": {
            "gang": True,
            "scheduler_name": "volcano",
            "tolerations": [{"key": "a", "operator": "Exists"}],
            "volumes": [{"name": "ckpt", "emptyDir": {}}],
            "volume_mounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
        },
    },
    "no-metrics": {"metrics": False},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_objects_validate(
    variant: str, version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    over = dict(VARIANTS[variant])
    if (
        variant == "no-metrics"
        and "metrics" not in build_spec({"entrypoint": {"script": "x"}}).__dataclass_fields__
    ):
        pytest.skip("JobSpec has no metrics switch")
    spec = _spec(**over)
    objs = render_job(spec)
    for obj in objs:
        _validate(obj, version)
    kinds = [o["kind"] for o in objs]
    ps, gang = spec.mode.value == "ps", spec.k8s.gang
    assert kinds == [
        "ConfigMap",
        *(["Secret"] if ps else []),  # the PS job's token
        "Service",
        *(["Service"] if ps else []),
        *(["PodGroup"] if gang else []),
        *(["StatefulSet"] if ps else []),
        "Job",
    ]
    job = objs[-1]
    assert job["spec"]["completionMode"] == "Indexed"
    pods = job["spec"]["completions"] + (spec.sizes.server_num if ps else 0)
    if gang:
        assert objs[kinds.index("PodGroup")]["spec"]["minMember"] == pods
        assert job["spec"]["template"]["metadata"]["annotations"][GROUP_ANNOTATION] == spec.name
        assert job["spec"]["template"]["spec"]["schedulerName"] == "volcano"
    assert job["spec"]["backoffLimit"] == spec.max_restarts * job["spec"]["completions"]
    # the YAML stream round-trips
    assert list(yaml.safe_load_all(to_yaml(objs))) == objs


def test_collective_pod_details() -> None:
    spec = _spec(**VARIANTS["collective-2x2-gpu"])
    job = render_job(spec)[-1]
    pod = job["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["fleetrun"] and c["args"][:3] == ["pod", "--role", "trainer"]
    args = c["args"]
    assert (
        args[args.index("--trainer_host") + 1] == "job-a-trainer-{index}.job-a-trainer.default.svc"
    )
    assert args[args.index("--nproc_per_node") + 1] == "2"
    assert args[args.index("--") + 1 :] == ["examples/dp/train.py", "--steps", "5"]
    assert c["resources"]["requests"] == {"cpu": "1", "memory": "6Gi", "nvidia.com/gpu": "2"}
    assert c["resources"]["limits"] == {"memory": "6Gi", "nvidia.com/gpu": "2"}
    assert pod["spec"]["subdomain"] == "job-a-trainer" and pod["spec"]["restartPolicy"] == "Never"
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9400"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["FLEET_METRICS_PORT"] == "9400"
    # /metrics binds the pod IP (downward API), never 0.0.0.0; the kubelet expands $(VAR) only
    # from variables defined earlier in the list
    names = [e["name"] for e in c["env"]]
    assert env["FLEET_METRICS_HOST"] == "$(FLEET_POD_IP)"
    assert names.index("FLEET_POD_IP") < names.index("FLEET_METRICS_HOST")
    pod_ip = next(e for e in c["env"] if e["name"] == "FLEET_POD_IP")
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {p["containerPort"] for p in c["ports"]} == {29500, 9400, 9401}
    assert job["spec"]["backoffLimit"] == 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("environ", "host"),
    [
        ({"FLEET_POD_IP": "10.1.2.3"}, "10.1.2.3"),
        ({"FLEET_POD_IP": "10.1.2.3", "FLEET_METRICS_HOST": "10.9.9.9"}, "10.9.9.9"),
        ({}, "127.0.0.1"),
    ],
    ids=["pod-ip", "explicit", "loopback"],
)
def test_pod_metrics_host(
    environ: dict[str, str], host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fleetrun pod` gives each process FLEET_METRICS_HOST = the manifest's value, else the pod
    IP, else 127.0.0.1 (never every interface); local rank r gets port + r."""
    for key in ("FLEET_POD_IP", "FLEET_METRICS_HOST"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("FLEET_METRICS_PORT", "9400")
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    env = _pod_metrics({}, 1)
    assert env == {"FLEET_METRICS_PORT": "9401", "FLEET_METRICS_HOST": host}


def test_ps_server_statefulset() -> None:
    objs = render_job(_spec(**VARIANTS["ps"]))
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "job-a-server"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--role") + 1] == "server"
    assert args[args.index("--server_host") + 1] == "job-a-server-{index}.job-a-server.default.svc"
    assert objs[-1]["spec"]["completions"] == 3


def _deploy_docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((str(path.relative_to(REPO)), doc))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_deploy_files_validate(version: str) -> None:
    docs = _deploy_docs()
    kinds = {d["kind"] for _, d in docs}
    assert {
        "Namespace",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Job",
        "StatefulSet",
        "PodGroup",
    } <= kinds
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    for path, doc in docs:
        try:
            _validate(doc, version)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{path}: {doc['kind']} {doc['metadata'].get('name')}: {err}")


def test_kustomizations_list_existing_files() -> None:
    for path in DEPLOY.rglob("kustomization.yaml"):
        k = yaml.safe_load(path.read_text())
        assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
        for res in k["resources"]:
            assert (path.parent / res).is_file(), f"{path}: {res}"


def test_rbac_is_least_privilege() -> None:
    role = next(d for _, d in _deploy_docs() if d["kind"] == "Role")
    verbs = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert "*" not in {v for vs in verbs.values() for v in vs}
    assert verbs.get(("", "secrets")) == {"create"}  # a PS job's token: never read or listed
    assert ("", "pods/exec") not in verbs
    assert "create" not in verbs[("", "pods")]
    # every client call is allowed
    client_src = (REPO / "launcher/schedulers/k8s/client.py").read_text()
    needed = {
        ("batch", "jobs"): {"create", "patch", "get", "list", "delete"},
        ("apps", "statefulsets"): {"create", "list", "delete"},
        ("", "services"): {"create", "list", "delete"},
        ("", "configmaps"): {"create", "list", "delete"},
        ("", "pods"): {"list"},
        ("", "pods/log"): {"get"},
        ("scheduling.volcano.sh", "podgroups"): {"create", "list", "delete"},
    }
    for key, want in needed.items():
        assert want <= verbs[key], (key, verbs.get(key))
    assert "read_namespaced_pod_log" in client_src and "patch_namespaced_job" in client_src


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["dp_k8s", "ctr_ps_k8s"])
def test_dry_run_cli_matches_examples(name: str) -> None:
    """`fleetrun -c configs/NAME.yaml --dry_run` prints a YAML stream; deploy/k8s/examples holds
    exactly that (regenerate: see deploy/k8s/README.md)."""
    r = subprocess.run(
        [sys.executable, "-m", "launcher", "-c", f"configs/{name}.yaml", "--dry_run"],
        cwd=REPO,
        env={**os.environ, "FLEET_PS_TOKEN": EXAMPLE_TOKEN},  # else a random one per render
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    docs = list(yaml.safe_load_all(r.stdout))
    assert [d["kind"] for d in docs][-1] == "Job"
    example = DEPLOY / "examples" / ("collective.yaml" if name == "dp_k8s" else "ps.yaml")
    assert r.stdout == example.read_text(), (
        f"{example} is stale; regenerate it from configs/{name}.yaml"
    )


@pytest.mark.timeout(60)
def test_dry_run_from_flags() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "--scheduler",
            "k8s",
            "--dry_run",
            "--nnodes",
            "3",
            "--job_name",
            "flags",
            "examples/dp/train.py",
            "--steps",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    job = list(yaml.safe_load_all(r.stdout))[-1]
    assert job["metadata"]["name"] == "flags-trainer" and job["spec"]["completions"] == 3
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--steps", "3"]


BAD = [
    (
        {"k8s": {"image_pull_policy": "Sometimes"}},
        "k8s.image_pull_policy",
        "'Always' | 'IfNotPresent' | 'Never'",
    ),
    ({"name": "My_Job"}, "name", "lower-case"),
    ({"k8s": {"namespace": "Team X"}}, "k8s.namespace", "DNS label"),
    (
        {"k8s": {"volume_mounts": [{"name": "data", "mountPath": "/data"}]}},
        "k8s.volume_mounts[0].name",
        "add it there",
    ),
    (
        {
            "k8s": {
                "volumes": [{"name": "c", "emptyDir": {}}],
                "volume_mounts": [{"name": "c", "mountPath": "/etc/fleetrun"}],
            }
        },
        "k8s.volume_mounts[0].mountPath",
        "another mountPath",
    ),
    ({"resources": {"trainer": {"memory": "2 gigs"}}}, "resources.trainer.memory", "quantity"),
    ({"k8s": {"master_port": 9400}}, "k8s.metrics_port", "must differ"),
    ({"k8s": {"server_port": 70000}}, "k8s.server_port", "1..65535"),
    ({"k8s": {"ttl_seconds_after_finished": -1}}, "k8s.ttl_seconds_after_finished", ">= 0"),
    ({"k8s": {"cleanup": "sometimes"}}, "k8s.cleanup", "'on_success'"),
    (
        {"mode": "ps", "ps": {"servers": "10.0.0.1:8000", "workers": "10.0.0.2:8001"}},
        "ps.servers",
        "server_num",
    ),
    ({"rendezvous": {"ips": ["10.0.0.1", "10.0.0.2"]}}, "rendezvous", "Services"),
    ({"strategy": "configs/nope.yaml"}, "strategy", "cannot be read"),
]


@pytest.mark.parametrize(
    ("over", "key", "text"), BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)]
)
def test_bad_config_errors(
    over: dict[str, Any], key: str, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as err:
        render_job(_spec(**over))
    assert err.value.key == key and text in str(err.value), str(err.value)


@pytest.mark.timeout(60)
def test_bad_config_cli_exit_code(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: bad\nscheduler: k8s\nentrypoint: {script: x.py}\n"
        "k8s: {image_pull_policy: Sometimes}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "launcher", "-c", str(job), "--dry_run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        r.returncode == 2 and "k8s.image_pull_policy" in r.stderr and "IfNotPresent" in r.stderr
    ), r.stderr


def _no_cluster_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(tmp_path / "missing-kubeconfig")
    env["HOME"] = str(tmp_path)
    return env


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv",
    [
        ["status", "job-a"],
        ["logs", "job-a", "--rank", "1"],
        ["delete", "job-a"],
        ["-c", "configs/dp_k8s.yaml"],
    ],
)
def test_without_cluster_clear_error(argv: list[str], tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "launcher", *argv],
        cwd=REPO,
        env=_no_cluster_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1 and "no Kubernetes cluster configured" in r.stderr, r.stderr


def test_pod_index_sources() -> None:
    assert pod_index({"FLEET_POD_INDEX": "3", "JOB_COMPLETION_INDEX": "1"}, "trainer") == 3
    assert pod_index({"JOB_COMPLETION_INDEX": "1"}, "trainer") == 1
    assert pod_index({"FLEET_POD_NAME": "ctr-server-12"}, "server") == 12
    assert pod_index({"HOSTNAME": "ctr-server-0"}, "server") == 0
    with pytest.raises(LaunchError, match="does not end in -ORDINAL"):
        pod_index({"FLEET_POD_NAME": "standalone"}, "server")
    with pytest.raises(LaunchError, match="not a pod index"):
        pod_index({"FLEET_POD_INDEX": "x"}, "trainer")


def _dockerfile() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_parses_sensibly() -> None:
    """No Docker engine here: the Dockerfile is parsed, not built."""
    known = {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "ENTRYPOINT", "CMD", "LABEL"}
    ins = _dockerfile()
    assert {w for w, _ in ins} <= known, {w for w, _ in ins} - known
    words = [w for w, _ in ins]
    assert words.index("FROM") > 0 and ins[0][0] == "ARG"  # base image picked by a build arg
    args = dict(a.partition("=")[::2] for w, a in ins if w == "ARG")
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", args["BASE"]), args["BASE"]
    assert "whl/cpu" in args["TORCH_INDEX"] and args["TORCH_VERSION"]
    assert ("ENTRYPOINT", '["fleetrun"]') in ins
    user = [a for w, a in ins if w == "USER"]
    assert user and user[-1] not in ("root", "0")
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert "-c constraints.txt" in runs and "torch==${TORCH_VERSION}" in runs
    for w, a in ins:
        if w == "COPY":
            *srcs, _dest = shlex.split(a)
            for src in srcs:
                if "*" not in src:
                    assert (REPO / src).exists(), src
    ignore = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore
