"""The Ray scheduler (``fleetrun --scheduler ray``) on a real local Ray cluster bound to 127.0.0.1.

One cluster per module (``ray start --head --block`` in its own temp dir, so other Ray users of
this machine never join it), shared by the job tests; one test lets fleetrun start (and stop)
its own local cluster. After every job: no process of the job is left, and no fleetrun actor or
placement group is alive on the cluster. Plus pure unit tests of the planning (no cluster).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SCRIPTS, base_env, live_pids, run_fleetrun, start_fleetrun, wait_for
from prometheus_client.parser import text_string_to_metric_families

from collective.env import find_free_port
from collective.errors import ConfigError
from launcher.attempt import SERVER, TRAINER
from launcher.schedulers.ray.actor import PollReply, ProcessActor, WarmRequest
from launcher.schedulers.ray.cluster import LOOPBACK_ENV, non_loopback_listeners
from launcher.schedulers.ray.plan import (
    AttemptPaths,
    Placed,
    make_proc_specs,
    make_slots,
    parse_memory,
)
from launcher.spec import build_spec

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

WORKER = str(SCRIPTS / "launcher_worker.py")
PS_WORKER = str(SCRIPTS / "launcher_ps_worker.py")
ALLREDUCE = str(SCRIPTS / "ray_allreduce.py")
STATE = str(SCRIPTS / "ray_cluster_state.py")
TELEMETRY_JOB = str(SCRIPTS / "telemetry_job.py")
SMALL = {"trainer": {"cpu": 0.5, "memory": "256Mi"}, "server": {"cpu": 0.5, "memory": "256Mi"}}


# -- planning, no cluster --------------------------------------------------------------------------
def test_parse_memory() -> None:
    assert parse_memory("2Gi", "m") == 2 * 2**30
    assert parse_memory("512Mi", "m") == 512 * 2**20
    assert parse_memory("1G", "m") == 10**9
    assert parse_memory("1048576", "m") == 2**20
    with pytest.raises(ConfigError, match="resources.trainer.memory"):
        parse_memory("lots", "resources.trainer.memory")


def _paths() -> AttemptPaths:
    return AttemptPaths("rid", 1, 2, "/logs", None)


def test_collective_env_from_placement_is_the_local_contract() -> None:
    spec = build_spec(
        {
            "entrypoint": {"script": "t.py"},
            "sizes": {"nnodes": 2, "nproc_per_node": 2},
            "scheduler": "ray",
            "resources": {"trainer": {"gpu": 1}},
        }
    )
    slots = make_slots(spec)
    assert [s.bundle for s in slots] == [{"CPU": 1.0, "memory": 2.0 * 2**30, "GPU": 1.0}] * 4
    # SPREAD-like placement: bundles alternate between nodes a and b
    nodes = [
        ("10.0.0.1", "a", ("0",)),
        ("10.0.0.2", "b", ("0",)),
        ("10.0.0.1", "a", ("1",)),
        ("10.0.0.2", "b", ("1",)),
    ]
    placed = [
        Placed(s, ip, nid, gpus, 7000 + i)
        for i, (s, (ip, nid, gpus)) in enumerate(zip(slots, nodes))
    ]
    procs, head = make_proc_specs(spec, placed, 29999, _paths())
    envs = [p.env for p in procs]
    # ranks are numbered node by node: bundle 0, 2 on node a = ranks 0, 1
    assert [e["RANK"] for e in envs] == ["0", "2", "1", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"} and {
        e["MASTER_PORT"] for e in envs
    } == {"29999"}
    assert (
        envs[0]["PADDLE_TRAINER_ENDPOINTS"]
        == "10.0.0.1:7000,10.0.0.1:7002,10.0.0.2:7001,10.0.0.2:7003"
    )
    assert envs[1]["POD_IP"] == "10.0.0.2" and envs[1]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert envs[0]["TORCHELASTIC_RESTART_COUNT"] == "1" and envs[0]["OMP_NUM_THREADS"] == "1"
    assert (
        procs[1].log_path == "/logs/workerlog.2"
        and procs[1].error_file == "/logs/errors/attempt1/error.2.json"
    )
    assert "master 10.0.0.1:29999" in head


def test_uneven_placement_gives_one_trainer_per_node() -> None:
    spec = build_spec({"entrypoint": {"script": "t.py"}, "sizes": {"nproc_per_node": 3}})
    slots = make_slots(spec)
    placed = [
        Placed(s, ip, ip, (), 7000 + i) for i, (s, ip) in enumerate(zip(slots, ["a", "a", "b"]))
    ]
    envs = [p.env for p in make_proc_specs(spec, placed, 1, _paths())[0]]
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "0", "1", "0"),
        ("1", "0", "1", "1"),
        ("2", "0", "1", "2"),
    ]


def test_ps_env_from_placement() -> None:
    spec = build_spec(
        {"entrypoint": {"script": "t.py"}, "sizes": {"server_num": 1, "worker_num": 2}}
    )
    slots = make_slots(spec)
    assert [s.role for s in slots] == [SERVER, TRAINER, TRAINER]
    placed = [Placed(s, "10.0.0.1", "a", (), 7000 + i) for i, s in enumerate(slots)]
    procs, _ = make_proc_specs(spec, placed, 0, _paths())
    server, t0, t1 = (p.env for p in procs)
    assert server["TRAINING_ROLE"] == "PSERVER" and server["PADDLE_PORT"] == "7000"
    assert t1["PADDLE_PSERVERS_IP_PORT_LIST"] == "10.0.0.1:7000" and t1["PADDLE_TRAINER_ID"] == "1"
    assert (t0["MASTER_ADDR"], t0["MASTER_PORT"], t1["LOCAL_RANK"]) == ("10.0.0.1", "7001", "1")
    assert procs[0].log_path == "/logs/serverlog.0"
    # a server's table threads: the CPUs of its bundle (at least 1), unless the job sets them
    assert server["FLEET_PS_TABLE_THREADS"] == str(max(1, int(slots[0].bundle["CPU"])))
    assert "FLEET_PS_TABLE_THREADS" not in t0
    spec = build_spec(
        {
            "entrypoint": {"script": "t.py"},
            "sizes": {"server_num": 1, "worker_num": 1},
            "resources": {"server": {"cpu": 3, "memory": "1Gi"}},
        }
    )
    placed = [Placed(s, "10.0.0.1", "a", (), 7000 + i) for i, s in enumerate(make_slots(spec))]
    assert make_proc_specs(spec, placed, 0, _paths())[0][0].env["FLEET_PS_TABLE_THREADS"] == "3"
    spec = build_spec(
        {
            "entrypoint": {"script": "t.py"},
            "sizes": {"server_num": 1, "worker_num": 1},
            "env": {"FLEET_PS_TABLE_THREADS": "5"},
        }
    )
    placed = [Placed(s, "10.0.0.1", "a", (), 7000 + i) for i, s in enumerate(make_slots(spec))]
    assert make_proc_specs(spec, placed, 0, _paths())[0][0].env["FLEET_PS_TABLE_THREADS"] == "5"


def test_static_ps_lists_are_refused_on_ray() -> None:
    spec = build_spec(
        {
            "entrypoint": {"script": "t.py"},
            "mode": "ps",
            "ps": {"servers": "1.2.3.4:1", "workers": "1.2.3.4:2"},
        }
    )
    with pytest.raises(ConfigError, match="ps.servers"):
        make_slots(spec)


def _poll_to_exit(actor: ProcessActor, timeout_s: float) -> tuple[bytes, PollReply | None]:
    """The actor's child's output and its last poll reply, once it exited (or at the timeout)."""
    output, reply = b"", None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = actor.poll(1.0)
        output += reply.output
        if reply.returncode is not None:
            break
    return output, reply


@pytest.mark.timeout(60)
def test_process_actor_streams_output_and_error_file_without_ray(tmp_path: Path) -> None:
    """The actor class itself (no cluster): child output by long poll, exit, the error file."""
    script = tmp_path / "boom.py"
    script.write_text("print('hello', flush=True)\nraise KeyError('boom')\n")
    err_file = tmp_path / "errors" / "error.0.json"
    actor = ProcessActor()
    argv = [sys.executable, "-u", "-m", "collective.bootstrap", str(script)]
    pid = actor.start(
        argv,
        {"FLEET_ERROR_FILE": str(err_file), "PYTHONPATH": str(REPO)},
        str(tmp_path),
        sys.executable,
    )
    output, reply = _poll_to_exit(actor, 30)
    assert reply is not None and reply.returncode == 1 and reply.pid == pid
    assert b"hello\n" in output and reply.exit_desc == "exit code 1"
    assert reply.error_text is not None and "KeyError" in reply.error_text
    actor.stop(1.0)
    assert live_pids([pid]) == []


@pytest.mark.timeout(120)
def test_process_actor_restarts_its_child_from_its_warm_process(tmp_path: Path) -> None:
    """The actor class itself (no cluster), warm starts on: the first child and the child
    restarted in the same actor are forked from the actor's one warm process, children of the
    actor's process; the warm process goes with the actor (here: its close)."""
    script = tmp_path / "who.py"
    script.write_text("import os, sys\nprint('CMD', sys.orig_argv[3], os.getppid(), flush=True)\n")
    actor = ProcessActor()
    argv = [sys.executable, "-u", "-m", "collective.bootstrap", str(script)]
    warm = WarmRequest(str(tmp_path / "warmlog.trainer0"), ("json",))
    seen = []
    for _ in range(2):
        pid = actor.start(argv, {"PYTHONPATH": str(REPO)}, str(tmp_path), sys.executable, warm)
        output, reply = _poll_to_exit(actor, 90)
        assert reply is not None and reply.returncode == 0, output
        seen.append((pid, output.decode()))
    assert seen[0][0] != seen[1][0]
    for _, text in seen:
        assert f"CMD collective.zygote {os.getpid()}" in text, text
    assert "ready in" in (tmp_path / "warmlog.trainer0").read_text()
    zygote = actor._warm
    assert zygote is not None and zygote.spawned == 2
    zygote.close()
    assert live_pids([zygote.pid]) == []


# -- a real cluster --------------------------------------------------------------------------------
def _ray_env() -> dict[str, str]:
    return {**base_env(), **LOOPBACK_ENV}


def _tree(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """``ray start --head --block`` on 127.0.0.1 (4 logical CPUs); yields its address."""
    temp = tempfile.mkdtemp(prefix="frt-")  # short: Ray's unix socket paths must fit 107 bytes
    port = find_free_port()
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    log = open(os.path.join(temp, "head.log"), "wb")  # noqa: SIM115
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "4",
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
            "--temp-dir",
            temp,
        ],
        env=_ray_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert head.poll() is None, Path(temp, "head.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "ray head did not come up in 90 s"
                time.sleep(0.5)
        yield address
    finally:
        head.send_signal(signal.SIGTERM)  # ray start --block stops its cluster on SIGTERM
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _job(tmp: Path, address: str | None, script: str, args: list[str], **extra: object) -> Path:
    data: dict[str, object] = {
        "name": "raytest",
        "scheduler": "ray",
        "entrypoint": {"script": script, "args": args},
        "log_dir": str(tmp / "log"),
        "resources": SMALL,
        "tee": "all",
        "grace_period_s": 2.0,
        "ray": {"placement_timeout_s": 60, **({"address": address} if address else {})},
        **extra,
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _records(out: Path) -> dict[str, dict]:
    return {f.stem: json.loads(f.read_text()) for f in out.glob("*.json")}


def _job_state(tmp: Path) -> dict:
    return json.loads((tmp / "log" / "job_state.json").read_text())


def _scrape(endpoint: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)] from http://ENDPOINT/metrics."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    )


def _assert_nothing_left(address: str, pids: list[int]) -> None:
    """No job process alive; no fleetrun actor or placement group alive on the cluster."""
    deadline = time.monotonic() + 20
    while live_pids(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_pids(pids), f"orphans: {live_pids(pids)}"
    r = subprocess.run(
        [sys.executable, STATE, address],
        capture_output=True,
        text=True,
        timeout=90,
        env=_ray_env(),
        check=False,
    )
    assert r.returncode == 0, r.stderr
    state = json.loads(r.stdout.strip().splitlines()[-1])
    assert state == {"actors": [], "placement_groups": []}, state


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_collective_job_env_logs_and_cleanup(cluster: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = _job(tmp_path, cluster, ALLREDUCE, ["--out", str(out)], sizes={"nproc_per_node": 2})
    r = run_fleetrun("-c", str(job), timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = _records(out)
    assert sorted(recs) == ["rank0.attempt0", "rank1.attempt0"]
    for rank in (0, 1):
        rec = recs[f"rank{rank}.attempt0"]
        assert rec["sum"] == 3.0 and rec["world"] == 2
        env = rec["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["FLEET_ERROR_FILE"].endswith(f"errors/attempt0/error.{rank}.json")
        assert f"[rank {rank}] rank {rank} of 2: all_reduce sum 3" in r.stdout
        log = (tmp_path / "log" / f"workerlog.{rank}").read_text()
        assert "ray node 127.0.0.1" in log and f"rank {rank} of 2: all_reduce sum 3" in log
    assert "trainer 1 127.0.0.1:" in (tmp_path / "log" / "endpoints.log").read_text()
    _assert_nothing_left(cluster, [rec["pid"] for rec in recs.values()])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ps_job(cluster: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = _job(
        tmp_path,
        cluster,
        PS_WORKER,
        ["--out", str(out)],
        mode="ps",
        sizes={"server_num": 1, "worker_num": 2},
        metrics=False,
    )
    r = run_fleetrun("-c", str(job), timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = _records(out)
    assert {"server0"} <= set(recs), sorted(recs)
    # metrics: false → no endpoints, no targets file; job_state.json is still written
    assert all("FLEET_METRICS_PORT" not in rec["env"] for rec in recs.values())
    assert not (tmp_path / "log" / "metrics_targets.json").exists()
    state = _job_state(tmp_path)
    assert state["state"] == "succeeded" and state["launcher_metrics"] is None
    assert sorted((p["role"], p["rank"], p["metrics"]) for p in state["processes"]) == [
        ("server", 0, None),
        ("trainer", 0, None),
        ("trainer", 1, None),
    ]
    assert recs["server0"]["env"]["TRAINING_ROLE"] == "PSERVER"
    assert "[server 0] server 0 serving on 127.0.0.1:" in r.stdout
    assert (tmp_path / "log" / "serverlog.0").exists() and (
        tmp_path / "log" / "workerlog.1"
    ).exists()
    _assert_nothing_left(cluster, [rec["pid"] for rec in recs.values()])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_metrics_endpoints_and_job_state(cluster: str, tmp_path: Path) -> None:
    """Every trainer serves /metrics on its node's IP (the actor's pick), job_state.json and
    metrics_targets.json list them, the driver serves fleet_launcher_*; all while it runs."""
    log, release = tmp_path / "log", tmp_path / "release"
    job = _job(
        tmp_path,
        cluster,
        TELEMETRY_JOB,
        ["--steps", "10", "--hold_file", str(release)],
        sizes={"nproc_per_node": 2},
        name="raymetrics",
    )
    p = start_fleetrun("-c", str(job))
    try:
        state = wait_for(
            lambda: (
                (s := _job_state(tmp_path))["state"] == "running" and len(s["processes"]) == 2 and s
            ),
            150,
            "a running job_state.json",
        )
        assert isinstance(state, dict)
        procs = {q["rank"]: q for q in state["processes"]}
        assert sorted(procs) == [0, 1] and {q["role"] for q in procs.values()} == {"trainer"}
        targets = json.loads((log / "metrics_targets.json").read_text())
        by_role = {(g["labels"]["role"], g["labels"]["rank"]): g["targets"][0] for g in targets}
        assert set(by_role) == {("launcher", "0"), ("trainer", "0"), ("trainer", "1")}
        for rank, q in procs.items():
            assert q["state"] == "up" and q["host"] == "127.0.0.1" and q["pid"]
            assert (
                q["metrics"].startswith("127.0.0.1:")
                and by_role[("trainer", str(rank))] == q["metrics"]
            )
            assert q["log"] == str(log / f"workerlog.{rank}")
            wait_for(
                lambda ep=q["metrics"]: _value(_scrape(ep), "fleet_trainer_steps_total") >= 10,
                120,
                f"10 steps at {q['metrics']}",
            )
            assert _value(_scrape(q["metrics"]), "fleet_trainer_samples_total") == 10 * 32
        launcher = _scrape(state["launcher_metrics"])
        assert state["launcher_metrics"].startswith("127.0.0.1:")
        assert _value(launcher, "fleet_launcher_job_state", state="running") == 1
        assert _value(launcher, "fleet_launcher_processes_up", role="trainer") == 2
        release.touch()
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, err
    state = _job_state(tmp_path)
    assert state["state"] == "succeeded" and state["failure_summary"] is None
    assert {(q["state"], q["exit_code"]) for q in state["processes"]} == {("exited", 0)}
    _assert_nothing_left(cluster, [q["pid"] for q in state["processes"]])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_failing_rank_prints_root_cause_summary(cluster: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = _job(
        tmp_path,
        cluster,
        WORKER,
        ["--out", str(out), "--fail_ranks", "1", "--hang"],
        sizes={"nproc_per_node": 2},
    )
    r = run_fleetrun("-c", str(job), timeout=200)
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr
    assert "job 'raytest' FAILED" in err and "Root cause (first observed failure):" in err
    assert "trainer  : rank 1" in err and "exit     : exit code 1" in err
    assert "error    : ValueError: injected failure on rank 1" in err
    assert "traceback (last" in err and "raise ValueError" in err
    assert "Stopped by fleetrun after the root cause: rank 0" in err
    state = _job_state(tmp_path)  # the watcher's view, as the local scheduler writes it
    assert state["state"] == "failed" and "Root cause" in state["failure_summary"]
    assert "injected failure on rank 1" in state["failure_summary"]
    procs = {p["rank"]: p for p in state["processes"]}
    assert (procs[1]["state"], procs[1]["exit_code"], procs[1]["signal"]) == ("failed", 1, None)
    assert procs[0]["state"] == "exited"  # stopped by fleetrun's teardown, not a failure
    assert {p["host"] for p in procs.values()} == {"127.0.0.1"}
    recs = _records(out)
    _assert_nothing_left(cluster, [rec["pid"] for rec in recs.values()])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restart_succeeds_on_second_attempt(cluster: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = _job(
        tmp_path,
        cluster,
        WORKER,
        ["--out", str(out), "--fail_ranks", "0", "--fail_attempts", "1"],
        sizes={"nproc_per_node": 2},
        max_restarts=1,
    )
    r = run_fleetrun("-c", str(job), timeout=260)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = _records(out)
    assert {"rank0.attempt0", "rank0.attempt1", "rank1.attempt1"} <= set(recs), sorted(recs)
    assert recs["rank1.attempt1"]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert "restarting the whole group (restart 1 of 1)" in r.stderr
    state = _job_state(tmp_path)
    assert (state["state"], state["attempt"], state["restarts"], state["max_restarts"]) == (
        "succeeded",
        1,
        1,
        1,
    )
    assert {(p["state"], p["exit_code"]) for p in state["processes"]} == {("exited", 0)}
    log0 = (tmp_path / "log" / "workerlog.0").read_text()
    assert "attempt 0, rank 0" in log0 and "attempt 1, rank 0" in log0
    _assert_nothing_left(cluster, [rec["pid"] for rec in recs.values()])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_removes_actors_and_processes(cluster: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = _job(
        tmp_path,
        cluster,
        WORKER,
        ["--out", str(out), "--hang", "--grandchild"],
        sizes={"nproc_per_node": 2},
    )
    p = start_fleetrun("-c", str(job))
    try:
        deadline = time.monotonic() + 150
        while len(list(out.glob("*.json"))) < 2:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.3)
        recs = _records(out)
        pids = [rec["pid"] for rec in recs.values()] + [rec["grandchild"] for rec in recs.values()]
        assert len(live_pids(pids)) == 4
        os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "stopped every actor and process" in err
    _assert_nothing_left(cluster, pids)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_unplaceable_bundles_give_a_clear_error(cluster: str, tmp_path: Path) -> None:
    job = _job(
        tmp_path,
        cluster,
        WORKER,
        ["--out", str(tmp_path / "out")],
        sizes={"nproc_per_node": 2},
        resources={"trainer": {"cpu": 64, "memory": "256Mi"}},
    )
    data = yaml.safe_load(job.read_text())
    data["ray"]["placement_timeout_s"] = 3
    job.write_text(yaml.safe_dump(data))
    r = run_fleetrun("-c", str(job), timeout=150)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "could not place the job's 2 bundles (each CPU 64, memory 256Mi" in r.stderr, r.stderr
    assert "available: CPU 4" in r.stderr and "Lower resources.trainer/server" in r.stderr
    _assert_nothing_left(cluster, [])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_of_fleetrun_leaves_nothing(cluster: str, tmp_path: Path) -> None:
    """fleetrun killed without a chance to clean up: Ray's owner fate-sharing kills the actors and
    removes the placement group; the actors' children die with them (PR_SET_PDEATHSIG)."""
    out = tmp_path / "out"
    job = _job(
        tmp_path, cluster, WORKER, ["--out", str(out), "--hang"], sizes={"nproc_per_node": 2}
    )
    p = start_fleetrun("-c", str(job))
    try:
        deadline = time.monotonic() + 150
        while len(list(out.glob("*.json"))) < 2:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.3)
        os.kill(p.pid, signal.SIGKILL)
        p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    _assert_nothing_left(cluster, [rec["pid"] for rec in _records(out).values()])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dead_actor_fails_the_job(cluster: str, tmp_path: Path) -> None:
    """SIGKILL of rank 1's actor (as when its node dies): the job is torn down with a summary."""
    out = tmp_path / "out"
    job = _job(
        tmp_path, cluster, WORKER, ["--out", str(out), "--hang"], sizes={"nproc_per_node": 2}
    )
    p = start_fleetrun("-c", str(job))
    try:
        deadline = time.monotonic() + 150
        while len(list(out.glob("*.json"))) < 2:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.3)
        recs = _records(out)
        actor = psutil.Process(recs["rank1.attempt0"]["pid"]).parent()
        assert actor is not None and "ProcessActor" in " ".join(actor.cmdline()), actor
        actor.kill()
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 1, err
    assert "trainer  : rank 1" in err and "Ray actor died" in err, err
    state = _job_state(tmp_path)
    rank1 = next(q for q in state["processes"] if q["rank"] == 1)
    assert state["state"] == "failed" and "Ray actor died" in state["failure_summary"]
    assert (rank1["state"], rank1["exit_code"], rank1["signal"]) == ("failed", None, None)
    assert "Stopped by fleetrun after the root cause: rank 0" in err
    _assert_nothing_left(cluster, [rec["pid"] for rec in recs.values()])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_local_cluster_listens_on_loopback_only_and_goes_away(tmp_path: Path) -> None:
    """No ray.address: fleetrun starts a local cluster; every listener of it is on 127.0.0.1;
    Ctrl-C stops the job and the cluster (no process of fleetrun's tree left)."""
    out = tmp_path / "out"
    job = _job(tmp_path, None, WORKER, ["--out", str(out), "--hang"], sizes={"nproc_per_node": 2})
    p = start_fleetrun("-c", str(job), env={"RAY_ADDRESS": ""})
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 150
        while len(list(out.glob("*.json"))) < 2:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.3)
        tree = _tree(p.pid)
        names = {psutil.Process(pid).name() for pid in live_pids(tree)}
        assert any("raylet" in n for n in names) and any("gcs_server" in n for n in names), names
        assert non_loopback_listeners(tree) == []
        os.kill(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 128 + signal.SIGINT, err
    pids = tree + [rec["pid"] for rec in _records(out).values()]
    deadline = time.monotonic() + 30
    while live_pids(pids) and time.monotonic() < deadline:
        time.sleep(0.3)
    left = [(pid, psutil.Process(pid).name()) for pid in live_pids(pids)]
    assert not left, f"left behind: {left}"


@pytest.mark.timeout(120)
def test_shared_cluster_listens_on_loopback_only(cluster: str) -> None:
    heads = [
        c
        for c in psutil.process_iter(["cmdline"])
        if cluster.split(":")[1] in " ".join(c.info["cmdline"] or [])
        and "--block" in (c.info["cmdline"] or [])
    ]
    assert heads, "head process not found"
    assert non_loopback_listeners(_tree(heads[0].pid)) == []


def test_repo_configs_for_ray_exist() -> None:
    for name in ("dp_ray.yaml", "ctr_ps_ray.yaml"):
        spec = build_spec(yaml.safe_load((REPO / "configs" / name).read_text()))
        assert str(spec.scheduler) == "ray"
