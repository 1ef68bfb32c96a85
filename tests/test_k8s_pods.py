"""Run each rendered pod's container command as a local process, with exactly the env its
manifest gives it (tests/scripts/k8s_local.py: DNS names -> 127.0.0.1, ports remapped, the
ConfigMap mounted as a directory); the job must complete. No Kubernetes API server is involved."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO, SCRIPTS

from launcher.schedulers.k8s.render import render_job
from launcher.spec import build_spec

sys.path.insert(0, str(SCRIPTS))
import k8s_local


def _run(objs: list[dict], tmp_path: Path, timeout: float) -> tuple[dict[str, int], dict[str, str]]:
    """Start every pod; wait for the Job's pods; then stop the StatefulSet's once they hold (as
    the launcher's cleanup deletes it). Returns exit codes and outputs by pod name."""
    return k8s_local.run_pods(objs, tmp_path, REPO, timeout)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("nnodes", "nproc"), [(2, 1), (1, 2)], ids=["2pods", "1pod-2procs"])
def test_collective_pods_complete(tmp_path: Path, nnodes: int, nproc: int) -> None:
    out = tmp_path / "out"
    spec = build_spec(
        {
            "name": "dp-local",
            "scheduler": "k8s",
            "mode": "collective",
            "entrypoint": {"script": str(SCRIPTS / "k8s_worker.py"), "args": ["--out", str(out)]},
            "sizes": {"nnodes": nnodes, "nproc_per_node": nproc},
            "backend": "gloo",
            "log_dir": str(tmp_path / "log"),
            "env": {"MY_SETTING": "42", "OMP_NUM_THREADS": "1"},
            "strategy": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
            "k8s": {
                "namespace": "ml",
                "gang": True,
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
            },
        }
    )
    codes, outputs = _run(render_job(spec), tmp_path, 150)
    assert codes == {f"dp-local-trainer-{i}-x7k2p": 0 for i in range(nnodes)}, outputs
    for rank in (0, 1):
        got = json.loads((out / f"rank{rank}.json").read_text())
        env = got["env"]
        assert got["sum"] == 3.0
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == str(rank // nproc) and env["LOCAL_RANK"] == str(rank % nproc)
        assert len(env["PADDLE_TRAINER_ENDPOINTS"].split(",")) == 2
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TRAINING_ROLE"] == "TRAINER"
        assert env["FLEET_JOB_NAME"] == "dp-local" and env["MY_SETTING"] == "42"
        assert "k_steps: 2" in got["strategy"]
        assert env["FLEET_ERROR_FILE"].startswith(str(tmp_path / "log"))
    assert any("K8S_WORKER_OK rank=0 world=2" in o for o in outputs.values())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_collective_pod_failure_summary(tmp_path: Path) -> None:
    spec = build_spec(
        {
            "name": "dp-fail",
            "scheduler": "k8s",
            "entrypoint": {
                "script": str(SCRIPTS / "k8s_worker.py"),
                "args": ["--out", str(tmp_path / "out"), "--fail_rank", "1"],
            },
            "sizes": {"nnodes": 2},
            "backend": "gloo",
            "log_dir": str(tmp_path / "log"),
            "env": {"OMP_NUM_THREADS": "1"},
        }
    )
    codes, outputs = _run(render_job(spec), tmp_path, 200)
    assert codes["dp-fail-trainer-1-x7k2p"] == 1
    failed = outputs["dp-fail-trainer-1-x7k2p"]
    assert "Root cause" in failed and "RuntimeError: injected failure on rank 1" in failed, failed


@pytest.mark.timeout(120)
def test_ps_pods_wiring(tmp_path: Path) -> None:
    """1 server + 2 trainers with a torch-free fixture: the server binds POD_IP:PADDLE_PORT, the
    trainers reach it through PADDLE_PSERVERS_IP_PORT_LIST."""
    out = tmp_path / "out"
    spec = build_spec(
        {
            "name": "ps-wiring",
            "scheduler": "k8s",
            "mode": "ps",
            "entrypoint": {
                "script": str(SCRIPTS / "launcher_ps_worker.py"),
                "args": ["--out", str(out)],
            },
            "sizes": {"server_num": 1, "worker_num": 2},
            "log_dir": str(tmp_path / "log"),
        }
    )
    codes, outputs = _run(render_job(spec), tmp_path, 90)
    assert codes == {
        "ps-wiring-server-0": 0,
        "ps-wiring-trainer-0-x7k2p": 0,
        "ps-wiring-trainer-1-x7k2p": 0,
    }, outputs
    server = json.loads((out / "server0.json").read_text())["env"]
    assert server["TRAINING_ROLE"] == "PSERVER" and server["POD_IP"] == "127.0.0.1"
    for tid in (0, 1):
        env = json.loads((out / f"trainer{tid}.json").read_text())["env"]
        assert env["PADDLE_TRAINER_ID"] == str(tid) and env["PADDLE_TRAINERS_NUM"] == "2"
        assert env["PADDLE_PSERVERS_IP_PORT_LIST"] == f"127.0.0.1:{server['PADDLE_PORT']}"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TRAINING_ROLE"] == "TRAINER"
    assert "holding until the pod is deleted" in outputs["ps-wiring-server-0"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ps_pods_complete(tmp_path: Path) -> None:
    """A real fleet PS job (gRPC server, DistributedEmbedding trainers) in pods."""
    out = tmp_path / "ps.json"
    spec = build_spec(
        {
            "name": "ctr-local",
            "scheduler": "k8s",
            "mode": "ps",
            "entrypoint": {
                "script": str(SCRIPTS / "fleet_ps_train.py"),
                "args": ["--out", str(out), "--steps", "4"],
            },
            "sizes": {"server_num": 1, "worker_num": 2},
            "log_dir": str(tmp_path / "log"),
            "env": {"OMP_NUM_THREADS": "1"},
            "k8s": {
                "volumes": [{"name": "scratch", "emptyDir": {}}],
                "volume_mounts": [{"name": "scratch", "mountPath": "/scratch"}],
            },
        }
    )
    codes, outputs = _run(render_job(spec), tmp_path, 200)
    assert codes == {
        "ctr-local-server-0": 0,
        "ctr-local-trainer-0-x7k2p": 0,
        "ctr-local-trainer-1-x7k2p": 0,
    }, outputs
    result = json.loads(out.read_text())
    assert result, result
    assert "holding until the pod is deleted" in outputs["ctr-local-server-0"]
