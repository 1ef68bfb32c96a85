"""fleetrun sets both env families, logs per rank, picks free ports, runs torchrun scripts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, base_env, fleetrun_cmd, run_fleetrun, start_fleetrun

WORKER = str(SCRIPTS / "launcher_worker.py")


def _records(out: Path) -> dict[int, dict]:
    recs = {}
    for f in out.glob("rank*.attempt0.json"):
        rank = int(f.name.split(".")[0][4:])
        recs[rank] = json.loads(f.read_text())
    return recs


@pytest.mark.timeout(60)
def test_both_env_families_and_logs(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "log"
    r = run_fleetrun("--nproc_per_node", "3", "--log_dir", str(logs), WORKER, "--out", str(out))
    assert r.returncode == 0, r.stderr
    recs = _records(out)
    assert sorted(recs) == [0, 1, 2]
    endpoints = recs[0]["env"]["PADDLE_TRAINER_ENDPOINTS"].split(",")
    assert len(endpoints) == 3 and len(set(endpoints)) == 3
    ports = set()
    for rank, rec in recs.items():
        env = rec["env"]
        assert env["RANK"] == env["PADDLE_TRAINER_ID"] == str(rank)
        assert env["LOCAL_RANK"] == env["PADDLE_RANK_IN_NODE"] == str(rank)
        assert env["WORLD_SIZE"] == env["PADDLE_TRAINERS_NUM"] == "3"
        assert env["LOCAL_WORLD_SIZE"] == "3" and env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        ports.add(env["MASTER_PORT"])
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == recs[0]["env"]["TORCHELASTIC_RUN_ID"]
        assert env["PADDLE_TRAINER_ENDPOINTS"].split(",") == endpoints
        assert env["PADDLE_CURRENT_ENDPOINT"] == endpoints[rank]
        assert env["TRAINING_ROLE"] == "TRAINER" and env["POD_IP"] == "127.0.0.1"
        assert env["FLEET_ERROR_FILE"].endswith(f"error.{rank}.json")
        assert env["FLEET_LOG_DIR"] == str(logs)
        assert env["OMP_NUM_THREADS"] == "1"
        assert rec["argv"] == ["--out", str(out)]
        assert f"worker rank {rank} done" in (logs / f"workerlog.{rank}").read_text()
    assert len(ports) == 1
    assert "trainer 2 " in (logs / "endpoints.log").read_text()
    # console shows rank 0 only by default, the resolved config table on stderr
    assert "worker rank 0 done" in r.stdout and "worker rank 1 done" not in r.stdout
    assert "nodes      : 1 x 3 trainers = world 3" in r.stderr


@pytest.mark.timeout(60)
def test_tee_all_prefixes_ranks_and_module_mode(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_fleetrun(
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(tmp_path / "log"),
        "--tee",
        "all",
        "-m",
        "launcher_worker",
        "--out",
        str(out),
        cwd=SCRIPTS,
    )
    assert r.returncode == 0, r.stderr
    assert "[rank 0] worker rank 0 done" in r.stdout and "[rank 1] worker rank 1 done" in r.stdout
    assert sorted(_records(out)) == [0, 1]


@pytest.mark.timeout(60)
def test_worker_env_parses_back(tmp_path: Path) -> None:
    """The worker-side parser reads what the launcher wrote, for every rank."""
    script = tmp_path / "parse.py"
    script.write_text(
        "from collective.env import read_worker_env\n"
        "e = read_worker_env()\n"
        "print('PARSED', e.rank, e.world_size, e.local_rank, e.launched, e.current_endpoint, flush=True)\n"
    )
    r = run_fleetrun(
        "--nproc_per_node", "2", "--tee", "all", "--log_dir", str(tmp_path / "l"), str(script)
    )
    assert r.returncode == 0, r.stderr
    assert "PARSED 0 2 0 True 127.0.0.1:" in r.stdout and "PARSED 1 2 1 True 127.0.0.1:" in r.stdout


@pytest.mark.timeout(120)
def test_torchrun_script_runs_unchanged(tmp_path: Path) -> None:
    r = run_fleetrun(
        "--nproc_per_node",
        "2",
        "--tee",
        "all",
        "--log_dir",
        str(tmp_path / "log"),
        str(SCRIPTS / "torchrun_ddp.py"),
        timeout=100,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 0] TORCHRUN_OK rank=0 world=2" in r.stdout
    assert "[rank 1] TORCHRUN_OK rank=1 world=2" in r.stdout


@pytest.mark.timeout(60)
def test_two_jobs_at_once_get_their_own_ports(tmp_path: Path) -> None:
    jobs = [
        start_fleetrun(
            "--nproc_per_node",
            "2",
            "--log_dir",
            str(tmp_path / f"log{i}"),
            WORKER,
            "--out",
            str(tmp_path / f"out{i}"),
            "--delay",
            "0",
        )
        for i in range(2)
    ]
    for j in jobs:
        _, err = j.communicate(timeout=50)
        assert j.returncode == 0, err
    ports = {_records(tmp_path / f"out{i}")[0]["env"]["MASTER_PORT"] for i in range(2)}
    assert len(ports) == 2


@pytest.mark.timeout(60)
def test_a_picked_port_is_not_handed_out_again_before_it_is_bound() -> None:
    """Ports picked on this machine are claimed: picks in this process and in another one (a
    second job's launcher) never hand out the same port while the first is still unbound."""
    code = "from collective.env import find_free_port as f; print(*[f() for _ in range(200)])"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    from collective.env import find_free_port

    mine = [find_free_port() for _ in range(200)]
    theirs = [int(p) for p in other.stdout.split()]
    assert len(set(mine)) == 200 and len(set(theirs)) == 200
    assert not set(mine) & set(theirs)


@pytest.mark.timeout(60)
def test_busy_explicit_port_is_named(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_fleetrun(
            "--master_port", str(port), "--log_dir", str(tmp_path), WORKER, "--out", str(tmp_path)
        )
    assert r.returncode == 1
    assert f"master port {port} on 127.0.0.1 is busy" in r.stderr


@pytest.mark.timeout(60)
def test_explicit_port_is_used(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    r = run_fleetrun(
        "--master_port",
        str(port),
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(tmp_path / "l"),
        WORKER,
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert {rec["env"]["MASTER_PORT"] for rec in _records(out).values()} == {str(port)}


@pytest.mark.timeout(60)
def test_console_script_and_python_m_agree(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "fleetrun"
    if not exe.exists():
        pytest.skip("console script not installed in this environment")
    a = subprocess.run(
        [str(exe), "--help"],
        capture_output=True,
        text=True,
        env=base_env(),
        timeout=30,
        check=False,
    )
    b = subprocess.run(
        fleetrun_cmd("--help"),
        capture_output=True,
        text=True,
        env=base_env(),
        timeout=30,
        check=False,
    )
    assert a.returncode == b.returncode == 0
    assert a.stdout.replace("fleetrun", "") == b.stdout.replace("fleetrun", "")
