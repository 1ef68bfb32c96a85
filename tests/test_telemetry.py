"""Prometheus metrics of trainers, parameter servers and the launcher (fleet/telemetry.py,
ps_server/telemetry.py, launcher/telemetry.py): names, real jobs scraped while they run, the
two files the launcher keeps in log_dir."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import SCRIPTS, run_fleetrun, start_fleetrun
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

JOB = SCRIPTS / "telemetry_job.py"
WORKER = SCRIPTS / "launcher_worker.py"
NAME = re.compile(r"^fleet_(trainer|data|ps|launcher)_[a-z][a-z0-9_]*[a-z0-9]$")
ALLOWED_LABELS = {"op", "table", "code", "result", "state", "role", "cause", "dataset", "phase"}
CONTRACT = {
    "fleet_trainer_steps_total",
    "fleet_trainer_samples_total",
    "fleet_trainer_step_seconds",
    "fleet_trainer_loss",
    "fleet_trainer_throughput_samples_per_second",
    "fleet_trainer_comm_seconds",
    "fleet_trainer_phase_seconds",
    "fleet_trainer_pipeline_bubble_ratio",
    "fleet_trainer_amp_loss_scale",
    "fleet_trainer_amp_skipped_steps_total",
    "fleet_ps_requests_total",
    "fleet_ps_request_seconds",
    "fleet_ps_keys_total",
    "fleet_ps_table_rows",
    "fleet_ps_table_bytes",
    "fleet_ps_entry_keys_total",
    "fleet_ps_nonfinite_gradients_total",
    "fleet_ps_checkpoint_seconds",
    "fleet_launcher_job_state",
    "fleet_launcher_processes_up",
    "fleet_launcher_restarts_total",
    "fleet_launcher_failures_total",
    "fleet_ps_recoveries_total",
}
JOB_STATE_KEYS = {
    "name",
    "run_id",
    "state",
    "attempt",
    "restarts",
    "max_restarts",
    "started_at",
    "updated_at",
    "launcher_metrics",
    "processes",
    "failure_summary",
    "recoveries",
    "membership_changes",
}
PROC_KEYS = {"role", "rank", "host", "pid", "state", "exit_code", "signal", "metrics", "log"}


def defined_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exposed name -> (type, label names) of every metric in the definition modules."""
    import fleet.data.metrics
    import fleet.telemetry
    import launcher.telemetry
    import ps_server.telemetry

    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for mod in (fleet.telemetry, fleet.data.metrics, ps_server.telemetry, launcher.telemetry):
        for value in vars(mod).values():
            if isinstance(value, (Counter, Gauge, Histogram)) and value._name.startswith("fleet_"):
                kind = value._type
                name = value._name + ("_total" if kind == "counter" else "")
                out[name] = (kind, tuple(value._labelnames))
    for family in fleet.telemetry.PHASE_SECONDS.describe():  # a scrape-time histogram
        out[family.name] = (family.type, ("phase",))
    collected = ps_server.telemetry.COLLECTED  # scrape-time metrics: exposed name -> labels
    for collector in (ps_server.telemetry.REQUEST_STATS, ps_server.telemetry.TABLES):
        for family in collector.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            assert name in collected, f"{name} is collected but not declared in COLLECTED"
            out[name] = (family.type, collected[name])
    assert set(collected) <= set(out), f"declared, never collected: {set(collected) - set(out)}"
    return out


def scrape(endpoint: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)] from http://ENDPOINT/metrics."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict[str, Any], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    )


def wait_for(fn: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def read_state(log: Path) -> dict[str, Any]:
    return json.loads((log / "job_state.json").read_text())


def stop(proc: subprocess.Popen, release: Path, timeout: float = 90) -> tuple[str, str]:
    release.touch()
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# -- names ---------------------------------------------------------------------------------------
def test_metric_names_follow_the_convention_and_the_contract() -> None:
    metrics = defined_metrics()
    assert CONTRACT <= set(metrics), f"missing: {CONTRACT - set(metrics)}"
    for name, (kind, labels) in metrics.items():
        assert NAME.match(name), name
        if kind == "counter":
            assert name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
        if "bytes" in name:
            assert name.endswith("_bytes"), name
        assert set(labels) <= ALLOWED_LABELS, (name, labels)
        assert not {"rank", "job", "host"} & set(labels), f"{name}: role/rank/job are target labels"


def test_status_line_text() -> None:
    from launcher.console import Status

    assert Status(2, 2, 120, 9.81, 0.43125, 640).text() == (
        "2/2 up | step 120 | 9.8 steps/s | loss 0.4313 | 640 samples/s"
    )
    assert Status(1, 3, 0, None, None, None).text() == "1/3 up | step 0"


# -- real jobs -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dp_job_metrics_targets_and_state(tmp_path: Path) -> None:
    log, release = tmp_path / "log", tmp_path / "release"
    proc = start_fleetrun(
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(log),
        "--job_name",
        "dpjob",
        str(JOB),
        "--steps",
        "20",
        "--hold_file",
        str(release),
    )
    try:
        targets = wait_for(
            lambda: json.loads((log / "metrics_targets.json").read_text()),
            60,
            "metrics_targets.json",
        )
        roles = sorted((g["labels"]["role"], g["labels"]["rank"]) for g in targets)
        assert roles == [("launcher", "0"), ("trainer", "0"), ("trainer", "1")]
        for g in targets:
            assert g["labels"]["job"] == "dpjob" and g["labels"]["host"]
            assert re.match(r"^127\.0\.0\.1:\d+$", g["targets"][0])
        trainers = {
            g["labels"]["rank"]: g["targets"][0]
            for g in targets
            if g["labels"]["role"] == "trainer"
        }
        for ep in trainers.values():
            wait_for(
                lambda ep=ep: value(scrape(ep), "fleet_trainer_steps_total") >= 20,
                120,
                f"20 steps at {ep}",
            )
            m = scrape(ep)
            assert value(m, "fleet_trainer_samples_total") == 20 * 32
            assert value(m, "fleet_trainer_step_seconds_count") == 19
            assert math.isfinite(value(m, "fleet_trainer_loss"))
            assert value(m, "fleet_trainer_throughput_samples_per_second") > 0
            assert value(m, "fleet_trainer_comm_seconds_count", op="all_reduce") >= 5  # sampled
        state = read_state(log)
        assert set(state) == JOB_STATE_KEYS and state["state"] == "running"
        assert state["name"] == "dpjob" and state["attempt"] == 0
        assert [(p["role"], p["rank"], p["state"]) for p in state["processes"]] == [
            ("trainer", 0, "up"),
            ("trainer", 1, "up"),
        ]
        for p in state["processes"]:
            assert set(p) == PROC_KEYS and Path(p["log"]).is_absolute()
            assert p["metrics"] == trainers[str(p["rank"])]
        launcher = scrape(state["launcher_metrics"])
        assert value(launcher, "fleet_launcher_job_state", state="running") == 1
        assert value(launcher, "fleet_launcher_job_state", state="starting") == 0
        assert value(launcher, "fleet_launcher_processes_up", role="trainer") == 2
    finally:
        _out, err = stop(proc, release)
    assert proc.returncode == 0, err
    state = read_state(log)
    assert state["state"] == "succeeded" and state["failure_summary"] is None
    assert {(p["state"], p["exit_code"]) for p in state["processes"]} == {("exited", 0)}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ps_job_metrics(tmp_path: Path) -> None:
    log, release = tmp_path / "log", tmp_path / "release"
    proc = start_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "2",
        "--log_dir",
        str(log),
        str(JOB),
        "--mode",
        "ps",
        "--steps",
        "10",
        "--hold_file",
        str(release),
    )
    try:
        targets = wait_for(
            lambda: json.loads((log / "metrics_targets.json").read_text()),
            60,
            "metrics_targets.json",
        )
        by_role = {(g["labels"]["role"], g["labels"]["rank"]): g["targets"][0] for g in targets}
        assert set(by_role) == {
            ("launcher", "0"),
            ("server", "0"),
            ("trainer", "0"),
            ("trainer", "1"),
        }
        for rank in ("0", "1"):
            ep = by_role[("trainer", rank)]
            wait_for(
                lambda ep=ep: value(scrape(ep), "fleet_trainer_steps_total") >= 10,
                120,
                f"10 steps at {ep}",
            )
            m = scrape(ep)
            assert value(m, "fleet_trainer_samples_total") == 10 * 16
            assert value(m, "fleet_trainer_comm_seconds_count", op="ps_pull") >= 10
            assert value(m, "fleet_trainer_comm_seconds_count", op="ps_push") >= 10
            # a hand-written PS loop's step phases: pull wait, push/optimizer, the rest compute
            for phase in ("pull_wait", "push_optimizer", "compute"):
                assert value(m, "fleet_trainer_phase_seconds_count", phase=phase) >= 9, phase
            assert value(m, "fleet_trainer_phase_seconds_sum", phase="pull_wait") > 0
            assert value(m, "fleet_trainer_phase_seconds_sum", phase="push_optimizer") > 0
        s = scrape(by_role[("server", "0")])
        assert value(s, "fleet_ps_requests_total", op="PullSparse", table="emb", code="OK") >= 20
        assert value(s, "fleet_ps_requests_total", op="PushSparse", table="emb", code="OK") >= 20
        assert value(s, "fleet_ps_request_seconds_count", op="PullSparse") >= 20
        assert value(s, "fleet_ps_keys_total", op="pull", table="emb") > 0
        assert value(s, "fleet_ps_keys_total", op="push", table="emb") > 0
        rows = value(s, "fleet_ps_table_rows", table="emb")
        assert rows > 0 and value(s, "fleet_ps_table_bytes", table="emb") > 0
        assert value(s, "fleet_ps_entry_keys_total", table="emb", result="admitted") == rows
        assert value(s, "fleet_ps_nonfinite_gradients_total", table="emb") == 0
        state = read_state(log)
        assert sorted((p["role"], p["rank"]) for p in state["processes"]) == [
            ("server", 0),
            ("trainer", 0),
            ("trainer", 1),
        ]
        assert (
            value(scrape(state["launcher_metrics"]), "fleet_launcher_processes_up", role="server")
            == 1
        )
    finally:
        _out, err = stop(proc, release)
    assert proc.returncode == 0, err
    assert read_state(log)["state"] == "succeeded"


@pytest.mark.timeout(120)
def test_failed_rank_in_job_state(tmp_path: Path) -> None:
    log = tmp_path / "log"
    r = run_fleetrun(
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(log),
        str(WORKER),
        "--out",
        str(tmp_path / "out"),
        "--sigkill_ranks",
        "1",
        "--hang",
    )
    assert r.returncode == 1
    state = read_state(log)
    assert state["state"] == "failed"
    procs = {p["rank"]: p for p in state["processes"]}
    assert (procs[1]["state"], procs[1]["signal"], procs[1]["exit_code"]) == (
        "failed",
        "SIGKILL",
        None,
    )
    assert procs[0]["state"] == "exited"  # stopped by fleetrun's teardown, not a failure
    assert "Root cause" in state["failure_summary"] and "SIGKILL" in state["failure_summary"]


@pytest.mark.timeout(120)
def test_restart_counts_in_job_state(tmp_path: Path) -> None:
    log = tmp_path / "log"
    r = run_fleetrun(
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(log),
        "--max_restarts",
        "1",
        str(WORKER),
        "--out",
        str(tmp_path / "out"),
        "--exit_code_ranks",
        "1",
        "--fail_attempts",
        "1",
    )
    assert r.returncode == 0, r.stderr
    state = read_state(log)
    assert (state["state"], state["attempt"], state["restarts"], state["max_restarts"]) == (
        "succeeded",
        1,
        1,
        1,
    )


@pytest.mark.timeout(30)
def test_in_place_restarts_count_in_job_state(tmp_path: Path) -> None:
    """A process restarted alone (a PS server in async/GEO mode) spends a restart: job_state.json
    counts it while the job stays in its attempt, and a later restart of the job counts on."""
    from launcher.telemetry import JobMonitor, JobState

    monitor = JobMonitor("j", "r", 3, str(tmp_path), "127.0.0.1", metrics=False)
    monitor.attempt_started(0, [])
    monitor.recovered("server", "recovery 1 (attempt 0, in place): server 0 ...")
    monitor.restarted_in_place(1)
    state = read_state(tmp_path)
    assert (state["state"], state["attempt"], state["restarts"], len(state["recoveries"])) == (
        "running",
        0,
        1,
        1,
    )
    monitor.restarting(2)
    monitor.attempt_started(1, [])
    monitor.finished(JobState.SUCCEEDED)
    state = read_state(tmp_path)
    assert (state["state"], state["attempt"], state["restarts"]) == ("succeeded", 1, 2)


@pytest.mark.timeout(120)
def test_no_metrics_flag(tmp_path: Path) -> None:
    log, out = tmp_path / "log", tmp_path / "out"
    r = run_fleetrun(
        "--no-metrics",
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(log),
        str(WORKER),
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert not (log / "metrics_targets.json").exists()
    state = read_state(log)
    assert state["state"] == "succeeded" and state["launcher_metrics"] is None
    assert all(p["metrics"] is None for p in state["processes"])
    env = json.loads((out / "rank0.attempt0.json").read_text())["env"]
    assert "FLEET_METRICS_PORT" not in env


@pytest.mark.timeout(60)
def test_metrics_port_in_the_env_contract() -> None:
    from collective.env import EnvContractError, read_worker_env

    env = read_worker_env({"FLEET_METRICS_PORT": "9400", "FLEET_METRICS_HOST": "10.0.0.5"})
    assert (env.metrics_port, env.metrics_host) == (9400, "10.0.0.5")
    assert read_worker_env({}).metrics_port == 0
    with pytest.raises(EnvContractError, match="FLEET_METRICS_PORT"):
        read_worker_env({"FLEET_METRICS_PORT": "http"})


@pytest.mark.timeout(60)
def test_in_process_ps_server_records_and_collects(tmp_path: Path) -> None:
    """A real gRPC PSServer and PSClient in this process; metrics read from the endpoint."""
    import numpy as np

    from ps_server import PSClient, PSServer
    from ps_server import telemetry as ps_telemetry

    port = ps_telemetry.start(0)
    try:
        with PSServer(metrics_port=0) as server:
            client = PSClient([server.endpoint])
            try:
                client.create_table("tel", dim=4)
                keys = np.arange(10, dtype=np.int64)
                client.pull_sparse("tel", keys)
                with pytest.raises(Exception, match="(?i)nan|non-finite|finite"):
                    client.push_sparse("tel", keys, np.full((10, 4), np.nan, np.float32))
            finally:
                client.close()
            m = scrape(f"127.0.0.1:{port}")
    finally:
        ps_telemetry.stop()
    assert value(m, "fleet_ps_keys_total", op="pull", table="tel") >= 10
    assert value(m, "fleet_ps_requests_total", op="PullSparse", table="tel", code="OK") >= 1
    assert value(m, "fleet_ps_request_seconds_count", op="PullSparse") >= 1
    assert value(m, "fleet_ps_table_rows", table="tel") == 10
    assert value(m, "fleet_ps_nonfinite_gradients_total", table="tel") >= 1


def _samples(registry: Any) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    """(name, sorted labels, value) of every sample a registry exposes, ``_created`` left out."""
    from prometheus_client import generate_latest

    return sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
        if not s.name.endswith("_created")
    )


@pytest.mark.timeout(30)
def test_request_collector_exposes_what_prometheus_client_would() -> None:
    """ps_server's per-request collector against prometheus_client's own Counter/Histogram fed
    the same requests (bucket bounds hit exactly included): the same samples."""
    from prometheus_client import CollectorRegistry

    from ps_server.telemetry import COLLECTED, LATENCY_BUCKETS, RequestCollector

    ours, ref = CollectorRegistry(), CollectorRegistry()
    collector = RequestCollector()
    ours.register(collector)
    requests = Counter("fleet_ps_requests", "r", COLLECTED["fleet_ps_requests_total"], registry=ref)
    latency = Histogram(
        "fleet_ps_request_seconds", "l", ["op"], buckets=LATENCY_BUCKETS, registry=ref
    )
    keys = Counter("fleet_ps_keys", "k", ["op", "table"], registry=ref)
    cases = [
        ("PullSparse", "emb", "OK", 0.0001, 4),
        ("PushSparse", "emb", "OK", 0.0003, 4),
        ("PullSparse", "", "NOT_FOUND", 0.003, 0),
        ("Stats", "", "OK", 20.0, 0),
        ("PullSparse", "emb", "OK", 0.00025, 2),
        ("PushSparse", "emb", "INVALID_ARGUMENT", 0.0, 0),
    ]
    for op, table, code, seconds, num_keys in cases:
        collector.record(op, table, code, seconds, num_keys)
        requests.labels(op, table, code).inc()
        latency.labels(op).observe(seconds)
        if num_keys:
            keys.labels("pull" if op == "PullSparse" else "push", table).inc(num_keys)
    assert _samples(ours) == _samples(ref)


@pytest.mark.timeout(30)
def test_request_collector_loses_no_count_across_threads() -> None:
    import threading

    from ps_server.telemetry import RequestCollector

    collector = RequestCollector()

    def work() -> None:
        for _ in range(5000):
            collector.record("PushSparse", "emb", "OK", 0.001, 3)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = {
        s.name: s.value
        for fam in collector.collect()
        for s in fam.samples
        if s.labels.get("le") in (None, "0.001")
    }
    assert got == {
        "fleet_ps_requests_total": 20000,
        "fleet_ps_request_seconds_bucket": 20000,
        "fleet_ps_request_seconds_count": 20000,
        "fleet_ps_request_seconds_sum": pytest.approx(20.0),
        "fleet_ps_keys_total": 60000,
    }


@pytest.mark.timeout(60)
def test_trainer_hooks_in_process() -> None:
    """fleet.telemetry's hooks against its own endpoint: off by default, on after start()."""
    import torch

    from fleet import telemetry

    before = telemetry.STEPS._value.get()
    telemetry.on_step()  # metrics off: nothing recorded
    assert telemetry.STEPS._value.get() == before
    port = telemetry.start(0)
    try:
        assert telemetry.start(0) == port  # one endpoint per process
        for _ in range(4):
            telemetry.on_forward((torch.zeros(8, 3),))
            telemetry.on_step()
        telemetry.report(loss=torch.tensor(0.25))
        telemetry.set_amp_loss_scale(1024.0)
        telemetry.count_amp_skipped_step()
        telemetry.set_pipeline_bubble_ratio(0.125)

        class Client:
            def pull_sparse(self, table: str, keys: Any) -> int:
                return 7

            def stats(self) -> str:
                return "untimed"

        class Comm:
            def __init__(self) -> None:
                self.client = Client()

            def step(self) -> None:
                self.client.pull_sparse("t", [1])

        comm = Comm()
        telemetry.instrument_communicator(comm)
        comm.step()
        assert comm.client.stats() == "untimed"
        m = scrape(f"127.0.0.1:{port}")
        with pytest.raises(Exception, match="samples"):
            telemetry.report(samples=-1)
    finally:
        telemetry.stop()
    assert value(m, "fleet_trainer_steps_total") == before + 5
    assert value(m, "fleet_trainer_samples_total") >= 32
    assert value(m, "fleet_trainer_loss") == 0.25
    assert value(m, "fleet_trainer_amp_loss_scale") == 1024.0
    assert value(m, "fleet_trainer_amp_skipped_steps_total") >= 1
    assert value(m, "fleet_trainer_pipeline_bubble_ratio") == 0.125
    assert value(m, "fleet_trainer_comm_seconds_count", op="ps_pull") >= 1
    assert value(m, "fleet_trainer_throughput_samples_per_second") > 0


@pytest.mark.timeout(60)
def test_hand_written_loop_phases_in_process() -> None:
    """A hand-written loop with metrics on: data from a fleet.data-style iterator (through
    fleet.base.lookahead), pull wait from a real communicator, the rest as compute; each step's
    phases add up to its step time."""
    import numpy as np

    from fleet import telemetry
    from fleet.base import lookahead
    from fleet.ps.communicator import Communicator

    class SlowClient:  # a PS server's stand-in: a pull takes 4 ms
        def pull_sparse(self, table: str, keys: Any) -> Any:
            time.sleep(0.004)
            return np.zeros((len(keys), 2), np.float32)

    def slow_batches() -> Any:
        for _ in range(6):
            time.sleep(0.006)
            yield {"x": 1}

    def phase_sum(phase: str) -> float:
        return telemetry.PHASE_SECONDS.sums[phase]

    before = {p: phase_sum(p) for p in telemetry.PHASES}
    steps_before = telemetry.STEP_SECONDS._sum.get()
    port = telemetry.start(0)
    try:
        comm = Communicator(SlowClient(), 1, lambda: None)
        for _batch in lookahead.batches(slow_batches()):
            comm.pull_sparse("emb", np.arange(3))
            time.sleep(0.003)  # the script's own forward/backward
            telemetry.report(step=True)
        m = scrape(f"127.0.0.1:{port}")
    finally:
        telemetry.stop()
    got = {p: phase_sum(p) - before[p] for p in telemetry.PHASES}
    step_s = telemetry.STEP_SECONDS._sum.get() - steps_before
    assert value(m, "fleet_trainer_phase_seconds_count", phase="data") >= 5
    assert got["data"] >= 5 * 0.006 and got["pull_wait"] >= 5 * 0.004
    assert got["compute"] >= 5 * 0.003 and got["forward"] == 0
    assert sum(got.values()) == pytest.approx(step_s, rel=0.01)


@pytest.mark.timeout(60)
def test_hooks_count_every_step_of_concurrent_training_threads() -> None:
    """With several training threads (train_from_dataset(thread_num=N)) the hooks run at once:
    no step, sample or phase second is lost between them."""
    import sys
    import threading

    import torch

    from fleet import telemetry

    threads, steps = 4, 3000
    telemetry.start(0)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show at once
    try:
        steps_before = telemetry.steps_ended()
        samples_before = telemetry.SAMPLES._value.get()
        pull_before = telemetry.pull_wait_seconds()
        timer = telemetry.PhaseTimer()
        batch = (torch.zeros(2, 1),)

        def train() -> None:
            with timer:
                for _ in range(steps):
                    telemetry.on_forward(batch)
                    telemetry.add_phase("pull_wait", time.perf_counter() - 0.5)
                    timer.add(1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
                    telemetry.on_step()

        workers = [threading.Thread(target=train) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(50)
    finally:
        sys.setswitchinterval(switch)
        telemetry.stop()
    total = threads * steps
    assert telemetry.steps_ended() - steps_before == total
    assert timer.total[0] == float(total) and timer.period[0] == float(total)
    assert telemetry.pull_wait_seconds() - pull_before >= 0.5 * total
    # every forward's 2 samples were counted (the last step's window may still hold some)
    assert telemetry.SAMPLES._value.get() - samples_before == 2 * total
