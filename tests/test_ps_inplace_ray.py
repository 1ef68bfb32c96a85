"""On Ray, a dead async PS server is restarted alone, in place: on the loopback Ray cluster (its
own temp dir, usage stats off; the fixture of test_ray_scheduler.py) the actor of server 0 of
an async CTR job (1 server, 2 trainers) is SIGKILLed mid-training. Only that server's actor is
re-created, in its bundle, on its port, restoring its shards from the newest good checkpoint;
the trainers' processes never stop (same pids, same attempt); ``job_state.json`` counts it in
``restarts``. Then the server dies while its port is taken: nothing can restart alone, so every
process restarts, the server on a new port (the trainers get it in their env). The job exits 0
with both recoveries listed, and no process, actor or placement group is left.

A dead async trainer too (2 servers, 2 trainers): its process SIGKILLed mid-pass, only its actor
is re-created, in its bundle; it resumes at its data position and meets trainer 0 through the
coordinator the driver hosts, while trainer 0 and the servers go on. The fallbacks to
restart-all (no coordinator, a trainer not meeting through it, no data position yet, no budget,
two deaths at once) are checked without a cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import (
    REPO,
    base_env,
    fleetrun_cmd,
    gen_slot_files,
    live_pids,
    start_fleetrun,
    wait_for,
)
from test_ray_scheduler import _assert_nothing_left, cluster  # noqa: F401 - the module's cluster

psutil = pytest.importorskip("psutil")

LINES = 3000
GLOBAL_BATCH = 32


def _hold_port(port: int, timeout_s: float) -> socket.socket:
    """Listen on 127.0.0.1:``port`` as soon as it is free (bounded in time). SO_REUSEADDR, as
    the PS server and the driver's port check: without it the killed server's connections (left
    in FIN_WAIT2 / TIME_WAIT for up to a minute) block the bind; with it only a listener does."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
            return sock
        except OSError:
            sock.close()
            assert time.monotonic() < deadline, f"port {port} not free within {timeout_s} s"
            time.sleep(0.01)


def _is_zygote(proc: psutil.Process, log: Path) -> bool:
    """A warm process of the job logging to ``log`` (or a worker forked from one)."""
    try:
        return "collective.zygote" in proc.cmdline() and str(log) in str(proc.environ())
    except psutil.Error:
        return False


@pytest.mark.timeout(30)
def test_trainer_alone_falls_back_where_the_local_path_does(tmp_path: Path) -> None:
    """The decision the Ray driver takes before it re-creates a dead trainer's actor (the local
    agent's own, :meth:`PSRecovery.trainer_position`): every trainer's progress must say it
    meets through the coordinator, the dead one's must hold its data position, a restart must
    be left; two deaths at once restart every process. No cluster needed."""
    from launcher.recovery.ps_policy import PSRecovery
    from launcher.schedulers.ray.ps_recovery import respawn_trainer
    from launcher.spec import build_spec
    from launcher.summary import Failure

    spec = build_spec(
        {
            "mode": "ps",
            "sizes": {"server_num": 1, "worker_num": 2},
            "ps_checkpoint": {"dir": str(tmp_path / "ck")},
            "log_dir": str(tmp_path / "log"),
        }
    )
    rec = PSRecovery(spec)
    (tmp_path / "log").mkdir()
    pos = {"pass": 0, "step_in_pass": 30, "step": 30}

    def progress(rank: int, alone_ok: bool, position: dict | None = pos) -> None:
        (tmp_path / "log" / f"ps_progress.{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "attempt": 0,
                    "step": 30,
                    "mode": "async",
                    "alone_ok": alone_ok,
                    **({"position": position} if position else {}),
                }
            )
        )

    progress(0, True)
    progress(1, True)
    assert not rec.alone_possible(0, "trainer", True, 1)  # no coordinator: restart-all
    rec.start_coordinator("secret", "127.0.0.1")
    try:
        assert rec.trainer_env()["FLEET_PS_COORDINATOR"] == rec.coordinator.endpoint
        assert rec.coordinator.endpoint.startswith("127.0.0.1:")
        assert rec.alone_possible(0, "trainer", True, 1)
        assert not rec.alone_possible(0, "trainer", False, 1)  # budget spent
        assert not rec.alone_possible(1, "trainer", True, 1)  # progress of another attempt
        progress(0, False)  # trainer 0 opted out (sync / half-async: a gloo group)
        assert not rec.alone_possible(0, "trainer", True, 1)
        progress(0, True)
        progress(1, True, position=None)  # no data position yet
        assert not rec.alone_possible(0, "trainer", True, 1)
        (tmp_path / "log" / "ps_progress.1.json").unlink()  # no progress yet
        assert not rec.alone_possible(0, "trainer", True, 1)
        progress(1, True)

        def failure(rank: int) -> Failure:
            return Failure(
                "trainer", rank, rank, 0, "h", 1, "signal SIGKILL (9)", time.time(), 0, ""
            )

        both = [failure(0), failure(1)]  # two deaths at once: no actor is touched
        assert respawn_trainer(None, rec, both, None, None, 0, {}, None, 0, True) is None  # type: ignore[arg-type]
        assert not rec.recoveries
        got = rec.recover_alone(0, "rank 1 signal SIGKILL (9)", "trainer", 1, True)
        assert got is not None and got.position == pos and rec.coordinator.dead == {1}
        assert json.loads(rec.resume_env(got)["FLEET_PS_RESUME_POSITION"]) == pos
        assert (
            "restarted: trainer 1 only, resumed at its data position (pass 0, step 30 of it"
            in got.text()
        )
    finally:
        rec.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("warm", ["off", "on"])
def test_async_server_restarts_alone_then_on_a_new_port(
    cluster: str,  # noqa: F811
    tmp_path: Path,
    warm: str,
) -> None:
    """Kill 1: server 0's actor SIGKILLed → only that actor re-created, on the same port.
    Kill 2: server 0's process SIGKILLed while its port is taken (the test listens on it; its
    actor is paused until then, so the driver learns of the death only after) → every process
    restarts, that server on a new port, the trainers resume from a checkpoint. With warm
    starts, the same (the actor of kill 2 answers, so it is kept, then killed for the
    restart of every process)."""
    data, log, ckpt = tmp_path / "slots", tmp_path / "log", tmp_path / "ckpt"
    gen_slot_files(data, 2, LINES)
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "ray-ps-alone",
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
                        "async",
                    ],
                },
                "sizes": {"server_num": 1, "worker_num": 2},
                "max_restarts": 2,
                "log_dir": str(log),
                "resources": {r: {"cpu": 0.5, "memory": "256Mi"} for r in ("trainer", "server")},
                "tee": "none",
                "grace_period_s": 2.0,
                "ps_checkpoint": {"dir": str(ckpt), "interval_s": 0.5, "keep": 2},
                "ray": {"placement_timeout_s": 60, "address": cluster},
                "warm_start": warm,
            }
        )
    )
    pids: set[int] = set()

    def state() -> dict:
        got = json.loads((log / "job_state.json").read_text())
        pids.update(p["pid"] for p in got["processes"] if p.get("pid"))
        return got

    def up(role: str) -> dict[int, int]:
        return {
            p["rank"]: p["pid"]
            for p in state()["processes"]
            if p["role"] == role and p["state"] == "up"
        }

    from launcher.recovery.ps_policy import latest_committed

    holder: socket.socket | None = None
    p = start_fleetrun("-c", str(job), cwd=REPO)
    try:
        wait_for(
            lambda: latest_committed(str(ckpt)) and len(up("trainer")) == 2 and up("server"),
            150,
            "a committed checkpoint, every process up",
        )
        trainers = up("trainer")
        server = psutil.Process(up("server")[0])
        actor = server.parent()
        assert actor is not None and "ProcessActor" in " ".join(actor.cmdline()), actor
        actor.kill()
        wait_for(lambda: up("server").get(0, server.pid) != server.pid, 120, "server 0 re-created")
        assert up("trainer") == trainers  # the trainers never stopped
        for pid in trainers.values():
            assert psutil.pid_exists(pid)
        wait_for(
            lambda: "server 0 restored its shards from ckpt-" in (log / "serverlog.0").read_text(),
            120,
            "server 0 restored",
        )
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
    progs = [json.loads((log / f"ps_progress.{rank}.json").read_text()) for rank in (0, 1)]
    for prog in progs:  # attempt 1 resumed from a checkpoint, each trainer at its own position
        assert (
            prog["attempt"] == 1 and prog["resumed"].get("checkpoint") and prog["step"] <= steps
        ), prog
    # the trainers meet through the driver's coordinator, so each cut holds every trainer's own
    # position, and in async mode train_ps.py trains each for what its data has left: both
    # finish their pass (after a restart-all recovery each trainer resumes at its own position)
    assert all(prog["step"] == steps for prog in progs), progs
    server_log = (log / "serverlog.0").read_text()
    assert len(re.findall(r"server 0 restored its shards from ckpt-\d+", server_log)) == 1, (
        server_log[-3000:]
    )
    eps = [
        ln for ln in (log / "endpoints.log").read_text().splitlines() if ln.startswith("server 0 ")
    ]
    assert len(eps) == 2 and eps[0] == f"server 0 127.0.0.1:{port}" and eps[1] != eps[0], eps
    _assert_nothing_left(cluster, sorted(pids))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("warm", ["off", "on"])
def test_async_trainer_restarts_alone_on_ray(cluster: str, tmp_path: Path, warm: str) -> None:  # noqa: F811
    """2 servers + 2 async trainers: trainer 1's process SIGKILLed mid-pass → only its actor is
    re-created, in its bundle, and it resumes at its data position (FLEET_PS_RESUME_POSITION),
    meeting trainer 0 through the coordinator the driver hosts; trainer 0 keeps its pid and its
    steps never go back; one in-place recovery, one attempt; exit 0, nothing left. With warm
    starts the actor is kept and the new process is forked from its warm process."""
    data, log, ckpt = tmp_path / "slots", tmp_path / "log", tmp_path / "ckpt"
    gen_slot_files(data, 2, LINES)
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "ray-trainer-alone",
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
                        "async",
                    ],
                },
                "sizes": {"server_num": 2, "worker_num": 2},
                "max_restarts": 1,
                "log_dir": str(log),
                "resources": {r: {"cpu": 0.5, "memory": "256Mi"} for r in ("trainer", "server")},
                "tee": "none",
                "grace_period_s": 2.0,
                "ps_checkpoint": {"dir": str(ckpt), "interval_s": 0.5, "keep": 2},
                "ray": {"placement_timeout_s": 60, "address": cluster},
                "warm_start": warm,
            }
        )
    )
    pids: set[int] = set()
    seen: dict[int, set[int]] = {0: set(), 1: set()}
    restarted: dict[str, object] = {}
    steps0: list[int] = []

    def state() -> dict:
        got = json.loads((log / "job_state.json").read_text())
        for p in got["processes"]:
            if p.get("pid"):
                pids.add(p["pid"])
                if p["role"] == "trainer":
                    seen[p["rank"]].add(p["pid"])
        return got

    def up(role: str) -> dict[int, int]:
        return {
            p["rank"]: p["pid"]
            for p in state()["processes"]
            if p["role"] == role and p["state"] == "up"
        }

    def progress(rank: int) -> dict:
        return json.loads((log / f"ps_progress.{rank}.json").read_text())

    def ended() -> bool:  # sample trainer 0's step and every trainer pid as the job runs
        steps0.append(progress(0)["step"])
        pid = up("trainer").get(1)
        if pid and pid != trainers[1] and "cmdline" not in restarted:
            try:
                proc = psutil.Process(pid)
                restarted.update(pid=pid, ppid=proc.ppid())
            except psutil.NoSuchProcess:
                pass
        return p.poll() is not None

    err_path = tmp_path / "stderr.txt"
    with open(tmp_path / "stdout.txt", "w") as out, open(err_path, "w") as err_file:
        p = subprocess.Popen(
            fleetrun_cmd("-c", str(job)),
            cwd=str(REPO),
            env=base_env(),
            stdout=out,
            stderr=err_file,
            start_new_session=True,
        )
    try:
        wait_for(
            lambda: (
                len(up("trainer")) == 2
                and len(up("server")) == 2
                and progress(1)["step"] >= 20
                and progress(1).get("alone_ok")
            ),
            150,
            "every process up, trainer 1 at step 20 meeting through the coordinator",
        )
        trainers = up("trainer")
        first = psutil.Process(trainers[1])
        assert "FLEET_PS_COORDINATOR" in first.environ()
        actor_pid = first.ppid()  # a process is its actor's child, forked or not
        assert "examples/ctr/train_ps.py" in " ".join(first.cmdline())  # as ps shows it
        os.kill(trainers[1], signal.SIGKILL)
        dead = progress(1)["position"]
        wait_for(ended, 150, "the job's end")
        final = state()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    err = err_path.read_text()
    assert p.returncode == 0, err[-4000:]
    assert seen[0] == {trainers[0]}, seen  # trainer 0 never restarted
    assert len(seen[1] - {trainers[1]}) == 1, seen  # trainer 1 restarted once
    assert steps0 == sorted(steps0), steps0  # trainer 0's steps never went back
    assert final["state"] == "succeeded" and (final["attempt"], final["restarts"]) == (0, 1), final
    (line,) = final["recoveries"]
    assert "recovery 1 (attempt 0, in place): rank 1 signal SIGKILL" in line, line
    assert "restarted: trainer 1 only, resumed at its data position" in line, line
    assert "0 steps redone by the others" in line and "PS recoveries:" in err, err[-3000:]
    steps = LINES // (GLOBAL_BATCH // 2)
    p0, p1 = progress(0), progress(1)
    assert p0["attempt"] == p1["attempt"] == 0 and p0["resumed"] == {} and p0["step"] == steps, p0
    assert p1["resumed"]["alone"] and p1["resumed"]["position"]["step"] >= dead["step"] - 1, (
        p1,
        dead,
    )
    assert p1["step"] == steps, p1  # resumed at its position, trained the rest of its pass
    log1 = (log / "workerlog.1").read_text()
    assert "rank 1 restarted alone" in log1 and "restarted alone: resumes at pass 0" in log1
    assert any("replayed from the record" in ln for ln in log1.splitlines()), log1[-3000:]
    assert restarted, "the restarted trainer was not seen"
    assert (restarted["ppid"] == actor_pid) is (warm == "on"), (restarted, actor_pid)
    if warm == "on":  # both trainer 1 processes forked by its actor's warm process
        warm_log = (log / "warmlog.trainer1").read_text()
        for pid in (trainers[1], restarted["pid"]):
            assert f"forked {pid}:" in warm_log, warm_log
        assert (log / "warmlog.server0").exists()
        zygotes = [p.pid for p in psutil.process_iter() if _is_zygote(p, log)]
        wait_for(lambda: not live_pids(zygotes), 20, "the warm processes' exit")
    _assert_nothing_left(cluster, sorted(pids))
