"""A graph server killed in a fleetrun PS job comes back with its graph shard: an async job with
automatic checkpoints (``--ps_checkpoint_dir``) serves a graph table loaded from files while it
trains; one server is SIGKILLed; fleetrun restarts it alone and it restores its tables from the
newest checkpoint, so ``sample_neighbors`` (every neighbor), ``degree`` and ``node_features``
answer exactly as before the kill (real processes: tests/scripts/graph_recovery_job.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, base_env, fleetrun_cmd, wait_for, wait_gone

from launcher.recovery.ps_policy import latest_committed


def _state(log: Path, pids: set[int]) -> dict:
    data = json.loads((log / "job_state.json").read_text())
    pids.update(p["pid"] for p in data["processes"] if p.get("pid"))
    return data


def _pid(log: Path, pids: set[int], role: str, rank: int) -> int | None:
    for p in _state(log, pids)["processes"]:
        if p["role"] == role and p["rank"] == rank and p["state"] == "up":
            return int(p["pid"])
    return None


@pytest.mark.timeout(240)
def test_killed_graph_server_restores_its_shard(tmp_path: Path) -> None:
    log, ckpt, out = tmp_path / "log", tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    pids: set[int] = set()
    args = [
        *("--server_num", "2", "--worker_num", "2", "--log_dir", str(log)),
        *("--ps_checkpoint_dir", str(ckpt), "--ps_checkpoint_interval", "0.5"),
        *("--ps_checkpoint_keep", "2", "--max_restarts", "2", "--tee", "none"),
        *("--grace_period", "2", "tests/scripts/graph_recovery_job.py"),
        *("--data_dir", str(tmp_path / "data"), "--out", str(out)),
    ]
    with open(tmp_path / "stdout.txt", "w") as o, open(tmp_path / "stderr.txt", "w") as e:
        proc = subprocess.Popen(
            fleetrun_cmd(*args),
            cwd=str(REPO),
            env=base_env(),
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
    try:
        wait_for(lambda: (out / "before.json").exists(), 120, "the graph loaded")
        loaded = os.path.getmtime(out / "before.json")
        # a checkpoint committed after the load holds the graph
        wait_for(
            lambda: (
                (c := latest_committed(str(ckpt)))
                and os.path.getmtime(ckpt / c[0] / "checkpoint.json") > loaded
            ),
            120,
            "a checkpoint after the graph load",
        )
        old = wait_for(lambda: _pid(log, pids, "server", 1), 30, "server 1")
        os.kill(old, signal.SIGKILL)
        wait_for(
            lambda: (p := _pid(log, pids, "server", 1)) and p != old,
            120,
            "server 1 restarted",
        )
        (out / "query").touch()
        rc = proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:
            _state(log, pids)
        except (OSError, ValueError):
            pass
        assert not wait_gone(sorted(pids), 15), "processes of the job outlived it"
    err = (tmp_path / "stderr.txt").read_text()
    assert rc == 0, err[-4000:]
    assert "recovery 1 (attempt 0, in place): server 1 signal SIGKILL" in err, err[-3000:]
    server_log = "\n".join(p.read_text() for p in log.rglob("*server*1*") if p.is_file())
    assert "restored its shards from ckpt-" in server_log + err, server_log[-3000:]
    before = json.loads((out / "before.json").read_text())
    after = json.loads((out / "after.json").read_text())
    assert sum(before["degree"]) == 10_000
    for key in ("neighbors", "degree", "x", "tag"):
        assert after[key] == before[key], key
