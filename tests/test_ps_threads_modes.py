"""Training threads per mode (real fleetrun jobs, 1 server + 1 trainer): half-async and GEO train
every example exactly once per epoch on two threads, sync mode trains on one thread whatever
``thread_num`` says (and says so once), and an exception in a training thread ends the job with
that thread's traceback instead of hanging."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_ps_threads import LINES, logs, run_job, write_files


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["half", "geo"])
def test_half_async_and_geo_train_every_example_once_on_two_threads(
    tmp_path: Path, mode: str
) -> None:
    data = write_files(tmp_path)
    run = run_job(tmp_path, mode, data, "--mode", mode, "--threads", "2")
    for epoch in run["epochs"]:
        assert epoch["examples"] == LINES and len(epoch["threads"]) == 2, epoch
    assert run["seen"] == [[2, LINES]], run["seen"]
    assert run["count_rows"] == [[2.0, LINES]], run["count_rows"]
    assert run["epochs"][-1]["auc"] > 0.6, run["epochs"]


@pytest.mark.timeout(300)
def test_sync_mode_trains_on_one_thread_and_says_so_once(tmp_path: Path) -> None:
    data = write_files(tmp_path)
    run = run_job(tmp_path, "sync", data, "--mode", "sync", "--threads", "2", "--thread-num", "2")
    for epoch in run["epochs"]:
        assert epoch["examples"] == LINES and len(epoch["threads"]) == 1, epoch
    assert run["count_rows"] == [[2.0, LINES]], run["count_rows"]
    log = logs(tmp_path / "log_sync")
    assert log.count("sync mode trains with one thread") == 1, log[-2000:]


@pytest.mark.timeout(200)
def test_an_exception_in_a_training_thread_ends_the_job_with_its_traceback(
    tmp_path: Path,
) -> None:
    data = write_files(tmp_path)
    r = run_job(tmp_path, "fail", data, "--threads", "2", "--fail-at", "7", ok=False)
    assert r["returncode"] != 0
    log = r["log"]
    assert "RuntimeError: boom in the forward of batch 7" in log, log[-3000:]
    # the worker's own frames (the model's forward) are in the traceback, and which thread
    assert "in forward" in log and "raised in training thread" in log, log[-3000:]


@pytest.mark.timeout(300)
def test_automatic_checkpoints_cut_between_the_threads_steps(tmp_path: Path) -> None:
    data = write_files(tmp_path)
    launch = ("--ps_checkpoint_dir", str(tmp_path / "ckpt"), "--ps_checkpoint_interval", "0.3")
    run = run_job(tmp_path, "ckpt", data, "--threads", "2", "--until-cut", launch=launch)
    for epoch in run["epochs"]:
        assert epoch["examples"] == LINES and len(epoch["threads"]) == 2, epoch
    epochs = float(len(run["epochs"]))
    assert run["count_rows"] == [[epochs, LINES]], run["count_rows"]  # no push lost to a cut
    progress = json.loads((tmp_path / "log_ckpt" / "ps_progress.0.json").read_text())
    assert progress.get("checkpoint_step"), progress  # cuts were taken while threads trained
