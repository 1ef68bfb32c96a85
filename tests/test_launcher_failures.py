"""Failures: root-cause-first summary, teardown of hung ranks, restarts, signals, no orphans."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS, live_pids, run_fleetrun, start_fleetrun, wait_gone

WORKER = str(SCRIPTS / "launcher_worker.py")


def _pids(out: Path) -> list[int]:
    pids = []
    for f in out.glob("rank*.json"):
        rec = json.loads(f.read_text())
        pids.append(rec["pid"])
        if "grandchild" in rec:
            pids.append(rec["grandchild"])
    return pids


def _wait_files(out: Path, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(out.glob("rank*.json"))) < n:
        assert time.monotonic() < deadline, (
            f"only {len(list(out.glob('rank*.json')))} of {n} workers started"
        )
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_exception_is_root_cause_and_hung_ranks_are_killed(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "log"
    t0 = time.monotonic()
    r = run_fleetrun(
        "--nproc_per_node",
        "3",
        "--log_dir",
        str(logs),
        WORKER,
        "--out",
        str(out),
        "--fail_ranks",
        "1",
        "--hang",
        "--grandchild",
    )
    elapsed = time.monotonic() - t0
    assert r.returncode == 1
    err = r.stderr
    assert "Root cause (first observed failure):" in err
    assert "trainer  : rank 1 (local_rank 1, node 0)" in err
    assert "exit     : exit code 1" in err
    assert "error    : ValueError: injected failure on rank 1" in err
    assert 'raise ValueError(f"injected failure on rank {rank}")' in err  # traceback lines
    assert "Stopped by fleetrun after the root cause: ranks 0, 2" in err
    assert f"Logs: {logs}/workerlog.1 (root cause)" in err
    assert elapsed < 30, "hung ranks were not killed promptly"
    assert not live_pids(_pids(out)), "orphan processes survived"


@pytest.mark.timeout(60)
def test_sigkill_is_named_and_log_tail_shown(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_fleetrun(
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(tmp_path / "log"),
        WORKER,
        "--out",
        str(out),
        "--sigkill_ranks",
        "1",
        "--hang",
    )
    assert r.returncode == 1
    assert "exit     : signal SIGKILL (9)" in r.stderr
    assert "about to SIGKILL myself" in r.stderr  # from the log tail: no error file for a signal
    assert not live_pids(_pids(out))


@pytest.mark.timeout(60)
def test_ignoring_sigterm_still_gets_killed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_fleetrun(
        "--nproc_per_node",
        "2",
        "--grace_period",
        "1",
        "--log_dir",
        str(tmp_path / "log"),
        WORKER,
        "--out",
        str(out),
        "--exit_code_ranks",
        "1",
        "--hang",
        "--ignore_sigterm",
    )
    assert r.returncode == 1
    assert "exit     : exit code 3" in r.stderr
    assert not live_pids(_pids(out))


@pytest.mark.timeout(90)
def test_restarts_until_success(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "log"
    r = run_fleetrun(
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "3",
        "--log_dir",
        str(logs),
        WORKER,
        "--out",
        str(out),
        "--fail_ranks",
        "0",
        "--fail_attempts",
        "2",
        "--delay",
        "0",
    )
    assert r.returncode == 0, r.stderr
    assert "restarting the job (restart 1 of 3)" in r.stderr
    assert "restarting the job (restart 2 of 3)" in r.stderr
    assert (out / "rank1.attempt2.json").exists() and not (out / "rank0.attempt3.json").exists()
    env = json.loads((out / "rank1.attempt2.json").read_text())["env"]
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    log = (logs / "workerlog.0").read_text()
    assert "attempt 0" in log and "attempt 2" in log  # restarts append to the same log


@pytest.mark.timeout(90)
def test_restart_budget_exhausted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_fleetrun(
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "1",
        "--log_dir",
        str(tmp_path / "log"),
        WORKER,
        "--out",
        str(out),
        "--exit_code_ranks",
        "1",
        "--delay",
        "0",
    )
    assert r.returncode == 1
    assert "(attempt 1, restarts used 1/1)" in r.stderr
    assert "Earlier attempts: attempt 0: rank 1 exit code 3" in r.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_fleetrun_tears_everything_down(tmp_path: Path, sig: int, code: int) -> None:
    out = tmp_path / "out"
    p = start_fleetrun(
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(tmp_path / "log"),
        WORKER,
        "--out",
        str(out),
        "--hang",
        "--grandchild",
    )
    _wait_files(out, 2)
    pids = _pids(out)
    assert len(live_pids(pids)) == 4
    os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)  # Ctrl-C hits the group
    _, err = p.communicate(timeout=30)
    assert p.returncode == code, err
    assert "stopped every process" in err
    assert not wait_gone(pids, 5), "orphans after signal"


@pytest.mark.timeout(60)
def test_fleetrun_sigkilled_leaves_no_orphans(tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = start_fleetrun(
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(tmp_path / "log"),
        WORKER,
        "--out",
        str(out),
        "--hang",
    )
    _wait_files(out, 2)
    pids = _pids(out)
    p.kill()  # SIGKILL: no handler runs; PR_SET_PDEATHSIG must take the workers down
    p.communicate(timeout=10)
    assert not wait_gone(pids, 10), "workers outlived a SIGKILLed fleetrun"


@pytest.mark.timeout(30)
def test_wait_any_returns_for_an_exit_it_is_first_to_see(tmp_path: Path) -> None:
    """A worker that exited after the caller last looked (a zombie nobody polled) ends the wait
    at once, even while others keep running — the all-trainers-done check of a PS job once
    waited an hour on servers that never stop."""
    import sys

    from conftest import wait_for

    from launcher.process import WorkerProcess, terminate_all, wait_any

    quick = WorkerProcess(
        [sys.executable, "-c", "pass"], dict(os.environ), str(tmp_path / "q"), None
    )
    slow = WorkerProcess(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        dict(os.environ),
        str(tmp_path / "s"),
        None,
    )
    try:

        def zombie() -> bool:
            with open(f"/proc/{quick.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"

        wait_for(zombie, 20, "the quick worker to exit")
        assert quick.exit is None  # not polled yet
        t0 = time.monotonic()
        done = wait_any([quick, slow], 30.0)
        assert time.monotonic() - t0 < 5
        assert done == [quick] and quick.exit is not None and quick.exit.ok
        assert wait_any([quick, slow], 0.2) == [quick]  # already seen: waits on the others
    finally:
        terminate_all([quick, slow], 1.0)
    assert slow.exit is not None


@pytest.mark.timeout(90)
def test_the_rank_that_failed_is_the_root_cause_though_its_peer_exits_first(
    tmp_path: Path,
) -> None:
    """Rank 1 raises, closes its gloo connections at exit, then takes a second to exit; rank
    0, in a barrier with it, fails at once on the closed connection and exits first. Rank 1's
    own error is the root cause (it had written its error file), rank 0 only lost its peer."""
    r = run_fleetrun(
        "--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"),
        str(SCRIPTS / "multinode_allreduce.py"), "--fail_rank", "1", "--linger", "1.0",
    )  # fmt: skip
    assert r.returncode == 1
    summary = r.stderr[r.stderr.index("Root cause") :]
    assert "trainer  : rank 1 (local_rank 1, node 0)" in summary, summary
    assert "error    : RuntimeError: injected failure on rank 1" in summary, summary
    assert "[rank 0] exit code 1" in summary, summary
