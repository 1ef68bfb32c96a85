"""fleetrun's first step (``launcher/prestart.py``): a one-node launch's warm process begun
before the command line is read, adopted only when the job needs exactly that one. Real
fleetrun runs and real warm processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import REPO, run_fleetrun, start_fleetrun, wait_gone, warm_processes_of

from launcher import warm
from launcher.attempt import close_warm_early, start_warm_early
from launcher.prestart import guess
from launcher.spec import build_spec

PROBE = str(REPO / "tests" / "scripts" / "warm_probe.py")
HEADER = "==== fleetrun: warm process"
BEGUN = "(started before fleetrun read its command line)"


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--nproc_per_node", "2", PROBE, "--x", "1"], (2, [])),
        (["--nproc-per-node=3", "--log_dir", "l", "--no_metrics", PROBE], (3, [])),
        (["--warm_imports", "json, csv", "--", PROBE], (1, ["json", "csv"])),
        (["-m", "json.tool"], (1, [])),
        (["--nnodes", "1", "--node_rank", "0", "--warm_start", "on", PROBE], (1, [])),
        (["-c", "job.yaml"], None),  # a job file may say anything
        (["--nnodes", "2", PROBE], None),
        (["--warm_start", "off", PROBE], None),
        (["--scheduler", "ray", PROBE], None),
        (["--server_num", "1", "--worker_num", "1", PROBE], None),
        (["--no_python", PROBE], None),
        (["--dry_run", PROBE], None),
        (["--nproc_per_node", "auto", PROBE], None),
        (["--nproc_per_node"], None),
        (["status"], None),
        (["no_such_script.py"], None),
        ([], None),
    ],
)
def test_what_a_glance_at_the_command_line_allows(args: list[str], expect: object) -> None:
    assert guess(args, {"FLEETRUN_LOG_LEVEL": "DEBUG"}) == expect


def test_a_fleetrun_variable_may_change_the_job() -> None:
    assert guess([PROBE], {}) == (1, [])
    assert guess([PROBE], {"FLEETRUN_WARM_START": "off"}) is None


@pytest.mark.timeout(180)
def test_the_begun_warm_process_runs_the_job(tmp_path: Path) -> None:
    log = tmp_path / "log"
    r = run_fleetrun("--nproc_per_node", "2", "--log_dir", str(log), PROBE, timeout=150)
    assert r.returncode == 0, r.stderr
    text = (log / "warmlog.0").read_text()
    assert text.count(HEADER) == 1 and BEGUN in text, text
    assert text.count("forked ") == 2, text


@pytest.mark.timeout(120)
def test_a_bad_command_line_stops_the_begun_warm_process(tmp_path: Path) -> None:
    """The guess passes (``--tee`` takes a value) but the option is refused: fleetrun exits
    with the usage error, its warm process gone and no log directory made."""
    log = tmp_path / "log"
    p = start_fleetrun("--nproc_per_node", "2", "--log_dir", str(log), "--tee", "bogus", PROBE)
    _out, err = p.communicate(timeout=100)
    assert p.returncode != 0 and "bogus" in err, err
    assert not log.exists()
    mark = f"--agent\0{p.pid}\0".encode()
    deadline = time.monotonic() + 10
    while warm_processes_of(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert warm_processes_of(mark) == []


@pytest.mark.timeout(180)
def test_a_begun_warm_process_the_job_does_not_need_is_replaced(tmp_path: Path) -> None:
    """A warm process begun for another environment is stopped, and the job gets its own."""
    spec = build_spec(
        {
            "entrypoint": {"script": PROBE},
            "sizes": {"nproc_per_node": 2},
            "log_dir": str(tmp_path / "log"),
            "env": {"PROBE_TAG": "job"},
        }
    )
    wrong = warm.begin(warm.node_env({}, 2), [], 2)  # without the job's env: entry
    try:
        start_warm_early(spec)
        assert wait_gone([wrong.pid], 10) == []
        kept = warm.take_early(str(tmp_path / "log" / "warmlog.0"))
        assert kept is not None and kept is not wrong and kept.env["PROBE_TAG"] == "job"
        kept.close()
        assert wait_gone([kept.pid], 10) == []
        assert BEGUN not in (tmp_path / "log" / "warmlog.0").read_text()
    finally:
        wrong.close()
        close_warm_early()
