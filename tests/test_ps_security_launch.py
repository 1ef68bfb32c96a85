"""How the PS job's token and checkpoint roots reach the processes: fleetrun locally (one random
token per job, never printed or written to the log dir), static multi-node layouts (a token the
user shares), Ray (the same env from the planner) and Kubernetes (a Secret the pods reference)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from conftest import REPO, SCRIPTS, run_fleetrun

from launcher.ps_env import FLEET_PS_CHECKPOINT_ROOT, FLEET_PS_TOKEN
from launcher.schedulers.k8s.render import object_names, render_job
from launcher.schedulers.ray.plan import AttemptPaths, Placed, make_proc_specs, make_slots
from launcher.spec import build_spec
from ps_server.checkpoint.roots import CHECKPOINT_ROOT_ENV
from ps_server.rpc.auth import TOKEN_ENV

SCRIPT = str(SCRIPTS / "launcher_ps_worker.py")


def test_the_launcher_and_the_server_read_the_same_variables() -> None:
    assert FLEET_PS_TOKEN == TOKEN_ENV and FLEET_PS_CHECKPOINT_ROOT == CHECKPOINT_ROOT_ENV


def _envs(out: Path) -> dict[str, dict[str, str]]:
    return {f.stem: json.loads(f.read_text())["env"] for f in out.glob("*.json")}


@pytest.mark.timeout(60)
def test_local_ps_job_gets_one_token_that_is_never_printed(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "log"
    r = run_fleetrun(
        "--server_num",
        "2",
        "--worker_num",
        "2",
        "--log_dir",
        str(logs),
        "--tee",
        "all",
        SCRIPT,
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    envs = _envs(out)
    tokens = {env[FLEET_PS_TOKEN] for env in envs.values()}
    assert len(envs) == 4 and len(tokens) == 1
    (token,) = tokens
    assert len(token) >= 32
    for name, env in envs.items():
        roots = env.get(FLEET_PS_CHECKPOINT_ROOT)
        assert roots == (f"{REPO}{os.pathsep}{logs}" if name.startswith("server") else None), name
    assert token not in r.stdout and token not in r.stderr
    written = [p for p in logs.rglob("*") if p.is_file()]
    assert {"job.yaml", "endpoints.log"} <= {p.name for p in written}
    for path in written:
        assert token not in path.read_text(errors="replace"), path
    # the next job gets another token
    again = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--log_dir",
        str(tmp_path / "log2"),
        SCRIPT,
        "--out",
        str(tmp_path / "out2"),
    )
    assert again.returncode == 0, again.stderr
    assert _envs(tmp_path / "out2")["server0"][FLEET_PS_TOKEN] != token


@pytest.mark.timeout(60)
def test_the_users_token_and_roots_win(tmp_path: Path) -> None:
    out = tmp_path / "out"
    mine = {
        FLEET_PS_TOKEN: "the-users-own-token-0123456789",
        FLEET_PS_CHECKPOINT_ROOT: str(tmp_path),
    }
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--log_dir",
        str(tmp_path / "log"),
        SCRIPT,
        "--out",
        str(out),
        env=mine,
    )
    assert r.returncode == 0, r.stderr
    for env in _envs(out).values():
        assert env[FLEET_PS_TOKEN] == mine[FLEET_PS_TOKEN]
    assert _envs(out)["server0"][FLEET_PS_CHECKPOINT_ROOT] == str(tmp_path)


@pytest.mark.timeout(60)
def test_static_layout_over_several_nodes_needs_a_shared_token() -> None:
    r = run_fleetrun(
        "--servers",
        "127.0.0.1:7001,127.0.0.2:7002",
        "--workers",
        "127.0.0.1:7003",
        "--pod_ip",
        "127.0.0.1",
        SCRIPT,
        "--out",
        "/nonexistent",
    )
    assert r.returncode == 2
    assert FLEET_PS_TOKEN in r.stderr and "every node" in r.stderr


def test_ray_planner_gives_every_process_the_job_token() -> None:
    spec = build_spec(
        {
            "entrypoint": {"script": "t.py"},
            "mode": "ps",
            "scheduler": "ray",
            "sizes": {"server_num": 1, "worker_num": 2},
        }
    )
    placed = [Placed(s, "10.0.0.1", "a", (), 7000 + i) for i, s in enumerate(make_slots(spec))]
    paths = AttemptPaths("rid", 0, 0, "/logs", None, ps_token="tok-0123456789abcdef", cwd="/work")
    procs, _ = make_proc_specs(spec, placed, 0, paths)
    assert {p.env[FLEET_PS_TOKEN] for p in procs} == {"tok-0123456789abcdef"}
    roots = {p.role: p.env.get(FLEET_PS_CHECKPOINT_ROOT) for p in procs}
    assert roots == {"server": f"/work{os.pathsep}/logs", "trainer": None}


# -- Kubernetes -----------------------------------------------------------------------------------
def _k8s_spec(**over: Any) -> Any:
    data: dict[str, Any] = {
        "name": "ctr",
        "scheduler": "k8s",
        "mode": "ps",
        "entrypoint": {"script": "examples/ctr/train_ps.py"},
        "sizes": {"server_num": 2, "worker_num": 2},
    }
    data.update(over)
    return build_spec(data)


def _containers(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        o["kind"]: o["spec"]["template"]["spec"]["containers"][0]
        for o in objs
        if o["kind"] in ("Job", "StatefulSet")
    }


@pytest.mark.parametrize("version", ["1.28.0", "1.31.0"])
def test_k8s_ps_job_carries_a_secret_the_pods_reference(version: str) -> None:
    spec = _k8s_spec(
        env={FLEET_PS_TOKEN: "from-the-job-env-0123456789", "A": "1"},
        k8s={
            "volumes": [{"name": "ck", "emptyDir": {}}],
            "volume_mounts": [{"name": "ck", "mountPath": "/ckpt"}],
        },
    )
    objs = render_job(spec)
    for obj in objs:
        if obj["kind"] != "PodGroup":
            kubernetes_validate.validate(obj, version, strict=True)
    (secret,) = [o for o in objs if o["kind"] == "Secret"]
    name = object_names(spec)["token"]
    assert secret["metadata"]["name"] == name and secret["immutable"] is True
    assert secret["stringData"] == {"token": "from-the-job-env-0123456789"}
    for kind, container in _containers(objs).items():
        env = {e["name"]: e for e in container["env"]}
        assert env[FLEET_PS_TOKEN] == {
            "name": FLEET_PS_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": name, "key": "token"}},
        }
        assert "from-the-job-env" not in json.dumps(container)  # only in the Secret
        root = env.get(FLEET_PS_CHECKPOINT_ROOT, {}).get("value")
        assert root == (f".:{spec.log_dir}:/ckpt" if kind == "StatefulSet" else None), kind


def test_k8s_token_is_random_per_job_and_collective_jobs_have_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(FLEET_PS_TOKEN, raising=False)
    first, second = (
        next(o for o in render_job(_k8s_spec()) if o["kind"] == "Secret") for _ in range(2)
    )
    assert first["stringData"]["token"] != second["stringData"]["token"]
    assert len(first["stringData"]["token"]) >= 32
    collective = render_job(
        build_spec({"name": "dp", "scheduler": "k8s", "entrypoint": {"script": "t.py"}})
    )
    assert "Secret" not in {o["kind"] for o in collective}
    assert FLEET_PS_TOKEN not in json.dumps(collective)


def test_job_yaml_never_holds_the_token_of_the_job_env(tmp_path: Path) -> None:
    from launcher.job_files import write_job_file

    spec = build_spec(
        {
            "entrypoint": {"script": "train.py"},
            "mode": "ps",
            "log_dir": str(tmp_path),
            "sizes": {"server_num": 1, "worker_num": 1},
            "env": {FLEET_PS_TOKEN: "secret-from-the-job-file-0123", "OTHER": "kept"},
        }
    )
    text = Path(write_job_file(spec)).read_text()
    assert "secret-from-the-job-file-0123" not in text
    assert "<redacted>" in text and "kept" in text
    assert spec.env[FLEET_PS_TOKEN] == "secret-from-the-job-file-0123"  # the processes still get it
