"""On Ray, a dead async PS server is restarted alone, in place: on the loopback Ray cluster (its
own temp dir, usage stats off; the fixture of test_ray_scheduler.py) the actor of server 0 of
an async CTR job (1 server, 2 trainers) is SIGKILLed mid-training. Only that server's actor is
re-created, in its bundle, on its port, restoring its shards from the newest good checkpoint;
the trainers' processes never stop (same pids, same attempt); ``job_state.json`` counts it in
``restarts``. Then the server dies while its port is taken: nothing can restart alone, so every
process restarts, the server on a new port (the trainers get it in their env). The job exits 0
with both recoveries listed, and no process, actor or placement group is left."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, base_env, start_fleetrun, wait_for
from test_ray_scheduler import _assert_nothing_left, cluster  # noqa: F401 - the module's cluster

psutil = pytest.importorskip("psutil")

LINES = 3000
GLOBAL_BATCH = 32


def _hold_port(port: int, timeout_s: float) -> socket.socket:
    """Listen on 127.0.0.1:``port`` as soon as it is free (bounded in time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
            return sock
        except OSError:
            sock.close()
            assert time.monotonic() < deadline, f"port {port} not free within {timeout_s} s"
            time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_server_restarts_alone_then_on_a_new_port(cluster: str, tmp_path: Path) -> None:  # noqa: F811
    """Kill 1: server 0's actor SIGKILLed → only that actor re-created, on the same port.
    Kill 2: server 0's process SIGKILLed while its port is taken (the test listens on it; its
    actor is paused until then, so the driver learns of the death only after) → every process
    restarts, that server on a new port, the trainers resume from a checkpoint."""
    data, log, ckpt = tmp_path / "slots", tmp_path / "log", tmp_path / "ckpt"
    subprocess.run([sys.executable, "examples/ctr/gen_slot_files.py", "--out_dir", str(data),
                    "--num_files", "2", "--lines_per_file", str(LINES)],
                   cwd=REPO, env=base_env(), check=True, capture_output=True, timeout=120)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "ray-ps-alone", "scheduler": "ray", "mode": "ps",
        "entrypoint": {"script": "examples/ctr/train_ps.py",
                       "args": ["--data_dir", str(data), "--test", "500", "--batch_size",
                                str(GLOBAL_BATCH), "--embedding_dim", "8", "--mode", "async"]},
        "sizes": {"server_num": 1, "worker_num": 2}, "max_restarts": 2, "log_dir": str(log),
        "resources": {r: {"cpu": 0.5, "memory": "256Mi"} for r in ("trainer", "server")},
        "tee": "none", "grace_period_s": 2.0,
        "ps_checkpoint": {"dir": str(ckpt), "interval_s": 0.5, "keep": 2},
        "ray": {"placement_timeout_s": 60, "address": cluster},
    }))
    pids: set[int] = set()

    def state() -> dict:
        got = json.loads((log / "job_state.json").read_text())
        pids.update(p["pid"] for p in got["processes"] if p.get("pid"))
        return got

    def up(role: str) -> dict[int, int]:
        return {p["rank"]: p["pid"] for p in state()["processes"] if p["role"] == role and p["state"] == "up"}

    from launcher.ps_recovery import latest_committed

    holder: socket.socket | None = None
    p = start_fleetrun("-c", str(job), cwd=REPO)
    try:
        wait_for(lambda: latest_committed(str(ckpt)) and len(up("trainer")) == 2 and up("server"),
                 150, "a committed checkpoint, every process up")
        trainers = up("trainer")
        server = psutil.Process(up("server")[0])
        actor = server.parent()
        assert actor is not None and "ProcessActor" in " ".join(actor.cmdline()), actor
        actor.kill()
        wait_for(lambda: up("server").get(0, server.pid) != server.pid, 120, "server 0 re-created")
        assert up("trainer") == trainers  # the trainers never stopped
        for pid in trainers.values():
            assert psutil.pid_exists(pid)
        wait_for(lambda: "server 0 restored its shards from ckpt-" in (log / "serverlog.0").read_text(),
                 120, "server 0 restored")
        after_first = state()
        assert (after_first["attempt"], after_first["restarts"]) == (0, 1), after_first
        # kill 2, its port taken: pause its actor, kill the server, listen on its port, resume
        second = psutil.Process(up("server")[0])
        port = int(second.environ()["PADDLE_PORT"])
        actor = second.parent()
        assert actor is not None
        actor.suspend()
        try:
            second.kill()
            holder = _hold_port(port, 20)
        finally:
            actor.resume()
        wait_for(lambda: state()["attempt"] == 1 and up("server"), 120, "attempt 1's server up")
        holder.close()
        holder = None
        _, err = p.communicate(timeout=200)
        final = state()
    finally:
        if holder is not None:
            holder.close()
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    err = err.decode() if isinstance(err, bytes) else err
    assert p.returncode == 0, err[-4000:]
    assert final["state"] == "succeeded" and final["attempt"] == 1 and final["restarts"] == 2, final
    first, second_line = final["recoveries"]
    assert "(attempt 0, in place): server 0 Ray actor died" in first, first
    assert "restarted: server 0 only" in first and "0 steps redone" in first, first
    assert "(attempt 0 -> 1): server 0 signal SIGKILL" in second_line, second_line
    assert "restarted: every process" in second_line, second_line
    assert "cannot come back on" in err and "PS recoveries:" in err, err[-3000:]
    steps = LINES // (GLOBAL_BATCH // 2)
    for rank in (0, 1):  # attempt 1 resumed from a checkpoint and finished the pass
        prog = json.loads((log / f"ps_progress.{rank}.json").read_text())
        assert prog["attempt"] == 1 and prog["resumed"].get("checkpoint") and prog["step"] == steps, prog
    server_log = (log / "serverlog.0").read_text()
    assert len(re.findall(r"server 0 restored its shards from ckpt-\d+", server_log)) == 1, server_log[-3000:]
    eps = [ln for ln in (log / "endpoints.log").read_text().splitlines() if ln.startswith("server 0 ")]
    assert len(eps) == 2 and eps[0] == f"server 0 127.0.0.1:{port}" and eps[1] != eps[0], eps
    _assert_nothing_left(cluster, sorted(pids))
