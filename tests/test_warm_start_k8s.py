"""Warm starts on Kubernetes: the rendered pods' fleetrun commands carry ``--warm_start`` and
``--warm_imports`` (fixed pods and elastic agents); a pod running several Python processes forks
them from one warm process, a pod running one starts it afresh. The pods run as local processes
with their manifests' env (tests/scripts/k8s_local.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, SCRIPTS

from launcher.schedulers.k8s.render import render_job
from launcher.spec import build_spec

sys.path.insert(0, str(SCRIPTS))
import k8s_local

PROBE = str(SCRIPTS / "warm_probe.py")


def _spec(**over: Any) -> Any:
    data: dict[str, Any] = {
        "name": "warm-a",
        "scheduler": "k8s",
        "entrypoint": {"script": PROBE},
        "sizes": {"nnodes": 1, "nproc_per_node": 2},
        "warm_start": "on",
        "warm_imports": ["json", "email.parser"],
    }
    data.update(over)
    return build_spec(data)


def _commands(objs: list[dict]) -> dict[str, list[str]]:
    out = {}
    for obj in objs:
        if obj["kind"] in ("Job", "StatefulSet") and not obj["metadata"]["name"].endswith("-etcd"):
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            out[obj["metadata"]["name"]] = [*container["command"], *container["args"]]
    return out


@pytest.mark.timeout(60)
def test_pod_commands_carry_warm_start() -> None:
    fixed = _commands(render_job(_spec()))
    elastic = _commands(
        render_job(
            _spec(
                sizes={"nnodes": "1:2", "nproc_per_node": 2},
                elastic={"rdzv_backend": "etcd-v2", "rdzv_endpoint": "warm-a-etcd:2379"},
            )
        )
    )
    ps = _commands(render_job(_spec(mode="ps", sizes={"server_num": 1, "worker_num": 2})))
    off = _commands(render_job(_spec(warm_start="off")))
    for argv in [*fixed.values(), *elastic.values(), *ps.values()]:
        i = argv.index("--warm_start")
        assert argv[i + 1] == "on" and argv.index("--") > i, argv
        assert argv[argv.index("--warm_imports") + 1] == "json,email.parser", argv
    assert elastic["warm-a-trainer"][:2] == ["fleetrun", "--nnodes"]  # the local elastic agent
    for argv in off.values():
        assert "--warm_start" not in argv and "--warm_imports" not in argv, argv


@pytest.mark.timeout(180)
def test_a_pods_processes_fork_from_one_warm_process(tmp_path: Path) -> None:
    spec = _spec(
        backend="gloo",
        log_dir=str(tmp_path / "log"),
        env={"PROBE_ACTION": "collective", "OMP_NUM_THREADS": "1"},
    )
    codes, outputs = k8s_local.run_pods(render_job(spec), tmp_path, REPO, 150)
    assert codes == {"warm-a-trainer-0-x7k2p": 0}, outputs
    log = tmp_path / "log"
    probes = []
    for rank in range(2):
        text = (log / f"workerlog.{rank}").read_text()
        (line,) = [ln for ln in text.splitlines() if ln.startswith("PROBE ")]
        probes.append(json.loads(line[6:]))
    assert all(p["forked"] for p in probes), probes
    assert probes[0]["ppid"] == probes[1]["ppid"]  # both the pod's fleetrun's children
    assert probes[0]["random"] != probes[1]["random"]
    assert probes[0]["argv"] == [PROBE]
    assert "ready in" in (log / "warmlog.trainer0").read_text()
    orig = probes[0]["orig_argv"]  # the warm process's, which a forked worker keeps
    assert orig[orig.index("email.parser") - 1] == "--later", orig
    assert "SUM 3.0" in (log / "workerlog.0").read_text()


@pytest.mark.timeout(120)
def test_a_one_process_pod_starts_it_afresh(tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = _spec(
        name="warm-ps",
        mode="ps",
        entrypoint={"script": str(SCRIPTS / "launcher_ps_worker.py"), "args": ["--out", str(out)]},
        sizes={"server_num": 1, "worker_num": 1},
        log_dir=str(tmp_path / "log"),
    )
    codes, outputs = k8s_local.run_pods(render_job(spec), tmp_path, REPO, 90)
    assert set(codes.values()) == {0}, outputs
    assert not list((tmp_path / "log").glob("warmlog.*"))
