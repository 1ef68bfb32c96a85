"""A PS job with automatic checkpoints on Ray recovers as locally: on the loopback Ray cluster
(its own temp dir, usage stats off; the fixture of test_ray_scheduler.py) the actor of a server
is SIGKILLed mid-training (as when its process or node dies); every actor is re-created in the
job's placement group (same bundles, the server on its node and port), trainer 0 loads the newest
good checkpoint, the trainers skip what they had trained, the job exits 0 with the recovery
listed, and no process, actor or placement group is left."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml
from conftest import REPO, gen_slot_files, start_fleetrun, wait_for
from test_ray_scheduler import _assert_nothing_left, cluster  # noqa: F401 - the module's cluster

psutil = pytest.importorskip("psutil")

LINES = 1500
GLOBAL_BATCH = 32


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_actor_killed_job_recovers(cluster: str, tmp_path: Path) -> None:  # noqa: F811
    data, log, ckpt = tmp_path / "slots", tmp_path / "log", tmp_path / "ckpt"
    gen_slot_files(data, 2, LINES)
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "ray-ps-rec",
                "scheduler": "ray",
                "mode": "ps",
                "entrypoint": {
                    "script": "examples/ctr/train_ps.py",
                    "args": [
                        "--data_dir",
                        str(data),
                        "--test",
                        "500",
                        "--batch_size",
                        str(GLOBAL_BATCH),
                        "--embedding_dim",
                        "8",
                        "--mode",
                        "sync",
                    ],
                },
                "sizes": {"server_num": 1, "worker_num": 2},
                "max_restarts": 1,
                "log_dir": str(log),
                "resources": {r: {"cpu": 0.5, "memory": "256Mi"} for r in ("trainer", "server")},
                "tee": "none",
                "grace_period_s": 2.0,
                "ps_checkpoint": {"dir": str(ckpt), "interval_s": 0.5, "keep": 2},
                "ray": {"placement_timeout_s": 60, "address": cluster},
            }
        )
    )
    pids: set[int] = set()

    def state() -> dict:
        got = json.loads((log / "job_state.json").read_text())
        pids.update(p["pid"] for p in got["processes"] if p.get("pid"))
        return got

    def server_pid() -> int | None:
        got = state()
        return next(
            (
                p["pid"]
                for p in got["processes"]
                if p["role"] == "server" and p["state"] == "up" and got["attempt"] == 0
            ),
            None,
        )

    from launcher.recovery.ps_policy import latest_committed

    p = start_fleetrun("-c", str(job), cwd=REPO)
    try:
        wait_for(lambda: latest_committed(str(ckpt)), 150, "a committed checkpoint")
        server = psutil.Process(wait_for(server_pid, 30, "the server's pid"))
        actor = server.parent()
        assert actor is not None and "ProcessActor" in " ".join(actor.cmdline()), actor
        actor.kill()
        _, err = p.communicate(timeout=200)
        state()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    err = err.decode() if isinstance(err, bytes) else err
    assert p.returncode == 0, err[-4000:]
    assert "recovery 1 (attempt 0 -> 1): server 0 Ray actor died" in err, err[-3000:]
    steps = LINES // (GLOBAL_BATCH // 2)
    for rank in (0, 1):  # attempt 1 resumed from a checkpoint and finished the pass
        prog = json.loads((log / f"ps_progress.{rank}.json").read_text())
        assert (
            prog["attempt"] == 1 and prog["resumed"].get("checkpoint") and prog["step"] == steps
        ), prog
    final = json.loads((log / "job_state.json").read_text())
    assert final["state"] == "succeeded" and len(final["recoveries"]) == 1, final
    servers = [
        ln for ln in (log / "endpoints.log").read_text().splitlines() if ln.startswith("server 0 ")
    ]
    assert len(servers) == 2 and servers[0] == servers[1], (
        servers
    )  # the same endpoint both attempts
    _assert_nothing_left(cluster, sorted(pids))
