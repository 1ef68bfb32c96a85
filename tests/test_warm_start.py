"""Warm starts (``--warm_start on``): workers forked from the job's warm process behave as fresh
ones: real fleetrun jobs, real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, live_pids, run_fleetrun, start_fleetrun, wait_gone, warm_processes_of

from launcher.warm import BOOTSTRAP, WarmPool, WarmStartError

PROBE = str(REPO / "tests" / "scripts" / "warm_probe.py")


def _probes(log_dir: Path, nproc: int) -> list[list[dict]]:
    """Per rank, the PROBE facts of each attempt (in order)."""
    out = []
    for rank in range(nproc):
        text = (log_dir / f"workerlog.{rank}").read_text()
        out.append(
            [json.loads(line[6:]) for line in text.splitlines() if line.startswith("PROBE ")]
        )
    return out


def _job(tmp: Path, name: str, warm: str, nproc: int, *extra: str, env: dict | None = None):
    log = tmp / name
    r = run_fleetrun(
        "--nproc_per_node", str(nproc), "--warm_start", warm, "--log_dir", str(log),
        *extra, PROBE, "--flag", "x",
        timeout=150, env=env or {},
    )  # fmt: skip
    return r, log


@pytest.mark.timeout(300)
def test_forked_workers_look_like_fresh_ones(tmp_path: Path) -> None:
    env = {"PROBE_ACTION": "collective", "PROBE_MARKER": "m1"}
    warm, warm_log = _job(tmp_path, "warm", "on", 2, env=env)
    cold, cold_log = _job(tmp_path, "cold", "off", 2, env=env)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert cold.returncode == 0, cold.stdout + cold.stderr
    assert (warm_log / "warmlog.0").exists() and not (cold_log / "warmlog.0").exists()
    w = [p[0] for p in _probes(warm_log, 2)]
    c = [p[0] for p in _probes(cold_log, 2)]
    for rank, (fw, fc) in enumerate(zip(w, c)):
        assert fw["rank"] == rank
        assert fw["forked"] and not fc["forked"]
        assert fw["sid"] == fw["pid"] == fw["pgid"]  # leads its own session, as a fresh one
        assert fw["ppid"] == w[0]["ppid"] != fw["pid"]  # the agent's child, as a fresh one
        keys = ("argv", "main_file", "name", "cwd", "marker", "threads", "sigint", "sigterm")
        assert fw["proc_environ_is_own"] and fc["proc_environ_is_own"]  # /proc/PID/environ
        for key in (*keys, "cmdline"):  # ps shows the same command line
            assert fw[key] == fc[key], key
        assert fw["argv"] == [PROBE, "--flag", "x"] and fw["name"] == "__main__"
        assert len(fw["fds"]) <= len(fc["fds"])  # nothing of the warm process leaks in
    # Python's, numpy's and torch's global generators are seeded from the OS in each process
    for key in ("random", "numpy", "torch_seed", "torch_draw"):
        assert w[0][key] != w[1][key] and c[0][key] != c[1][key], key
    assert "SUM 3.0" in (warm_log / "workerlog.0").read_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("action", "expect"),
    [
        ("exit:3", "exit code 3"),
        ("signal:SIGSEGV", "SIGSEGV"),
        ("raise", "RuntimeError: probe failed on purpose"),
    ],
)
def test_exits_signals_and_root_cause_as_fresh(tmp_path: Path, action: str, expect: str) -> None:
    r, log = _job(tmp_path, "warm", "on", 1, env={"PROBE_ACTION": action})
    assert r.returncode != 0
    text = r.stdout + r.stderr
    assert expect in text, text
    assert _probes(log, 1)[0][0]["forked"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("warm", ["on", "off"])
def test_the_exit_flushes_files_runs_atexit_and_joins_threads(tmp_path: Path, warm: str) -> None:
    """A forked worker ends without the interpreter's finalization; what that would do for the
    script still happens, as in a fresh worker: an open file flushed, atexit handlers and
    non-daemon threads run, ``sys.exit(message)`` prints it and exits 1."""
    path = tmp_path / "unclosed.txt"
    r, log = _job(tmp_path, warm, warm, 1, env={"PROBE_ACTION": f"leave_open:{path}"})
    text = (log / "workerlog.0").read_text()
    assert r.returncode != 0 and "exit code 1" in r.stdout + r.stderr, r.stdout + r.stderr
    assert path.read_text() == "written, never closed"
    assert "THREAD done" in text and "ATEXIT ran" in text and "bye from the probe" in text, text
    assert text.index("THREAD done") < text.index("ATEXIT ran"), text  # threads joined first
    assert _probes(log, 1)[0][0]["forked"] is (warm == "on")


@pytest.mark.timeout(300)
def test_restart_loop_keeps_the_warm_process_flat(tmp_path: Path) -> None:
    restarts = 20
    log, gate = tmp_path / "log", tmp_path / "settled"
    # every attempt exits 1 once the gate exists; the test opens it when the warm process has
    # done its later imports, so that the restarts are measured after them however slow the
    # imports are under load
    p = start_fleetrun(
        "--nproc_per_node", "1", "--warm_start", "on", "--max_restarts", str(restarts),
        "--log_dir", str(log), PROBE,
        env={"PROBE_ACTION": f"gate:{gate}:1"},
    )  # fmt: skip
    samples: dict[int, tuple[int, int]] = {}
    zygote, settled = None, None  # settled: the attempt by which its later imports were done
    deadline = time.monotonic() + 240
    while p.poll() is None and time.monotonic() < deadline:
        zygote = zygote or _zygote_of(p.pid)
        if zygote is not None:
            attempts = _count_probes(log)
            if settled is None and "imported ps_server.client" in _read(log / "warmlog.0"):
                settled = attempts + 1
                gate.touch()
            stats = _stats(zygote)
            if settled is not None and stats:  # per attempt, the floor of its samples
                old = samples.get(attempts, stats)
                samples[attempts] = (min(old[0], stats[0]), min(old[1], stats[1]))
        time.sleep(0.01)  # an attempt takes ~50 ms: several samples each, never in step
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1, out + err
    assert _count_probes(log) == restarts + 1
    assert all(f["forked"] for f in _probes(log, 1)[0])
    assert settled is not None and settled < restarts - 5, (settled, samples)
    early = [v for k, v in samples.items() if settled <= k <= settled + 2]
    late = [v for k, v in samples.items() if k >= restarts - 4]
    assert early and late, samples
    # the floor of the samples, taken while the warm process waits between requests: a leak
    # raises the floor
    rss_early, fds_early = min(v[0] for v in early), min(v[1] for v in early)
    rss_late, fds_late = max(v[0] for v in late), min(v[1] for v in late)
    assert fds_late <= fds_early, samples
    assert rss_late <= rss_early * 1.05 + 4096, samples  # kB; no growth per restart
    assert zygote is not None and wait_gone([zygote], 10) == []


def _zygote_of(agent: int) -> int | None:
    """The agent's warm process: its child with the warm process's command line that started
    first (a worker just forked shows that command line too until it writes its own)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == agent and b"collective.zygote" in cmd:
            found.append((int(stat[19]), int(pid)))  # starttime, pid
    return min(found)[1] if found else None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


IDLE_SYSCALLS = {"7", "23", "43", "232", "270", "271", "281", "288"}
"""x86_64 poll, select, accept, epoll_wait, pselect6, ppoll, epoll_pwait, accept4: the calls the
warm process waits in between requests (elsewhere it is serving one and holds its descriptors)."""


def _idle(pid: int) -> bool:
    try:
        call = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return bool(call) and call[0] in IDLE_SYSCALLS


def _stats(pid: int) -> tuple[int, int] | None:
    """RSS (kB) and open descriptors of the warm process, taken only while it waits between
    requests (a sample taken mid-request counts that request's socket and pipes; restarts in a
    tight loop kept it busy for every sample of some attempts)."""
    if not _idle(pid):
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    if not _idle(pid):
        return None
    rss = [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")]
    return (rss[0], fds) if rss else None  # none: a zombie


def _count_probes(log: Path) -> int:
    try:
        text = (log / "workerlog.0").read_text()
    except OSError:
        return 0
    return sum(1 for line in text.splitlines() if line.startswith("PROBE "))


@pytest.mark.timeout(300)
def test_a_killed_warm_process_leaves_the_job_running_and_restarts_fresh(tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    log = tmp_path / "log"
    p = start_fleetrun(
        "--nproc_per_node", "2", "--warm_start", "on", "--max_restarts", "1",
        "--log_dir", str(log), PROBE,
        env={"PROBE_ACTION": f"fail_first:4:{marker}"},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while _count_probes(log) < 1 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    zygote = _zygote_of(p.pid)
    assert zygote is not None
    os.kill(zygote, signal.SIGKILL)
    out, err = p.communicate(timeout=150)
    assert p.returncode == 0, out + err  # the running workers did not notice
    assert "warm start unavailable, starting workers afresh" in out + err
    first, second = _probes(log, 2)[0]
    assert first["forked"] and not second["forked"]
    assert wait_gone([zygote], 5) == []


@pytest.mark.timeout(120)
def test_a_warm_import_that_starts_a_thread_stops_the_forks(tmp_path: Path) -> None:
    """The warm process forks only while it is single-threaded: once a ``warm_imports`` module
    has started a thread, it refuses, and the agent starts the worker afresh."""
    (tmp_path / "threadmod.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    log = tmp_path / "warmlog.0"
    pool = WarmPool(env, str(log), ["threadmod"])
    try:
        deadline = time.monotonic() + 90
        while "imported threadmod" not in _read(log) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "imported threadmod" in _read(log), _read(log)
        argv = [sys.executable, *BOOTSTRAP, PROBE]
        assert pool.usable(argv)
        with pytest.raises(WarmStartError, match="started 1 thread"):
            pool.spawn(argv, env, str(tmp_path))
        assert pool.spawned == 0
    finally:
        pool.close()
    assert wait_gone([pool.pid], 10) == []


@pytest.mark.timeout(180)
def test_the_warm_process_serves_only_its_agent(tmp_path: Path) -> None:
    """Its socket is abstract (no file to leave behind, no file permissions): a request from
    any process but the agent is refused, and the agent is still served afterwards."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pool = WarmPool(env, str(tmp_path / "warmlog.0"), [])
    try:
        argv = [sys.executable, *BOOTSTRAP, PROBE]
        pool._wait_ready()
        other = subprocess.run(
            [sys.executable, "-c", (
                "import os, socket, sys\n"
                "from collective.zygote import recv_message, send_message\n"
                "r, w = os.pipe()\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                "s.connect('\\0' + sys.argv[1])\n"
                "send_message(s, {'argv': ['x.py'], 'env': {}, 'cwd': '/'}, [w])\n"
                "print(recv_message(s)[0])\n"
            ), pool.socket_name],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert "only the agent" in other.stdout, other.stdout + other.stderr
        child = pool.spawn(argv, env, str(tmp_path))
        assert child.wait(120) == 0 and pool.spawned == 1
    finally:
        pool.close()
    assert wait_gone([pool.pid], 10) == []


@pytest.mark.timeout(300)
def test_killing_fleetrun_leaves_no_orphans(tmp_path: Path) -> None:
    log = tmp_path / "log"
    p = start_fleetrun(
        "--nproc_per_node", "2", "--warm_start", "on", "--log_dir", str(log), PROBE,
        env={"PROBE_ACTION": "sleep:60"},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while _count_probes(log) < 1 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)
    zygote = _zygote_of(p.pid)
    workers = [f["pid"] for f in (x[0] for x in _probes(log, 2) if x)]
    assert zygote is not None and len(workers) == 2
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
    assert wait_gone([zygote, *workers], 15) == [], live_pids([zygote, *workers])


@pytest.mark.timeout(120)
def test_no_python_entries_start_as_before(tmp_path: Path) -> None:
    log = tmp_path / "log"
    r = run_fleetrun(
        "--nproc_per_node", "1", "--warm_start", "on", "--no_python", "--log_dir", str(log),
        "/bin/echo", "hello-fresh",
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hello-fresh" in (log / "workerlog.0").read_text()
    assert not (log / "warmlog.0").exists()


@pytest.mark.timeout(480)
def test_elastic_node_lost_resumes_from_forked_workers(tmp_path: Path) -> None:
    """Two elastic agents with warm starts; B is SIGKILLed; A re-forms alone and its worker of
    the new round is forked from A's warm process."""
    from test_elastic import Agent, assert_no_orphans, c10d_flags, steps_since, wait_for

    from collective.env import find_free_port

    ckpt, stop = tmp_path / "ckpt", tmp_path / "stop"
    ckpt.mkdir()
    args = [str(ckpt), "--steps", "4", "--step_time", "0.1", "--stop_file", str(stop)]
    flags = [*c10d_flags(find_free_port(), "warm-lost"), "--warm_start", "on"]
    agents: list = []
    try:
        agents.append(Agent(tmp_path, "a", flags, args))
        wait_for("the store", lambda: "hosts the store" in agents[0].output(), agents)
        agents.append(Agent(tmp_path, "b", flags, args))
        wait_for("steps at world 2", lambda: steps_since(ckpt, 0, 2), agents)
        zygote = _zygote_of(agents[0].proc.pid)
        assert zygote is not None
        agents[1].kill_with_workers()
        killed = time.time()
        wait_for("steps at world 1", lambda: steps_since(ckpt, killed, 1), agents[:1])
        # the warm process logs every worker it forks
        warm_log = "".join(p.read_text() for p in agents[0].log_dir.glob("warmlog.agent*"))
        forked = [pid for pid in agents[0].note_children() if f"forked {pid}:" in warm_log]
        assert forked, agents[0].output() + warm_log
        stop.write_text("")
        assert agents[0].wait(60) == 0, agents[0].output()
        assert "warm start unavailable" not in agents[0].output()
        assert list((agents[0].log_dir).glob("warmlog.agent*"))
        assert_no_orphans(agents)
    finally:
        for a in agents:
            a.stop()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("warm", ["on", "off"])
def test_data_parallel_parity_with_forked_and_fresh_workers(tmp_path: Path, warm: str) -> None:
    """fleet's DP check (DDP and gradient merge equal to single-process training) on two
    workers forked from the warm process, and on two started afresh."""
    from test_fleet_dp import FLEET_DP, _check_training, _records

    out, log = tmp_path / "out", tmp_path / "log"
    r = run_fleetrun(
        "--nproc_per_node", "2", "--warm_start", warm, "--log_dir", str(log),
        str(FLEET_DP), "--out", str(out),
        timeout=150,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert (log / "warmlog.0").exists() == (warm == "on")
    _check_training(_records(out, 2))


@pytest.mark.timeout(60)
def test_the_environment_area_is_rewritten_only_once_nothing_reads_it(tmp_path: Path) -> None:
    """``set_environ`` leaves the area alone while the C library's ``environ`` still points into
    it, and shows the new environment once ``os.environ`` was replaced (entries that do not
    fit are left out, never cut)."""
    code = (
        "import os, json\n"
        "from collective.zygote import set_environ\n"
        "first = set_environ({'A': '1'})\n"
        "size = len(open('/proc/self/environ', 'rb').read())\n"
        "env = {'A': '1', 'B': 'x' * (size - 4), 'C': '2'}\n"
        "os.environ.clear(); os.environ.update(env)\n"
        "second = set_environ(env)\n"
        "raw = open('/proc/self/environ', 'rb').read()\n"
        "print(json.dumps([first, second, len(raw) == size, raw.split(b'\\0\\0')[0].decode()]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "PAD": "p" * 200},
        timeout=50,
    )
    assert r.returncode == 0, r.stderr
    first, second, same_size, shown = json.loads(r.stdout)
    assert first is False and second is True and same_size
    assert shown.split("\0") == ["A=1", "C=2"]  # B does not fit: left out, C still shown


@pytest.mark.timeout(300)
def test_a_crowded_node_imports_everything_before_its_first_fork(tmp_path: Path) -> None:
    """More first workers than usable cores: the later imports come before the first fork (the
    workers' own imports of them would queue for the cores); otherwise after it."""
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for workers, before in ((cores + 1, True), (cores, False)):
        log = tmp_path / f"warmlog.{workers}"
        pool = WarmPool(env, str(log), ["json"], workers=workers)
        try:
            child = pool.spawn([sys.executable, *BOOTSTRAP, PROBE], env, str(tmp_path))
            assert child.wait(120) == 0
            ready = next(line for line in _read(log).splitlines() if line.startswith("ready"))
            assert ("torch._dynamo" in ready and "json" in ready) == before, ready
        finally:
            pool.close()
        assert wait_gone([pool.pid], 10) == []


@pytest.mark.timeout(120)
def test_a_launch_that_fails_before_its_workers_closes_the_early_warm_process(
    tmp_path: Path,
) -> None:
    """A one-node local job starts its warm process before the job is set up; when the set-up
    fails (a busy --master_port), that warm process goes with fleetrun."""
    import socket

    log = tmp_path / "log"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p = start_fleetrun(
            "--nproc_per_node", "2", "--log_dir", str(log), "--master_port", str(port), PROBE,
        )  # fmt: skip
        out, err = p.communicate(timeout=100)
    assert p.returncode != 0 and f"master port {port}" in err, err
    assert (log / "warmlog.0").exists()  # the warm process had started
    mark = f"--agent\0{p.pid}\0".encode()
    deadline = time.monotonic() + 10
    while True:
        left = warm_processes_of(mark)
        if not live_pids(left) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not live_pids(left)
