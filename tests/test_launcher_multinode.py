"""Two fleetrun processes on 127.0.0.1 acting as two nodes (static rendezvous over TCPStore)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import SCRIPTS, run_fleetrun, start_fleetrun

from collective.env import find_free_port

SCRIPT = str(SCRIPTS / "multinode_allreduce.py")


def _nodes(tmp_path: Path, *extra: str, flags: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    port = str(find_free_port())
    return [
        start_fleetrun(
            "--nnodes", "2", "--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", port,
            "--nproc_per_node", "2", "--tee", "all", "--log_dir", str(tmp_path / f"node{n}"), *flags,
            SCRIPT, *extra,
        )
        for n in range(2)
    ]


def _finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str, str]]:
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, out, err))
    return results


@pytest.mark.timeout(150)
def test_two_nodes_on_loopback(tmp_path: Path) -> None:
    (rc0, out0, err0), (rc1, out1, err1) = _finish(_nodes(tmp_path))
    assert rc0 == 0 and rc1 == 0, err0 + err1
    for rank in range(4):
        node = rank // 2
        assert f"MULTINODE_OK rank={rank} world=4 node={node}" in (out0 if node == 0 else out1)
    assert (tmp_path / "node1" / "workerlog.3").exists()


@pytest.mark.timeout(150)
def test_failure_on_one_node_stops_both_and_restart_budget_is_global(tmp_path: Path) -> None:
    # rank 3 (node 1) fails on every attempt; node 0 asks for 1 restart, node 1 for 5:
    # node 0's budget is the job's, so exactly attempts 0 and 1 run.
    port = str(find_free_port())
    common = ["--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", port,
              "--nproc_per_node", "2", "--tee", "all"]
    procs = [
        start_fleetrun(*common, "--node_rank", "0", "--max_restarts", "1",
                       "--log_dir", str(tmp_path / "n0"), SCRIPT, "--fail_rank", "3"),
        start_fleetrun(*common, "--node_rank", "1", "--max_restarts", "5",
                       "--log_dir", str(tmp_path / "n1"), SCRIPT, "--fail_rank", "3"),
    ]
    (rc0, out0, err0), (rc1, out1, err1) = _finish(procs)
    assert rc0 == 1 and rc1 == 1, err0 + err1
    assert "RuntimeError: injected failure on rank 3" in err1
    assert "trainer  : rank 3 (local_rank 1, node 1)" in err1
    assert "node 1 reported: rank 3" in err0
    assert "restarts used 1/1" in err1
    assert "attempt=2" not in out0 + out1


@pytest.mark.timeout(60)
def test_node_that_never_arrives_is_named(tmp_path: Path) -> None:
    port = str(find_free_port())
    r = run_fleetrun("--nnodes", "2", "--node_rank", "0", "--master_port", port, "--rdzv_timeout", "2",
                     "--log_dir", str(tmp_path), SCRIPT, timeout=50)
    assert r.returncode == 1
    assert "node(s) 1 of 2 never arrived within 2 s" in r.stderr


@pytest.mark.timeout(60)
def test_worker_node_without_master_times_out(tmp_path: Path) -> None:
    port = str(find_free_port())
    r = run_fleetrun("--nnodes", "2", "--node_rank", "1", "--master_port", port, "--rdzv_timeout", "2",
                     "--log_dir", str(tmp_path), SCRIPT, timeout=50)
    assert r.returncode == 1
    assert f"could not reach the master at 127.0.0.1:{port}" in r.stderr


@pytest.mark.timeout(150)
def test_paddle_style_ips(tmp_path: Path) -> None:
    port = str(find_free_port())
    procs = [
        start_fleetrun("--ips", "127.0.0.1,127.0.0.1", "--node_rank", str(n), "--master_port", port,
                       "--tee", "all", "--log_dir", str(tmp_path / f"n{n}"), SCRIPT)
        for n in range(2)
    ]
    (rc0, _out0, err0), (rc1, out1, err1) = _finish(procs)
    assert rc0 == 0 and rc1 == 0, err0 + err1
    assert "MULTINODE_OK rank=1 world=2 node=1" in out1
    r = run_fleetrun("--ips", "127.0.0.1,127.0.0.1", "--log_dir", str(tmp_path), SCRIPT)
    assert r.returncode == 2 and "pass --node_rank" in r.stderr
