"""launcher/schedulers/k8s/client.py through the official kubernetes client, against an
in-memory stand-in of the API server (tests/scripts/k8s_fake_api.py; not Kubernetes: the test
plays the Job controller). Checks the requests fleetrun sends and how it reads the answers."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SCRIPTS

from collective.errors import LaunchError
from launcher.schedulers.k8s import client as k8s_client
from launcher.schedulers.k8s.job import run_k8s
from launcher.schedulers.k8s.render import INDEX_ANNOTATION, labels, render_job
from launcher.spec import build_spec

sys.path.insert(0, str(SCRIPTS))
from k8s_fake_api import FakeAPI

NS = "ml"


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
    monkeypatch.setattr(k8s_client, "POLL_S", 0.05)
    yield fake
    fake.close()


def _spec(cleanup: str = "on_success", **over: Any) -> Any:
    data: dict[str, Any] = {
        "name": "ctr",
        "scheduler": "k8s",
        "mode": "ps",
        "entrypoint": {"script": "examples/ctr/train_ps.py"},
        "sizes": {"server_num": 1, "worker_num": 2},
        "k8s": {"namespace": NS, "gang": True, "cleanup": cleanup},
    }
    data.update(over)
    return build_spec(data)


def _pod_labels(spec: Any, role: str) -> dict[str, str]:
    return {**labels(spec, role), "fleetrun.io/nproc-per-node": "1"}


@pytest.mark.timeout(60)
def test_apply_creates_suspended_job_then_owned_objects_then_resumes(api: FakeAPI) -> None:
    spec = _spec()
    objs = render_job(spec)
    k8s_client.apply(objs, NS)
    posts = [(path, body) for method, path, body in api.requests if method == "POST"]
    assert (
        posts[0][0] == f"/apis/batch/v1/namespaces/{NS}/jobs"
        and posts[0][1]["spec"]["suspend"] is True
    )
    job_uid = api.objects[("jobs", NS, "ctr-trainer")]["metadata"]["uid"]
    created = {(body["kind"], body["metadata"]["name"]) for _, body in posts[1:]}
    assert created == {(o["kind"], o["metadata"]["name"]) for o in objs if o["kind"] != "Job"}
    for _, body in posts[1:]:
        (ref,) = body["metadata"]["ownerReferences"]
        assert ref["kind"] == "Job" and ref["uid"] == job_uid and ref["name"] == "ctr-trainer"
    assert any(p == "/apis/scheduling.volcano.sh/v1beta1/namespaces/ml/podgroups" for p, _ in posts)
    method, path, body = api.requests[-1]
    assert (
        method == "PATCH"
        and path.endswith("/jobs/ctr-trainer")
        and body == {"spec": {"suspend": False}}
    )
    # what was sent is what fleetrun rendered (the client did not drop or rename fields)
    sent_job = posts[0][1]
    assert (
        sent_job["spec"]["template"]["spec"]["containers"][0]["args"]
        == objs[-1]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    with pytest.raises(LaunchError, match="already exists"):
        k8s_client.apply(objs, NS)


@pytest.mark.timeout(60)
def test_apply_forbidden_names_rbac_and_removes_the_half_created_job(api: FakeAPI) -> None:
    api.fail[("POST", "statefulsets")] = 403
    with pytest.raises(LaunchError, match="forbidden.*deploy/k8s/rbac.yaml"):
        k8s_client.apply(render_job(_spec()), NS)
    assert ("jobs", NS, "ctr-trainer") not in api.objects
    assert any(m == "DELETE" and p.endswith("/jobs/ctr-trainer") for m, p, _ in api.requests)


def _play_controller(api: FakeAPI, spec: Any, outcome: str) -> threading.Thread:
    """Once the Job is resumed: pods appear, run, then the Job completes or fails."""

    def run() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            job = api.objects.get(("jobs", NS, "ctr-trainer"))
            if job and job["spec"].get("suspend") is False:
                break
            time.sleep(0.02)
        api.add_pod(NS, "ctr-server-0", _pod_labels(spec, "server"), {}, "Running")
        for i in (0, 1):
            api.add_pod(
                NS,
                f"ctr-trainer-{i}-abcde",
                _pod_labels(spec, "trainer"),
                {INDEX_ANNOTATION: str(i)},
                "Running",
            )
        time.sleep(0.3)
        if outcome == "Complete":
            for i in (0, 1):
                api.add_pod(
                    NS,
                    f"ctr-trainer-{i}-abcde",
                    _pod_labels(spec, "trainer"),
                    {INDEX_ANNOTATION: str(i)},
                    "Succeeded",
                    exit_code=0,
                )
            api.set_job_condition(NS, "ctr-trainer", "Complete", succeeded=2)
        elif outcome == "Failed":
            api.add_pod(
                NS,
                "ctr-trainer-1-abcde",
                _pod_labels(spec, "trainer"),
                {INDEX_ANNOTATION: "1"},
                "Failed",
                exit_code=1,
                message="Root cause (first observed failure): bad batch",
            )
            api.set_job_condition(NS, "ctr-trainer", "Failed", failed=1)
        else:  # the server crashed and was restarted by its StatefulSet
            api.add_pod(
                NS,
                "ctr-server-0",
                _pod_labels(spec, "server"),
                {},
                "Running",
                last_exit=1,
                message="RuntimeError: table lost",
            )

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(60)
def test_run_k8s_streams_to_success_and_cleans_up(
    api: FakeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    spec = _spec("on_success")
    t = _play_controller(api, spec, "Complete")
    with caplog.at_level("INFO", logger="launcher"):
        assert run_k8s(spec) == 0
    t.join(5)
    kinds_left = {p for (p, _, _) in api.objects if p != "pods"}
    assert kinds_left == set(), api.objects.keys()
    assert "pod ctr-trainer-0-abcde: Running" in caplog.text and "succeeded" in caplog.text


@pytest.mark.timeout(30)
def test_logs_by_rank_of_an_elastic_job_say_why_there_is_none(api: FakeAPI) -> None:
    """An elastic job's trainer pods (a NonIndexed Job) have no completion index: a rank is not
    any pod's for good, so --rank is refused naming why; without it every pod's log is read."""
    spec = _spec()
    for i in (0, 1):
        api.add_pod(NS, f"ctr-trainer-{i}x", _pod_labels(spec, "trainer"), {}, "Running")
    from click.testing import CliRunner

    from launcher.commands import tools

    r = CliRunner().invoke(tools, ["logs", "ctr", "--rank", "0", "-n", NS])
    assert r.exit_code == 1 and "is elastic" in r.output and "without --rank" in r.output, r.output
    r = CliRunner().invoke(tools, ["logs", "ctr", "-n", NS])
    assert r.exit_code == 0 and "log of ctr-trainer-1x" in r.stdout, r.output


@pytest.mark.timeout(120)
def test_run_k8s_failure_keeps_objects_and_tools_read_them(
    api: FakeAPI, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = _spec("on_success")
    t = _play_controller(api, spec, "Failed")
    with caplog.at_level("INFO", logger="launcher"):
        assert run_k8s(spec) == 1
    t.join(5)
    assert "bad batch" in caplog.text  # the pod's termination message (fleetrun pod's summary)
    assert ("jobs", NS, "ctr-trainer") in api.objects  # on_success keeps a failed job
    from click.testing import CliRunner

    from launcher.commands import tools

    def cli(*args: str) -> Any:  # the real subcommands, in this process (no interpreter start)
        return CliRunner().invoke(tools, [*args, "-n", NS])

    r = cli("status", "ctr")
    assert r.exit_code == 0, r.output
    assert "Job ctr-trainer: active 0, succeeded 0, failed 1, state Failed" in r.stdout
    assert "ctr-trainer-1-abcde" in r.stdout and "exit 1" in r.stdout
    r = cli("logs", "ctr", "--rank", "1")
    assert (
        r.exit_code == 0
        and r.stdout == "==== ctr-trainer-1-abcde ====\nlog of ctr-trainer-1-abcde\n"
    ), r.output
    r = cli("logs", "ctr", "--server", "0")
    assert r.exit_code == 0 and "log of ctr-server-0" in r.stdout, r.output
    r = cli("logs", "ctr", "--rank", "7")
    assert r.exit_code == 1 and "no rank 7 pod" in r.output
    r = cli("delete", "ctr")
    assert r.exit_code == 0, r.output
    for what in (
        "Job/ctr-trainer",
        "StatefulSet/ctr-server",
        "Service/ctr-trainer",
        "Service/ctr-server",
        "ConfigMap/ctr-config",
        "PodGroup/ctr",
    ):
        assert what in r.stdout
    r = cli("status", "ctr")
    pods_left = any(p == "pods" for (p, _, _) in api.objects)
    assert pods_left or r.exit_code == 1  # the fake has no garbage collector for the pods


@pytest.mark.timeout(60)
def test_failed_server_fails_the_job(api: FakeAPI, caplog: pytest.LogCaptureFixture) -> None:
    spec = _spec("always")
    t = _play_controller(api, spec, "server-crash")
    with caplog.at_level("INFO", logger="launcher"):
        assert run_k8s(spec) == 1
    t.join(5)
    assert (
        "server pod ctr-server-0 exited with code 1" in caplog.text and "table lost" in caplog.text
    )
    assert ("jobs", NS, "ctr-trainer") not in api.objects  # cleanup: always
