"""A real Prometheus (Debian's /usr/bin/prometheus, started by scripts/prometheus.sh) scrapes a
running local PS job through the job's metrics_targets.json; the Grafana dashboard's queries
name only metrics that exist."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, SCRIPTS, base_env, start_fleetrun
from test_telemetry import defined_metrics

PROMETHEUS_SH = REPO / "scripts" / "prometheus.sh"
GRAFANA = REPO / "deploy" / "monitoring" / "grafana-dashboard.json"
PROM_CONFIG = REPO / "deploy" / "monitoring" / "prometheus.yml"
PROMQL_WORDS = {
    "sum",
    "by",
    "rate",
    "increase",
    "histogram_quantile",
    "scalar",
    "max",
    "min",
    "avg",
    "without",
    "on",
    "le",
    "count",
    "irate",
    "label_values",
}


def query(url: str, promql: str) -> list[dict[str, Any]]:
    full = f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(full, timeout=5) as resp:
        data = json.loads(resp.read())
    assert data["status"] == "success", data
    return data["data"]["result"]


def wait_series(url: str, promql: str, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = query(url, promql)
            if result and all(float(r["value"][1]) > 0 for r in result):
                return result
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"Prometheus at {url} never returned {promql!r}")


def start_prometheus(log_dir: Path, work_dir: Path) -> tuple[subprocess.Popen, str]:
    """``scripts/prometheus.sh LOG_DIR WORK_DIR`` in its own session; (process, its URL)."""
    prom = subprocess.Popen(
        ["bash", str(PROMETHEUS_SH), str(log_dir), str(work_dir)],
        env={**base_env(), "PYTHON": "python3"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert prom.stdout is not None
    first = prom.stdout.readline().strip()
    assert first.startswith("PROMETHEUS_URL="), (first, prom.stderr.read() if prom.poll() else "")
    return prom, first.split("=", 1)[1]


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL after ``grace``; reap."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not (Path("/usr/bin/prometheus").exists() or shutil.which("apt-get")),
    reason="needs /usr/bin/prometheus (or apt-get to install it)",
)
def test_real_prometheus_scrapes_a_running_job(tmp_path: Path) -> None:
    log, release = tmp_path / "log", tmp_path / "release"
    job = start_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--log_dir",
        str(log),
        "--job_name",
        "promjob",
        str(SCRIPTS / "telemetry_job.py"),
        "--mode",
        "ps",
        "--steps",
        "10",
        "--hold_file",
        str(release),
    )
    prom: subprocess.Popen | None = None
    try:
        deadline = time.monotonic() + 60
        while not (log / "metrics_targets.json").exists():
            assert time.monotonic() < deadline, "no metrics_targets.json"
            assert job.poll() is None, job.communicate()
            time.sleep(0.2)
        prom, url = start_prometheus(log, tmp_path / "prom")
        steps = wait_series(url, 'fleet_trainer_steps_total{job="promjob", role="trainer"}', 150)
        assert steps[0]["metric"]["role"] == "trainer" and steps[0]["metric"]["rank"] == "0"
        ps = wait_series(
            url, 'fleet_ps_requests_total{job="promjob", op="PullSparse", code="OK"}', 60
        )
        assert ps[0]["metric"]["role"] == "server" and ps[0]["metric"]["table"] == "emb"
        wait_series(url, 'fleet_ps_table_rows{job="promjob", table="emb"}', 30)
        launcher = wait_series(url, 'fleet_launcher_job_state{job="promjob", state="running"}', 30)
        assert launcher[0]["metric"]["role"] == "launcher"
        up = query(url, 'up{job="promjob"}')
        assert {r["metric"]["role"] for r in up} == {"launcher", "server", "trainer"}
    finally:
        if prom is not None:
            stop_group(prom)
            prom_pid = prom.pid
        release.touch()
        try:
            job.communicate(timeout=90)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.communicate()
    assert job.returncode == 0
    if prom is not None:
        with pytest.raises(ProcessLookupError):
            os.kill(prom_pid, 0)  # no orphan Prometheus


def metric_names_in(expr: str) -> set[str]:
    """Identifiers of a PromQL expression that are metric names (not functions, labels,
    keywords or label values)."""
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    no_labels = re.sub(r"\{[^}]*\}", "", no_strings)
    no_by = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", no_labels)
    no_ranges = re.sub(r"\[[^\]]*\]", "", no_by)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", no_ranges))
    return {w for w in words if w not in PROMQL_WORDS}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not (Path("/usr/bin/prometheus").exists() or shutil.which("apt-get")),
    reason="needs /usr/bin/prometheus (or apt-get to install it)",
)
def test_real_prometheus_finds_every_node_of_a_shared_log_dir(tmp_path: Path) -> None:
    """Two nodes sharing one log_dir write metrics_targets.node0/1.json; the file_sd glob of
    scripts/prometheus.sh finds both: all 4 trainers and both launchers are scraped."""
    from collective.env import find_free_port

    log, release = tmp_path / "log", tmp_path / "release"
    port = str(find_free_port())
    nodes = [
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
            "prom2",
            str(SCRIPTS / "telemetry_job.py"),
            "--steps",
            "5",
            "--hold_file",
            str(release),
        )
        for n in range(2)
    ]
    prom: subprocess.Popen | None = None
    try:
        deadline = time.monotonic() + 90
        while not all((log / f"metrics_targets.node{n}.json").exists() for n in (0, 1)):
            assert time.monotonic() < deadline, "no metrics_targets.node<R>.json"
            assert all(p.poll() is None for p in nodes), [p.communicate() for p in nodes]
            time.sleep(0.2)
        prom, url = start_prometheus(log, tmp_path / "prom")
        deadline = time.monotonic() + 150
        while True:
            try:
                steps = query(url, 'fleet_trainer_steps_total{job="prom2"} >= 5')
            except OSError:  # Prometheus still starting
                steps = []
            if len(steps) == 4:
                break
            assert time.monotonic() < deadline, (
                f"Prometheus saw {len(steps)} of 4 trainers: {steps}"
            )
            time.sleep(0.5)
        assert sorted(r["metric"]["rank"] for r in steps) == ["0", "1", "2", "3"]
        launchers = wait_series(url, 'fleet_launcher_job_state{job="prom2", state="running"}', 30)
        deadline = time.monotonic() + 30
        while len(launchers) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
            launchers = query(url, 'fleet_launcher_job_state{job="prom2", state="running"} > 0')
        assert sorted(r["metric"]["rank"] for r in launchers) == ["0", "1"]  # node ranks
    finally:
        if prom is not None:
            stop_group(prom)
        release.touch()
        for p in nodes:
            try:
                p.communicate(timeout=90)
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.communicate()
    assert [p.returncode for p in nodes] == [0, 0]


def test_grafana_dashboard_queries_name_existing_metrics() -> None:
    dash = json.loads(GRAFANA.read_text())
    known: set[str] = {"up"}
    for name, (kind, _labels) in defined_metrics().items():
        known.add(name)
        if kind == "histogram":
            known |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    seen: set[str] = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names_in(target["expr"])
            assert names, (panel["title"], target["expr"])
            assert names <= known, (panel["title"], names - known)
            seen |= names
    for family in (
        "fleet_trainer_loss",
        "fleet_trainer_throughput_samples_per_second",
        "fleet_ps_table_rows",
        "fleet_ps_entry_keys_total",
        "fleet_launcher_job_state",
    ):
        assert family in seen, family
    variable = dash["templating"]["list"][1]
    assert (
        metric_names_in(variable["definition"].replace("label_values(", "").split(",")[0]) <= known
    )


def test_prometheus_config_is_valid_yaml_with_file_sd_and_pod_annotations() -> None:
    config = yaml.safe_load(PROM_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["fleetrun-local"]["file_sd_configs"][0]["files"]
    relabel = jobs["fleetrun-kubernetes-pods"]["relabel_configs"]
    sources = {s for r in relabel for s in r.get("source_labels", [])}
    assert "__meta_kubernetes_pod_annotation_prometheus_io_scrape" in sources
    assert "__meta_kubernetes_pod_annotation_prometheus_io_port" in sources
    promtool = shutil.which("promtool")
    if promtool:  # Debian's build lacks kubernetes_sd: check the file_sd job alone
        local = {"global": config["global"], "scrape_configs": [jobs["fleetrun-local"]]}
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"fleetrun-prom-{os.getpid()}.yml"
        path.write_text(yaml.safe_dump(local))
        try:
            r = subprocess.run(
                [promtool, "check", "config", str(path)],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        finally:
            path.unlink()
        assert r.returncode == 0, r.stdout + r.stderr
