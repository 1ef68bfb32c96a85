"""Two fleetrun processes on 127.0.0.1 acting as two nodes (static rendezvous over TCPStore)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import SCRIPTS, run_fleetrun, start_fleetrun, wait_for

from collective.env import find_free_port
from launcher.dashboard.config import DashboardConfig
from launcher.dashboard.monitor import Monitor
from launcher.telemetry import merge_job_states

SCRIPT = str(SCRIPTS / "multinode_allreduce.py")


def _nodes(tmp_path: Path, *extra: str, flags: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    port = str(find_free_port())
    return [
        start_fleetrun(
            "--nnodes",
            "2",
            "--node_rank",
            str(n),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            "--nproc_per_node",
            "2",
            "--tee",
            "all",
            "--log_dir",
            str(tmp_path / f"node{n}"),
            *flags,
            SCRIPT,
            *extra,
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
    common = [
        "--nnodes",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        port,
        "--nproc_per_node",
        "2",
        "--tee",
        "all",
    ]
    procs = [
        start_fleetrun(
            *common,
            "--node_rank",
            "0",
            "--max_restarts",
            "1",
            "--log_dir",
            str(tmp_path / "n0"),
            SCRIPT,
            "--fail_rank",
            "3",
        ),
        start_fleetrun(
            *common,
            "--node_rank",
            "1",
            "--max_restarts",
            "5",
            "--log_dir",
            str(tmp_path / "n1"),
            SCRIPT,
            "--fail_rank",
            "3",
        ),
    ]
    (rc0, out0, err0), (rc1, out1, err1) = _finish(procs)
    assert rc0 == 1 and rc1 == 1, err0 + err1
    assert "RuntimeError: injected failure on rank 3" in err1
    assert "trainer  : rank 3 (local_rank 1, node 1)" in err1
    assert "node 1 reported: rank 3" in err0, err0
    assert "restarts used 1/1" in err1
    assert "attempt=2" not in out0 + out1


@pytest.mark.timeout(150)
@pytest.mark.parametrize("warm", ["on", "off"])
def test_each_node_names_the_rank_error_as_the_root_cause(tmp_path: Path, warm: str) -> None:
    """Rank 1 (node 0) fails; node 1's ranks then fail because their peer died. Node 0 names
    its own rank as the root cause, node 1 names node 0's report, not its own lost peers, with
    workers forked or fresh (a forked worker exits sooner, so its node sees the lost peer
    sooner)."""
    procs = _nodes(tmp_path, "--fail_rank", "1", flags=("--warm_start", warm))
    (rc0, _out0, err0), (rc1, _out1, err1) = _finish(procs)
    assert rc0 == 1 and rc1 == 1, err0 + err1
    assert "trainer  : rank 1 (local_rank 1, node 0)" in err0, err0
    assert "RuntimeError: injected failure on rank 1" in err0, err0
    assert "node 0 reported: rank 1" in err1, err1


@pytest.mark.timeout(60)
def test_a_lost_peer_seen_first_never_hides_an_error_of_its_own() -> None:
    """The rule behind the root cause on several nodes, on a real store with two nodes: a dying
    rank closes its connections before its process exits, so another node may see its lost
    peer first; that report must not take the place of the error itself."""
    from launcher.rendezvous import NodeRendezvous

    port = find_free_port()
    nodes = [NodeRendezvous("127.0.0.1", port, 2, r, 10.0, 0, "job") for r in (0, 1)]
    a, b = nodes
    # b's own error, a's lost peer seen before it: b names its own
    a.report_failure(0, "rank 0 Connection closed by peer", 1.0, lost_peer=True)
    b.report_failure(0, "rank 3 RuntimeError", 2.0)
    assert b.earlier_failure(0, 2.0, 0.0, lost_peer=False) is None
    # both errors of their own: the one seen first
    a.report_failure(1, "rank 1 RuntimeError", 1.0)
    b.report_failure(1, "rank 3 RuntimeError", 2.0)
    assert b.earlier_failure(1, 2.0) == "node 0 reported: rank 1 RuntimeError"
    assert a.earlier_failure(1, 1.0) is None
    # b's lost peer: a's error wins even if seen later
    b.report_failure(2, "rank 2 Connection closed by peer", 1.0, lost_peer=True)
    a.report_failure(2, "rank 0 RuntimeError", 2.0)
    assert b.earlier_failure(2, 1.0, 0.5, lost_peer=True) == "node 0 reported: rank 0 RuntimeError"
    # lost peers on both: the one seen first, after the wait
    a.report_failure(3, "rank 0 Connection reset by peer", 1.0, lost_peer=True)
    b.report_failure(3, "rank 2 Connection closed by peer", 2.0, lost_peer=True)
    assert b.earlier_failure(3, 2.0, 0.2, lost_peer=True) == (
        "node 0 reported: rank 0 Connection reset by peer"
    )
    assert a.earlier_failure(3, 1.0, 0.2, lost_peer=True) is None


@pytest.mark.timeout(60)
def test_node_that_never_arrives_is_named(tmp_path: Path) -> None:
    port = str(find_free_port())
    r = run_fleetrun(
        "--nnodes",
        "2",
        "--node_rank",
        "0",
        "--master_port",
        port,
        "--rdzv_timeout",
        "2",
        "--log_dir",
        str(tmp_path),
        SCRIPT,
        timeout=50,
    )
    assert r.returncode == 1
    assert "node(s) 1 of 2 never arrived within 2 s" in r.stderr


@pytest.mark.timeout(60)
def test_worker_node_without_master_times_out(tmp_path: Path) -> None:
    port = str(find_free_port())
    r = run_fleetrun(
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--master_port",
        port,
        "--rdzv_timeout",
        "2",
        "--log_dir",
        str(tmp_path),
        SCRIPT,
        timeout=50,
    )
    assert r.returncode == 1
    assert f"could not reach the master at 127.0.0.1:{port}" in r.stderr


@pytest.mark.timeout(150)
def test_paddle_style_ips(tmp_path: Path) -> None:
    port = str(find_free_port())
    procs = [
        start_fleetrun(
            "--ips",
            "127.0.0.1,127.0.0.1",
            "--node_rank",
            str(n),
            "--master_port",
            port,
            "--tee",
            "all",
            "--log_dir",
            str(tmp_path / f"n{n}"),
            SCRIPT,
        )
        for n in range(2)
    ]
    (rc0, _out0, err0), (rc1, out1, err1) = _finish(procs)
    assert rc0 == 0 and rc1 == 0, err0 + err1
    assert "MULTINODE_OK rank=1 world=2 node=1" in out1
    r = run_fleetrun("--ips", "127.0.0.1,127.0.0.1", "--log_dir", str(tmp_path), SCRIPT)
    assert r.returncode == 2 and "pass --node_rank" in r.stderr


TELEMETRY_JOB = str(SCRIPTS / "telemetry_job.py")


def _node_state(log: Path, node: int) -> dict[str, Any]:
    return json.loads((log / f"job_state.node{node}.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_shared_log_dir_keeps_each_nodes_files(tmp_path: Path) -> None:
    """Two nodes, one log_dir (as on NFS or a k8s volume): each node writes its own
    job_state.node<R>.json / metrics_targets.node<R>.json / endpoints.node<R>.log / job.node<R>.yaml
    with its own processes; the dashboard's monitor and `fleetrun status --log_dir` merge them
    (all 4 processes)."""
    log, release = tmp_path / "log", tmp_path / "release"
    port = str(find_free_port())
    procs = [
        start_fleetrun(
            "--nnodes",
            "2",
            "--node_rank",
            str(n),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            "--nproc_per_node",
            "2",
            "--log_dir",
            str(log),
            "--job_name",
            "shared",
            TELEMETRY_JOB,
            "--steps",
            "5",
            "--hold_file",
            str(release),
        )
        for n in range(2)
    ]
    try:
        for node in (0, 1):
            wait_for(
                lambda node=node: (
                    (s := _node_state(log, node))["state"] == "running"
                    and [p["state"] for p in s["processes"]] == ["up", "up"]
                ),
                150,
                f"node {node} running",
            )
        assert not (log / "job_state.json").exists() and not (log / "metrics_targets.json").exists()
        for node in (0, 1):
            ranks = [p["rank"] for p in _node_state(log, node)["processes"]]
            assert ranks == [2 * node, 2 * node + 1]  # each node's own processes
            targets = json.loads((log / f"metrics_targets.node{node}.json").read_text())
            assert sorted((g["labels"]["role"], g["labels"]["rank"]) for g in targets) == [
                ("launcher", str(node)),
                ("trainer", str(2 * node)),
                ("trainer", str(2 * node + 1)),
            ]
            assert (log / f"endpoints.node{node}.log").exists() and (
                log / f"job.node{node}.yaml"
            ).exists()
        assert not (log / "endpoints.log").exists() and not (log / "job.yaml").exists()

        monitor = Monitor(DashboardConfig(log_dir=str(log), poll_interval_s=0.2))
        try:
            wait_for(
                lambda: monitor.poll_once() or len(monitor.last_ok) >= 5,
                60,
                "the dashboard scraping 4 trainers and a launcher",
            )
            snap = monitor.snapshot()
            assert snap["job"]["state"] == "running" and snap["job_error"] is None
            assert [(p["role"], p["rank"]) for p in snap["processes"]] == [
                ("trainer", r) for r in range(4)
            ]
        finally:
            monitor.close()

        r = run_fleetrun("status", "--log_dir", str(log), timeout=60)
        assert r.returncode == 0, r.stderr
        rows = [line.split() for line in r.stdout.splitlines() if line.startswith("  trainer")]
        assert [(row[1], row[3]) for row in rows] == [(str(rank), "up") for rank in range(4)], (
            r.stdout
        )
        assert "job 'shared' RUNNING" in r.stdout
        release.touch()
        results = _finish(procs, timeout=120)
    finally:
        release.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [rc for rc, _, _ in results] == [0, 0], [err for _, _, err in results]
    r = run_fleetrun("status", "--log_dir", str(log), timeout=60)
    assert r.returncode == 0 and "job 'shared' SUCCEEDED" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("exited") == 4


@pytest.mark.timeout(60)
def test_status_without_job_files_says_so(tmp_path: Path) -> None:
    r = run_fleetrun("status", "--log_dir", str(tmp_path), timeout=50)
    assert r.returncode == 1 and f"no job_state.json (or job_state*.json) in {tmp_path}" in r.stderr
    r = run_fleetrun("status", timeout=50)
    assert r.returncode == 2 and "fleetrun status --log_dir DIR" in r.stderr


@pytest.mark.timeout(30)
def test_merge_of_node_states() -> None:
    """The merged job state: the worst node state, every process in rank order, the first
    failure summary; one node's file is returned as is."""

    def node(state: str, ranks: list[int], summary: str | None = None) -> dict[str, Any]:
        return {
            "name": "j",
            "state": state,
            "attempt": 0,
            "restarts": 0,
            "max_restarts": 0,
            "started_at": 1.0,
            "updated_at": 2.0,
            "launcher_metrics": f"h:{ranks[0]}",
            "failure_summary": summary,
            "processes": [{"role": "trainer", "rank": r, "state": "up"} for r in ranks],
        }

    one = node("running", [0, 1])
    assert merge_job_states([one]) is one
    merged = merge_job_states(
        [node("succeeded", [2, 3]), node("failed", [0, 1], "Root cause: rank 1")]
    )
    assert merged["state"] == "failed" and merged["failure_summary"] == "Root cause: rank 1"
    assert [p["rank"] for p in merged["processes"]] == [0, 1, 2, 3]
    assert merged["launchers"] == ["h:2", "h:0"]
    assert merge_job_states([node("running", [0]), node("succeeded", [1])])["state"] == "running"
