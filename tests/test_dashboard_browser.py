"""The dashboard page in a real headless Chromium (selenium + /usr/bin/chromedriver).

Two jobs: a fixture job (tests/scripts/dashboard_fake_job.py: real prometheus_client endpoints
and the launcher's state files, with a PS server, no torch) and a real 2-rank ``fleetrun`` job
whose rank 1 SIGKILLs itself. For each, ``fleetrun dashboard`` runs as its own process (it
outlives the job, so the failure stays on screen); the page must load, its charts must have
points, and the killed rank must show as failed with the root cause. Screenshots go to the
test's tmp dir (paths printed). The browser, the dashboard and the job are killed at the end.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SCRIPTS, live_pids, start_fleetrun, wait_gone
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

URL_RE = re.compile(r"http://127\.0\.0\.1:\d+/")


@pytest.fixture
def browser(chromium_paths: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    """A headless Chromium driven through chromedriver; quit (and killed if needed) at the end."""
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium_paths["chromium"]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,2000",
        f"--user-data-dir={tmp_path / 'chrome-profile'}",
    ):
        opts.add_argument(arg)
    service = Service(
        executable_path=chromium_paths["chromedriver"],
        log_output=str(tmp_path / "chromedriver.log"),
    )
    driver = webdriver.Chrome(options=opts, service=service)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        try:
            driver.quit()
        except WebDriverException:
            pass
        proc = getattr(service, "process", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)


def _read_lines(stream: Any, q: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        q.put(line)


@pytest.fixture
def dashboard_for(tmp_path: Path) -> Iterator[Any]:
    """``start(log_dir) -> url``: runs ``fleetrun dashboard --port 0`` until the test ends."""
    procs: list[subprocess.Popen] = []

    def start(log_dir: Path) -> str:
        p = start_fleetrun(
            "dashboard", "--log_dir", str(log_dir), "--port", "0", "--poll_interval", "0.5"
        )
        procs.append(p)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_read_lines, args=(p.stdout, q), daemon=True).start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                m = URL_RE.search(q.get(timeout=0.2))
            except queue.Empty:
                assert p.poll() is None, (
                    f"fleetrun dashboard exited {p.returncode}: {p.stderr.read()}"
                )
                continue
            if m:
                return m.group(0)
        raise AssertionError("fleetrun dashboard printed no URL in 30 s")

    yield start
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


# The page re-renders its tables every second, so elements found one call earlier may be gone:
# read everything the tests check in one synchronous script (one consistent DOM state).
READ_PAGE = """
const txt = (id) => document.getElementById(id).textContent;
const rows = {};
for (const tr of document.querySelectorAll('#procs tbody tr')) {
  const a = tr.querySelector('td.log a');
  rows[tr.dataset.key] = {state: tr.dataset.state, text: tr.innerText, log: a ? a.href : null};
}
const points = {};
for (const svg of document.querySelectorAll('svg.chart')) points[svg.id] = +(svg.dataset.points || 0);
return {
  title: document.title, name: txt('job-name'), state: txt('job-state'), rows, points,
  failure_shown: !document.getElementById('failure').hidden, summary: txt('failure-summary'),
  tables: [...document.querySelectorAll('#tables tbody tr')].map((tr) => tr.dataset.table),
  table_text: Object.fromEntries([...document.querySelectorAll('#tables tbody tr')].map(
    (tr) => [tr.dataset.table, tr.innerText])),
  loss_lines: [...document.querySelectorAll('#chart-loss polyline')].map((p) => p.dataset.label).sort(),
  step_parts: [...document.querySelectorAll('#chart-breakdown rect[data-part]')].map(
    (r) => [r.dataset.row, r.dataset.part, +r.dataset.share, +r.getAttribute('width')]),
  body: document.body.innerText,
};
"""


def read_page(driver: Any) -> dict[str, Any]:
    """What the page shows now (job, rows by key, points per chart, failure summary...)."""
    return driver.execute_script(READ_PAGE)


def wait(driver: Any, cond: Any, timeout: float, what: str) -> dict[str, Any]:
    """Poll the page until ``cond(read_page(driver))``; return that page state."""
    deadline = time.monotonic() + timeout
    while True:
        page = read_page(driver)
        if cond(page):
            return page
        if time.monotonic() > deadline:
            raise AssertionError(
                f"page never showed {what} in {timeout} s; it shows:\n{page['body']}"
            )
        time.sleep(0.25)


def row_state(page: dict[str, Any], key: str) -> str | None:
    row = page["rows"].get(key)
    return row["state"] if row else None


def screenshot(driver: Any, path: Path, url: str) -> None:
    """Save the page as PNG and the API state beside it (``.json``); print both paths."""
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    with urllib.request.urlopen(url + "api/state", timeout=5) as r:
        path.with_suffix(".json").write_bytes(r.read())
    print(f"dashboard screenshot: {path} (API state: {path.with_suffix('.json')})")


def check_step_time_panel(page: dict[str, Any]) -> None:
    """The step-time panel stacks every phase of each trainer's step (computation included),
    as shares that fill the bar: the fixture's 50 ms step of rank 0 is data 2 ms, pull wait
    10 ms, forward 12 ms, backward 14 ms, push/optimizer 8 ms, other 4 ms."""
    want = {"data": 4, "pull_wait": 20, "forward": 24, "backward": 28, "push_optimizer": 16}
    for rank in ("rank 0", "rank 1"):
        parts = {p: (share, w) for row, p, share, w in page["step_parts"] if row == rank}
        assert set(want) | {"other"} <= set(parts), (rank, parts)
        assert sum(share for share, _ in parts.values()) == pytest.approx(100, abs=0.5)
        assert all(w > 0 for _, w in parts.values())
    rank0 = {p: share for row, p, share, _ in page["step_parts"] if row == "rank 0"}
    for phase, share in want.items():
        assert rank0[phase] == pytest.approx(share, abs=1), (phase, rank0)
    widths = {
        row: sum(w for r, _, _, w in page["step_parts"] if r == row) for row in ("rank 0", "rank 1")
    }
    assert widths["rank 0"] == pytest.approx(widths["rank 1"], rel=0.01)  # shares: equal bars
    assert "pull_wait" in page["body"] and "ms" in page["body"]


@pytest.mark.timeout(120)
def test_fixture_job_page_charts_ps_tables_and_failure(
    tmp_path: Path, browser: Any, dashboard_for: Any
) -> None:
    logs = tmp_path / "log"
    job = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPTS / "dashboard_fake_job.py"),
            "--log_dir",
            str(logs),
            "--fail_when",
            str(tmp_path / "fail_now"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not (logs / "job_state.json").exists():
            assert time.monotonic() < deadline and job.poll() is None, (
                "fake job wrote no job_state.json"
            )
            time.sleep(0.1)
        url = dashboard_for(logs)
        browser.get(url)
        page = wait(
            browser,
            lambda pg: (
                pg["points"]["chart-loss"] >= 4
                and pg["points"]["chart-throughput"] >= 4
                and pg["points"]["chart-breakdown"] >= 4
                and pg["points"]["chart-ps-rows"] >= 4
                and pg["points"]["chart-ps-qps"] >= 2
            ),
            60,
            "charts with points",
        )
        assert page["title"] == "fleetrun dashboard" and page["name"] == "fake"
        assert page["state"] == "running"
        assert row_state(page, "rank 1") == "up" and row_state(page, "server 0") == "up"
        assert page["tables"] == ["item", "social", "user"]
        graph = page["table_text"]["social"].split()  # a graph table's row: nodes, edges, ms
        assert graph[:2] == ["social", "(graph)"] and "5000" in graph and "40.0k" in graph, graph
        assert float(graph[-1]) == 4.0, graph  # mean sampling latency, ms
        assert page["loss_lines"] == ["rank 0", "rank 1"]
        check_step_time_panel(page)
        screenshot(browser, tmp_path / "dashboard_fixture_running.png", url)

        (tmp_path / "fail_now").touch()  # rank 1 of the fixture job dies now
        page = wait(
            browser,
            lambda pg: row_state(pg, "rank 1") == "failed" and pg["failure_shown"],
            60,
            "rank 1 failed",
        )
        assert page["state"] == "failed"
        assert "Root cause" in page["summary"] and "signal SIGKILL" in page["summary"]
        assert "rank 1" in page["summary"] and "SIGKILL" in page["rows"]["rank 1"]["text"]
        assert page["points"]["chart-loss"] >= 4  # history stays after the job ended
        screenshot(browser, tmp_path / "dashboard_fixture_failed.png", url)

        browser.get(page["rows"]["rank 1"]["log"])  # the log link
        assert "about to SIGKILL myself" in browser.find_element(By.TAG_NAME, "body").text
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_two_rank_job_killed_rank_shows_failed(
    tmp_path: Path, browser: Any, dashboard_for: Any
) -> None:
    logs = tmp_path / "log"
    job = start_fleetrun(
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(logs),
        "--job_name",
        "dash",
        str(SCRIPTS / "dashboard_train.py"),
        "--kill_rank",
        "1",
        "--kill_after",
        "150",
        "--kill_when",
        str(tmp_path / "kill_now"),
        "--seconds",
        "200",
    )
    pids: list[int] = []
    try:
        url = dashboard_for(logs)
        browser.get(url)
        wait(
            browser,
            lambda pg: (
                pg["state"] == "running"
                and row_state(pg, "rank 0") == "up"
                and row_state(pg, "rank 1") == "up"
            ),
            90,
            "the job running",
        )
        state = json.loads((logs / "job_state.json").read_text())
        pids = [p["pid"] for p in state["processes"]]
        page = wait(
            browser,
            lambda pg: pg["points"]["chart-loss"] >= 4 and pg["points"]["chart-throughput"] >= 4,
            60,
            "loss and throughput points",
        )
        assert page["name"] == "dash" and page["loss_lines"] == ["rank 0", "rank 1"]
        screenshot(browser, tmp_path / "dashboard_real_running.png", url)

        (tmp_path / "kill_now").touch()  # rank 1 SIGKILLs itself at its next step
        page = wait(
            browser,
            lambda pg: row_state(pg, "rank 1") == "failed" and pg["failure_shown"],
            90,
            "rank 1 failed",
        )
        assert page["state"] == "failed"
        summary = page["summary"]
        assert "Root cause (first observed failure)" in summary
        assert "rank 1" in summary and "signal SIGKILL (9)" in summary
        assert "SIGKILL" in page["rows"]["rank 1"]["text"]
        assert page["points"]["chart-loss"] >= 4 and page["points"]["chart-breakdown"] >= 1
        screenshot(browser, tmp_path / "dashboard_real_failed.png", url)
        assert job.wait(timeout=60) == 1
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert not wait_gone(pids), f"orphans: {live_pids(pids)}"
