"""The dashboard without a browser: the Prometheus-text summaries, the poller and its JSON API
against hand-written job_state.json files and real prometheus_client endpoints, the log route,
and the ``fleetrun dashboard`` / ``fleetrun --dashboard`` commands as real processes."""

from __future__ import annotations

import json
import math
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import SCRIPTS, live_pids, start_fleetrun, wait_gone
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from collective.errors import ConfigError
from launcher.dashboard import DashboardConfig, start_dashboard
from launcher.dashboard.monitor import breakdown, rate, targets_from, thin
from launcher.dashboard.scrape import (
    PHASES,
    ScrapeError,
    TrainerStats,
    launcher_stats,
    parse_samples,
    server_stats,
    trainer_stats,
)

URL_RE = re.compile(r"http://127\.0\.0\.1:\d+/")


# ---- fixtures: real prometheus_client endpoints and hand-written state files ---------------


def trainer_registry(loss: float = 0.5) -> tuple[CollectorRegistry, dict[str, Any]]:
    r = CollectorRegistry()
    m = {
        "steps": Counter("fleet_trainer_steps_total", "s", registry=r),
        "samples": Counter("fleet_trainer_samples_total", "s", registry=r),
        "step": Histogram("fleet_trainer_step_seconds", "s", registry=r),
        "loss": Gauge("fleet_trainer_loss", "s", registry=r),
        "thr": Gauge("fleet_trainer_throughput_samples_per_second", "s", registry=r),
        "comm": Histogram("fleet_trainer_comm_seconds", "s", ["op"], registry=r),
    }
    m["loss"].set(loss)
    return r, m


def ps_registry() -> tuple[CollectorRegistry, dict[str, Any]]:
    r = CollectorRegistry()
    m = {
        "req": Counter("fleet_ps_requests_total", "s", ["op", "table", "code"], registry=r),
        "rows": Gauge("fleet_ps_table_rows", "s", ["table"], registry=r),
        "bytes": Gauge("fleet_ps_table_bytes", "s", ["table"], registry=r),
        "entry": Counter("fleet_ps_entry_keys_total", "s", ["table", "result"], registry=r),
        "keys": Counter("fleet_ps_keys_total", "s", ["op", "table"], registry=r),
    }
    return r, m


def serve(registry: CollectorRegistry) -> tuple[Any, str]:
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    return server, f"127.0.0.1:{server.server_port}"


def write_state(
    log_dir: Path, procs: list[dict[str, Any]], state: str = "running", summary: str | None = None
) -> None:
    data = {
        "name": "unit",
        "run_id": "r1",
        "state": state,
        "attempt": 0,
        "restarts": 0,
        "max_restarts": 0,
        "started_at": 1.0,
        "updated_at": 2.0,
        "launcher_metrics": None,
        "processes": procs,
        "failure_summary": summary,
    }
    tmp = log_dir / ".job_state.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, log_dir / "job_state.json")


def proc(
    role: str, rank: int, addr: str | None, log: Path | None, state: str = "up"
) -> dict[str, Any]:
    return {
        "role": role,
        "rank": rank,
        "host": "h",
        "pid": 100 + rank,
        "state": state,
        "exit_code": None,
        "signal": None,
        "metrics": addr,
        "log": str(log) if log else None,
    }


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def wait_for(fn: Any, timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# ---- pure parts ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_summaries_from_prometheus_client_text() -> None:
    r, m = trainer_registry(loss=1.25)
    m["steps"].inc(10)
    m["samples"].inc(640)
    for _ in range(10):
        m["step"].observe(0.1)
        m["comm"].labels("all_reduce").observe(0.02)
    m["thr"].set(640.0)
    t = trainer_stats(parse_samples(generate_latest(r).decode()))
    assert (t.steps, t.samples, t.loss, t.throughput) == (10, 640, 1.25, 640.0)
    assert t.step_count == 10 and math.isclose(t.step_sum, 1.0)
    assert math.isclose(t.comm_sum["all_reduce"], 0.2) and "ps_pull" not in t.comm_sum

    r, m = ps_registry()
    m["req"].labels("pull", "emb", "OK").inc(7)
    m["req"].labels("push", "emb", "INVALID_ARGUMENT").inc(2)
    m["rows"].labels("emb").set(50)
    m["bytes"].labels("emb").set(5000)
    m["entry"].labels("emb", "admitted").inc(60)
    m["entry"].labels("emb", "evicted").inc(10)
    s = server_stats(parse_samples(generate_latest(r).decode()))
    emb = s.tables["emb"]
    assert (emb.requests, emb.errors, emb.rows, emb.bytes) == (9, 2, 50, 5000)
    assert emb.entry == {"admitted": 60, "evicted": 10}

    r = CollectorRegistry()
    g = Gauge("fleet_launcher_job_state", "s", ["state"], registry=r)
    g.labels("running").set(0)
    g.labels("failed").set(1)
    Counter("fleet_launcher_failures_total", "s", ["cause"], registry=r).labels("signal").inc()
    la = launcher_stats(parse_samples(generate_latest(r).decode()))
    assert la.state == "failed" and la.failures == {"signal": 1}


@pytest.mark.timeout(30)
def test_garbage_text_is_a_scrape_error() -> None:
    with pytest.raises(ScrapeError, match="not Prometheus text"):
        parse_samples("fleet_trainer_loss{broken 1\n")


@pytest.mark.timeout(30)
def test_breakdown_rate_and_targets() -> None:
    old = TrainerStats(step_sum=1.0, step_count=10, comm_sum={"all_reduce": 0.2})
    new = TrainerStats(step_sum=3.0, step_count=20, comm_sum={"all_reduce": 0.7, "ps_pull": 0.5})
    b = breakdown(old, new)
    assert b == {"step": 0.2, "all_reduce": 0.05, "ps_pull": 0.05, "ps_push": 0.0, "compute": 0.1}
    assert breakdown(new, new) == breakdown(None, new)  # no new step: the cumulative mean
    assert rate(10, 30, 2.0) == 10 and rate(30, 5, 2.0) is None  # a reset gives no point
    assert thin(range(900), 300)[-1] == 899 and len(thin(range(900), 300)) == 300
    assert thin([1, 2], 300) == [1, 2]

    job = {"processes": [proc("trainer", 1, "127.0.0.1:2", None), proc("server", 0, None, None)]}
    sd = [
        {"targets": ["127.0.0.1:1"], "labels": {"role": "trainer", "rank": "0", "host": "x"}},
        {"targets": ["127.0.0.1:9"], "labels": {"role": "launcher", "rank": "0"}},
        {"targets": ["127.0.0.1:3"], "labels": {"role": "trainer", "rank": "1"}},
    ]
    got = [(t.key, t.address) for t in targets_from(job, sd)]
    assert got == [("rank 0", "127.0.0.1:1"), ("rank 1", "127.0.0.1:2"), ("server 0", None)]


@pytest.mark.timeout(30)
def test_breakdown_from_step_phases() -> None:
    """A trainer exporting fleet_trainer_phase_seconds gets its phases per step (computation
    included; they add up to the step); a data-parallel loop's all-reduce shows apart from its
    compute."""
    phases = {"data": 0.1, "pull_wait": 0.3, "forward": 0.2, "backward": 0.2}
    old = TrainerStats(phase_sum=phases, phase_count=10)
    new = TrainerStats(
        phase_sum={**{p: 2 * v for p, v in phases.items()}, "push_optimizer": 0.1, "other": 0.1},
        phase_count=20,
    )
    b = breakdown(old, new)
    assert b is not None and b["step"] == pytest.approx(0.1)
    assert b["pull_wait"] == pytest.approx(0.03) and b["data"] == pytest.approx(0.01)
    assert b["push_optimizer"] == pytest.approx(0.01) and b["compute"] == 0
    assert sum(b[p] for p in PHASES) == pytest.approx(b["step"])
    assert breakdown(new, new) == breakdown(None, new)  # no new step: the cumulative mean
    dp = TrainerStats(
        phase_sum={"data": 0.5, "compute": 1.5}, phase_count=10, comm_sum={"all_reduce": 0.4}
    )
    b = breakdown(None, dp)
    assert b == {
        **dict.fromkeys(PHASES, 0.0),
        "data": 0.05,
        "compute": 0.11,
        "all_reduce": 0.04,
        "step": 0.2,
    }
    r, m = trainer_registry()
    m["phase"] = Histogram("fleet_trainer_phase_seconds", "s", ["phase"], registry=r)
    for phase in ("data", "forward", "forward"):
        m["phase"].labels(phase).observe(0.25)
    from prometheus_client import generate_latest

    stats = trainer_stats(parse_samples(generate_latest(r).decode()))
    assert stats.phase_sum == {"data": 0.25, "forward": 0.5} and stats.phase_count == 2


@pytest.mark.timeout(30)
def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="dashboard.port"):
        DashboardConfig(log_dir="x", port=70000)
    with pytest.raises(ConfigError, match="dashboard.poll_interval_s"):
        DashboardConfig(log_dir="x", poll_interval_s=0)


# ---- the JSON API against fixture files and live endpoints -----------------------------------


@pytest.mark.timeout(60)
def test_api_health_and_logs_with_fixture_files(tmp_path: Path) -> None:
    servers = []
    r0, m0 = trainer_registry(loss=2.0)
    r1, m1 = trainer_registry(loss=float("nan"))  # NaN must come out as JSON null
    rp, mp = ps_registry()
    for reg in (r0, r1, rp):
        servers.append(serve(reg))
    logs = {i: tmp_path / f"workerlog.{i}" for i in (0, 1)}
    for i, p in logs.items():
        p.write_text(f"hello from rank {i}\n")
    (tmp_path / "secret.txt").write_text("not listed\n")
    write_state(
        tmp_path,
        [
            proc("trainer", 0, servers[0][1], logs[0]),
            proc("trainer", 1, servers[1][1], logs[1]),
            proc("server", 0, servers[2][1], None),
        ],
    )
    dash = start_dashboard(
        DashboardConfig(log_dir=str(tmp_path), port=0, poll_interval_s=0.2, rate_window_s=1.0)
    )
    stop = threading.Event()

    def train() -> None:
        while not stop.wait(0.05):
            for m in (m0, m1):
                m["steps"].inc()
                m["samples"].inc(32)
                m["step"].observe(0.05)
                m["comm"].labels("all_reduce").observe(0.01)
            mp["req"].labels("pull", "emb", "OK").inc(3)
            mp["rows"].labels("emb").inc(10)
            mp["entry"].labels("emb", "admitted").inc(10)

    t = threading.Thread(target=train, daemon=True)
    t.start()
    try:

        def state() -> dict[str, Any]:
            code, body = get(dash.url + "api/state")
            assert code == 200
            return json.loads(body)  # strict JSON: json.loads accepts NaN, so check the text too

        s = wait_for(
            lambda: (
                (x := state())
                and len(x["series"].get("loss", {}).get("rank 0", [])) >= 3
                and x["tables"]
                and x["tables"][0]["qps"] > 0
                and x
            ),
            what="series",
        )
        assert s["job"]["name"] == "unit" and s["job"]["state"] == "running"
        assert [p["key"] for p in s["processes"]] == ["rank 0", "rank 1", "server 0"]
        assert s["processes"][1]["loss"] is None and "rank 1" not in s["series"]["loss"]
        assert "NaN" not in get(dash.url + "api/state")[1]
        assert len(s["series"]["throughput"]["rank 0"]) >= 2  # from samples_total (no gauge set)
        b = {row["key"]: row for row in s["breakdown"]}
        assert math.isclose(b["rank 0"]["step"], 0.05) and math.isclose(
            b["rank 0"]["all_reduce"], 0.01
        )
        assert s["tables"][0]["table"] == "emb" and s["tables"][0]["admitted"] > 0

        code, body = get(dash.url + "healthz")
        assert code == 200 and json.loads(body)["job_state_found"] is True
        assert get(dash.url + "logs/trainer/1") == (200, "hello from rank 1\n")
        for bad in (
            "logs/trainer/7",
            "logs/server/0",
            "logs/../secret.txt",
            "logs/trainer/..%2Fsecret.txt",
            "logs/x",
            "nope",
        ):
            code, body = get(dash.url + bad)
            assert code == 404 and "not listed" not in body, bad
        code, page = get(dash.url)
        assert (
            code == 200
            and 'id="chart-loss"' in page
            and "<script>" in page
            and "http" not in page.split("<script>")[1].replace("http://www.w3.org/2000/svg", "")
        )  # no CDN

        # the job fails: rank 1's record turns failed; a dead endpoint is reported, not fatal
        servers[1][0].shutdown()
        write_state(
            tmp_path,
            [
                proc("trainer", 0, servers[0][1], logs[0], "exited"),
                proc("trainer", 1, servers[1][1], logs[1], "failed"),
                proc("server", 0, servers[2][1], None, "exited"),
            ],
            state="failed",
            summary="Root cause (first observed failure):\n  rank 1 SIGKILL",
        )
        s = wait_for(lambda: (x := state())["job"]["state"] == "failed" and x, what="failed state")
        assert s["failure_summary"].startswith("Root cause")
        assert [p["state"] for p in s["processes"]] == ["exited", "failed", "exited"]
        assert len(s["series"]["loss"]["rank 0"]) >= 3  # history kept after the job ended

        (tmp_path / "job_state.json").write_text("{half")  # a torn write: keep the last good state
        s = wait_for(lambda: (x := state())["job_error"] and x, what="job_error")
        assert "cannot read" in s["job_error"] and s["job"]["state"] == "failed"
    finally:
        stop.set()
        t.join(5)
        dash.close()
        for srv, _ in servers:
            srv.shutdown()


@pytest.mark.timeout(30)
def test_missing_job_state_is_said(tmp_path: Path) -> None:
    dash = start_dashboard(
        DashboardConfig(log_dir=str(tmp_path / "later"), port=0, poll_interval_s=0.2)
    )
    try:
        s = json.loads(get(dash.url + "api/state")[1])
        assert s["job"] is None and "no job_state.json" in s["job_error"] and s["processes"] == []
    finally:
        dash.close()


# ---- the commands, as real processes ---------------------------------------------------------


def _read_lines(stream: Any, q: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        q.put(line)


def _wait_line(q: queue.Queue, pattern: re.Pattern, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=0.2)
        except queue.Empty:
            continue
        seen.append(line)
        if m := pattern.search(line):
            return m
    raise AssertionError(f"no line matching {pattern.pattern} in {timeout}s:\n{''.join(seen)}")


@pytest.mark.timeout(60)
def test_dashboard_command_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    p = start_fleetrun("dashboard", "--log_dir", str(tmp_path), "--port", "0")
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(p.stdout, q), daemon=True).start()
    try:
        url = _wait_line(q, URL_RE, 20).group(0)
        code, body = get(url + "healthz")
        assert code == 200 and json.loads(body)["status"] == "ok"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.timeout(30)
def test_dashboard_command_busy_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = start_fleetrun("dashboard", "--log_dir", str(tmp_path), "--port", str(port))
        _out, err = p.communicate(timeout=20)
    assert p.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port 0" in err


@pytest.mark.timeout(90)
def test_launch_with_dashboard_flag_serves_the_running_job(tmp_path: Path) -> None:
    logs = tmp_path / "log"
    p = start_fleetrun(
        "--dashboard",
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(logs),
        str(SCRIPTS / "launcher_worker.py"),
        "--out",
        str(tmp_path / "out"),
        "--hang",
    )
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(p.stderr, q), daemon=True).start()
    pids: list[int] = []
    try:
        url = _wait_line(q, re.compile(r"dashboard: (http://127\.0\.0\.1:\d+/)"), 30).group(1)
        s = wait_for(
            lambda: (
                (x := json.loads(get(url + "api/state")[1]))["job"]
                and x["job"]["state"] == "running"
                and len(x["processes"]) == 2
                and x
            ),
            timeout=30,
            what="running job on the dashboard",
        )
        pids = [pr["pid"] for pr in s["processes"]]
        assert {pr["state"] for pr in s["processes"]} == {"up"}
        assert get(url + "logs/trainer/1")[0] == 200
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert not wait_gone(pids), f"orphans: {live_pids(pids)}"


@pytest.mark.timeout(90)
def test_follows_a_restart_of_a_real_job(tmp_path: Path) -> None:
    logs = tmp_path / "log"
    dash = start_dashboard(DashboardConfig(log_dir=str(logs), port=0, poll_interval_s=0.2))
    p = start_fleetrun(
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "1",
        "--log_dir",
        str(logs),
        str(SCRIPTS / "launcher_worker.py"),
        "--out",
        str(tmp_path / "out"),
        "--sigkill_ranks",
        "1",
        "--fail_attempts",
        "1",
        "--delay",
        "1",
        "--hang",
    )
    pids: list[int] = []
    try:

        def state() -> dict[str, Any]:
            return json.loads(get(dash.url + "api/state")[1])

        s = wait_for(
            lambda: (
                (x := state())["job"]
                and x["job"]["attempt"] == 1
                and x["job"]["state"] == "running"
                and len(x["processes"]) == 2
                and {pr["state"] for pr in x["processes"]} == {"up"}
                and x
            ),
            timeout=45,
            what="attempt 1 running",
        )
        assert s["job"]["restarts"] == 1 and s["failure_summary"] is None
        assert all(pr["restarts"] == 1 for pr in s["processes"])
        pids = [pr["pid"] for pr in s["processes"]]
        out = tmp_path / "out"
        wait_for(lambda: len(list(out.glob("rank*.attempt1.json"))) == 2, what="attempt 1 workers")
        started = {json.loads(f.read_text())["pid"] for f in out.glob("rank*.attempt1.json")}
        assert set(pids) == started  # the restarted processes, not attempt 0's
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        dash.close()
    assert not wait_gone(pids), f"orphans: {live_pids(pids)}"
