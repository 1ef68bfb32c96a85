"""fleetrun in parameter-server mode: servers + trainers, env for both roles, clean stop,
failures of either role named in the summary, no orphans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SCRIPTS, live_pids, run_fleetrun, start_fleetrun

from collective.env import find_free_port, read_worker_env, usable_cpus

SCRIPT = str(SCRIPTS / "launcher_ps_worker.py")


def _recs(out: Path) -> dict[str, dict]:
    return {f.stem: json.loads(f.read_text()) for f in out.glob("*.json")}


@pytest.mark.timeout(60)
def test_local_ps_job_env_logs_and_clean_stop(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "log"
    r = run_fleetrun(
        "--server_num",
        "2",
        "--worker_num",
        "3",
        "--log_dir",
        str(logs),
        "--tee",
        "all",
        SCRIPT,
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    recs = _recs(out)
    assert sorted(recs) == ["server0", "server1", "trainer0", "trainer1", "trainer2"]
    servers = recs["server0"]["env"]["PADDLE_PSERVERS_IP_PORT_LIST"].split(",")
    assert len(servers) == 2
    threads = str(max(1, usable_cpus() // 5))  # the node's CPUs over its 5 processes
    for i in range(2):
        env = read_worker_env(recs[f"server{i}"]["env"])
        assert env.training_role == "PSERVER" and env.server_index == i and env.world_size == 3
        assert recs[f"server{i}"]["env"]["FLEET_PS_TABLE_THREADS"] == threads
    assert "FLEET_PS_TABLE_THREADS" not in recs["trainer0"]["env"]
    for t in range(3):
        raw = recs[f"trainer{t}"]["env"]
        env = read_worker_env(raw)
        assert env.training_role == "TRAINER" and env.rank == t and env.world_size == 3
        assert env.pserver_endpoints == tuple(servers)
        assert raw["PADDLE_TRAINER_ID"] == raw["RANK"] == str(t)
    assert "[server 1] server 1 serving on" in r.stdout and "[rank 2] trainer 2 done" in r.stdout
    assert (logs / "serverlog.0").exists() and (logs / "workerlog.2").exists()
    assert "server 1 " in (logs / "endpoints.log").read_text()


@pytest.mark.timeout(60)
def test_servers_that_do_not_stop_are_terminated_after_trainers_succeed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = tmp_path / "job.yaml"
    job.write_text(f"""
entrypoint: {{script: {SCRIPT}, args: ["--out", "{out}", "--server_stays"]}}
mode: ps
sizes: {{server_num: 1, worker_num: 2}}
ps: {{server_grace_s: 0.5}}
log_dir: {tmp_path / "log"}
""")
    r = run_fleetrun("-c", str(job), timeout=45)  # below pytest's: a hang shows fleetrun's output
    assert r.returncode == 0, r.stderr
    assert not live_pids([rec["pid"] for rec in _recs(out).values()])


@pytest.mark.timeout(60)
def test_server_failure_is_the_named_root_cause(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_fleetrun(
        "--server_num",
        "2",
        "--worker_num",
        "2",
        "--log_dir",
        str(tmp_path / "log"),
        SCRIPT,
        "--out",
        str(out),
        "--fail_server",
        "1",
        "--server_stays",
        timeout=45,
    )
    assert r.returncode == 1
    assert "server   : rank 1" not in r.stderr
    assert "server   : index 1" in r.stderr
    assert "RuntimeError: server 1 lost its table" in r.stderr
    assert "serverlog.1 (root cause)" in r.stderr
    assert not live_pids([rec["pid"] for rec in _recs(out).values()])


@pytest.mark.timeout(60)
def test_trainer_failure_stops_servers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # fleetrun's own timeout below pytest's: a hang shows fleetrun's output (seen once in CI)
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "2",
        "--log_dir",
        str(tmp_path / "log"),
        SCRIPT,
        "--out",
        str(out),
        "--fail_trainer",
        "1",
        "--server_stays",
        timeout=45,
    )
    assert r.returncode == 1
    assert "trainer  : rank 1" in r.stderr and "ValueError: trainer 1 got a bad batch" in r.stderr
    assert not live_pids([rec["pid"] for rec in _recs(out).values()])


@pytest.mark.timeout(60)
def test_static_endpoint_lists_on_two_loopback_nodes(tmp_path: Path) -> None:
    """--servers/--workers: each "node" (127.0.0.1 and 127.0.0.2) runs the entries with its IP."""
    out = tmp_path / "out"
    servers = f"127.0.0.1:{find_free_port()},127.0.0.2:{find_free_port('127.0.0.2')}"
    workers = f"127.0.0.1:{find_free_port()},127.0.0.2:{find_free_port('127.0.0.2')}"
    token = {"FLEET_PS_TOKEN": "shared-by-both-nodes-0123456789"}  # nodes do not talk: one secret
    nodes = [
        start_fleetrun(
            "--servers",
            servers,
            "--workers",
            workers,
            "--pod_ip",
            ip,
            "--log_dir",
            str(tmp_path / ip),
            SCRIPT,
            "--out",
            str(out),
            env=token,
        )
        for ip in ("127.0.0.1", "127.0.0.2")
    ]
    for n in nodes:
        _, err = n.communicate(timeout=50)
        assert n.returncode == 0, err
    recs = _recs(out)
    assert recs["server1"]["env"]["POD_IP"] == "127.0.0.2"
    assert recs["trainer1"]["env"]["PADDLE_CURRENT_ENDPOINT"] == workers.split(",")[1]
    assert recs["trainer1"]["env"]["MASTER_ADDR"] == "127.0.0.1"
    r = run_fleetrun("--servers", servers, "--workers", workers, SCRIPT, "--out", str(out))
    assert r.returncode == 2 and "pass --pod_ip" in r.stderr


@pytest.mark.timeout(60)
def test_bind_cpus_gives_each_server_its_share_of_the_host(tmp_path: Path) -> None:
    """``--ps_bind_cpus``: each server runs on its own block of the CPUs (the bootstrap binds
    it and drops FLEET_PS_CPU_SHARE); the trainers keep every CPU."""
    import os

    from collective.cpu_share import share_of

    out = tmp_path / "out"
    cpus = sorted(os.sched_getaffinity(0))
    r = run_fleetrun(
        "--server_num", "2", "--worker_num", "1", "--ps_bind_cpus",
        "--log_dir", str(tmp_path / "log"), SCRIPT, "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    recs = _recs(out)
    for i in range(2):
        assert recs[f"server{i}"]["cpus"] == share_of(cpus, i, 2)
        assert "FLEET_PS_CPU_SHARE" not in recs[f"server{i}"]["env"]
    if len(cpus) >= 2:
        assert not set(recs["server0"]["cpus"]) & set(recs["server1"]["cpus"])
    assert recs["trainer0"]["cpus"] == cpus
    unbound = tmp_path / "unbound"
    r = run_fleetrun("--server_num", "2", "--worker_num", "1", "--log_dir",
                     str(tmp_path / "log2"), SCRIPT, "--out", str(unbound))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert _recs(unbound)["server1"]["cpus"] == cpus


def test_ray_servers_get_their_share_of_their_node() -> None:
    """On Ray the shares are counted per node: the servers placed on one node split it."""
    pytest.importorskip("ray")
    from launcher.schedulers.ray.plan import AttemptPaths, Placed, make_proc_specs, make_slots
    from launcher.spec import build_spec

    data = {
        "entrypoint": {"script": "t.py"},
        "mode": "ps",
        "scheduler": "ray",
        "sizes": {"server_num": 3, "worker_num": 1},
        "ps": {"bind_cpus": True},
    }
    slots = make_slots(build_spec(data))
    nodes = {("server", 0): "a", ("server", 1): "b", ("server", 2): "a", ("trainer", 0): "b"}
    placed = [
        Placed(s, f"10.0.0.{ord(nodes[s.role, s.index])}", nodes[s.role, s.index], (), 7000 + i)
        for i, s in enumerate(slots)
    ]
    procs, _ = make_proc_specs(build_spec(data), placed, 0, AttemptPaths("r", 0, 0, "/l", None))
    shares = {(p.role, p.rank): p.env.get("FLEET_PS_CPU_SHARE") for p in procs}
    assert shares == {
        ("server", 0): "0/2",
        ("server", 1): "0/1",
        ("server", 2): "1/2",
        ("trainer", 0): None,
    }
    del data["ps"]
    procs, _ = make_proc_specs(build_spec(data), placed, 0, AttemptPaths("r", 0, 0, "/l", None))
    assert all("FLEET_PS_CPU_SHARE" not in p.env for p in procs)


def test_bind_cpus_is_for_ps_jobs() -> None:
    from collective.errors import ConfigError
    from launcher.spec import build_spec

    with pytest.raises(ConfigError, match="ps.bind_cpus"):
        build_spec({"entrypoint": {"script": "t.py"}, "ps": {"bind_cpus": True}})
