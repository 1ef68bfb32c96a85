"""Elastic jobs with real processes: fleetrun agents on 127.0.0.1 meeting through torch's c10d
rendezvous (one agent hosts the store) or a real etcd (scripts/etcd.sh).

Each agent runs one worker of tests/scripts/elastic_train.py, which checkpoints with torch.save
and logs every step (world size, restart count) to progress.jsonl. The tests wait on that file
(bounded), never on time: they kill an agent and its worker, start another, and read what the
job did. No timing asserts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from conftest import REPO, SCRIPTS, base_env, fleetrun_cmd

from collective.env import find_free_port

WORKER = str(SCRIPTS / "elastic_train.py")
FAST = (
    "last_call_timeout=1"  # the other keys: our defaults (launcher.elastic.config.FAST_RDZV_CONF)
)


class Agent:
    """One fleetrun process (its own session), output in a file; the pids it ever had below it."""

    def __init__(self, tmp: Path, name: str, flags: list[str], script_args: list[str]) -> None:
        self.name, self.log_dir = name, tmp / name
        self.out_path = tmp / f"{name}.out"
        self._out = open(self.out_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            fleetrun_cmd(
                "--log_dir", str(self.log_dir), "--no_metrics", *flags, WORKER, *script_args
            ),
            cwd=str(REPO),
            env=base_env(),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.pids = {self.proc.pid}

    def note_children(self) -> list[int]:
        try:
            kids = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            kids = []
        self.pids.update(kids)
        return kids

    def kill_with_workers(self) -> None:
        """SIGKILL the agent and every process below it (a node lost)."""
        kids = self.note_children()
        self.proc.kill()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {self.name} still runs after {timeout} s:\n{self.output()}"
            ) from None

    def output(self) -> str:
        self._out.flush()
        return self.out_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.note_children()
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._out.close()


def records(ckpt: Path) -> list[dict]:
    path = ckpt / "progress.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(
    what: str, cond: Callable[[], bool], agents: list[Agent], timeout: float = 150.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for a in agents:
            a.note_children()
        if cond():
            return
        dead = [a for a in agents if a.proc.poll() is not None]
        if dead:
            raise AssertionError(
                f"agent {dead[0].name} exited {dead[0].proc.returncode} while waiting "
                f"for {what}:\n{dead[0].output()}"
            )
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout} s:\n" + "\n".join(a.output() for a in agents))


def steps_since(ckpt: Path, t0: float, world: int) -> bool:
    return any(
        r["event"] == "step" and r["world"] == world and r["time"] > t0 for r in records(ckpt)
    )


def check_continuous(recs: list[dict], total_min: int) -> None:
    """Every (re)start resumes at a step already reached (from the checkpoint), then steps go on
    one by one: no step is skipped, the job reaches ``total_min``."""
    reached = 0
    expected = None
    for r in recs:
        if r["event"] == "start":
            assert r["step"] <= reached, f"resumed at step {r['step']} but only {reached} were done"
            expected = r["step"] + 1
        else:
            assert r["step"] == expected, f"step {r['step']} after {expected - 1}: {recs}"
            expected += 1
            reached = max(reached, r["step"])
    assert reached >= total_min


def assert_no_orphans(agents: list[Agent]) -> None:
    deadline = time.monotonic() + 10
    alive: list[int] = []
    while time.monotonic() < deadline:
        alive = [
            p
            for a in agents
            for p in a.pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes left behind: {alive}")


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    try:
        yield started
    finally:
        for a in started:
            a.stop()


def c10d_flags(port: int, run_id: str, nnodes: str = "1:2", conf: str = FAST) -> list[str]:
    return [
        "--nnodes",
        nnodes,
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        run_id,
        "--rdzv_conf",
        conf,
        "--max_restarts",
        "3",
        "--rdzv_timeout",
        "90",
    ]


def _lose_b(
    tmp_path: Path, agents: list[Agent], run_id: str, steps: int, conf: str
) -> tuple[Path, Path, list[str], list[str], float]:
    """Agents A and B train at world 2; B (agent + worker) is SIGKILLed; A steps at world 1
    again. The checkpoint dir, the stop file, the agents' flags and script args, the kill time."""
    ckpt, stop = tmp_path / "ckpt", tmp_path / "stop"
    ckpt.mkdir()
    args = [str(ckpt), "--steps", str(steps), "--step_time", "0.1", "--stop_file", str(stop)]
    flags = c10d_flags(find_free_port(), run_id, conf=conf)
    agents.append(Agent(tmp_path, "a", flags, args))
    wait_for("the store", lambda: "hosts the store" in agents[0].output(), agents)
    agents.append(Agent(tmp_path, "b", flags, args))
    wait_for("steps at world 2", lambda: steps_since(ckpt, 0, 2), agents)
    agents[1].kill_with_workers()
    killed = time.time()
    wait_for("steps at world 1 after the kill", lambda: steps_since(ckpt, killed, 1), agents[:1])
    return ckpt, stop, flags, args, killed


@pytest.mark.timeout(480)
def test_c10d_node_lost_then_node_joins(tmp_path: Path, agents: list[Agent]) -> None:
    """A and B train at world 2; B (agent + worker) is SIGKILLed: A re-forms alone and resumes
    from the checkpoint; C starts: it is admitted and the world grows back to 2; exit 0."""
    ckpt, stop, flags, args, killed = _lose_b(tmp_path, agents, "lost-join", 6, FAST)
    live = [agents[0]]
    agents.append(Agent(tmp_path, "c", flags, args))
    joined = time.time()
    live.append(agents[2])
    wait_for("steps at world 2 after C joined", lambda: steps_since(ckpt, joined, 2), live)
    stop.write_text("")
    assert agents[0].wait(60) == 0, agents[0].output()
    assert agents[2].wait(60) == 0, agents[2].output()
    recs = records(ckpt)
    check_continuous(recs, 6)
    starts = [r for r in recs if r["event"] == "start"]
    shrink = next(s for s in starts if s["world"] == 1 and s["time"] > killed)
    grow = next(s for s in starts if s["world"] == 2 and s["time"] > joined)
    assert shrink["restart"] >= 1 and shrink["env"]["TORCHELASTIC_RESTART_COUNT"] == str(
        shrink["restart"]
    )
    assert grow["restart"] == shrink["restart"], "a join spent a restart"
    for s in starts:
        env = s["env"]
        assert env["TORCHELASTIC_RUN_ID"] == "lost-join" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert (
            env["WORLD_SIZE"]
            == env["PADDLE_TRAINERS_NUM"]
            == env["GROUP_WORLD_SIZE"]
            == str(s["world"])
        )
        assert env["LOCAL_WORLD_SIZE"] == "1" and env["RANK"] == env["PADDLE_TRAINER_ID"] == "0"
        assert len(env["PADDLE_TRAINER_ENDPOINTS"].split(",")) == s["world"]
    out = agents[0].output()
    assert "(failure): left" in out and "world 2 -> 1" in out, out
    assert "(join): joined" in out and "world 1 -> 2" in out, out
    state = json.loads((agents[0].log_dir / "job_state.json").read_text())
    assert state["state"] == "succeeded" and len(state["membership_changes"]) >= 2
    assert_no_orphans(agents)


HOUR_WINDOW = "last_call_timeout=1,keep_alive_interval=720,keep_alive_max_attempt=5"
"""A heartbeat window of an hour: a survivor that resumes inside the test's timeout did not wait
for the dead node's heartbeats to lapse."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_c10d_dead_agent_dropped_before_its_heartbeat_window(
    tmp_path: Path, agents: list[Agent]
) -> None:
    """B (agent + worker) is SIGKILLed: A finds B's liveness port refused, drops B from torch's
    rendezvous state and resumes at world 1 -- inside B's heartbeat window (an hour)."""
    ckpt, stop, _, _, killed = _lose_b(tmp_path, agents, "liveness", 4, HOUR_WINDOW)
    resumed = min(
        r["time"]
        for r in records(ckpt)
        if r["event"] == "step" and r["world"] == 1 and r["time"] > killed
    )
    assert resumed < killed + 3600
    stop.write_text("")
    assert agents[0].wait(60) == 0, agents[0].output()
    out = agents[0].output()
    gone = out.index(f"node(s) {socket.gethostname()}/{agents[1].proc.pid} gone")
    assert "dropped from the rendezvous without waiting" in out[gone:], out
    assert gone < out.index("(failure): left") < out.index("succeeded"), out
    check_continuous(records(ckpt), 4)
    assert_no_orphans(agents)


@pytest.mark.timeout(300)
def test_c10d_store_host_lost_is_named(tmp_path: Path, agents: list[Agent]) -> None:
    """The agent hosting the c10d store dies: the other stops its workers and fails naming the
    lost store and its host (torch's c10d store lives in that agent)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    port = find_free_port()
    args = [str(ckpt), "--steps", "100000", "--step_time", "0.1"]
    flags = c10d_flags(port, "store-lost", "2:2")
    agents.append(Agent(tmp_path, "host", flags, args))
    wait_for("the store", lambda: "hosts the store" in agents[0].output(), agents)
    agents.append(Agent(tmp_path, "other", flags, args))
    wait_for("steps at world 2", lambda: steps_since(ckpt, 0, 2), agents)
    host_pid = agents[0].proc.pid
    agents[0].kill_with_workers()
    code = agents[1].wait(90)
    out = agents[1].output()
    assert code == 1, out
    assert f"lost the c10d rendezvous store at 127.0.0.1:{port}" in out, out
    assert f"/{host_pid}" in out and "--rdzv_backend etcd" in out, out
    assert_no_orphans(agents)


# -- etcd ------------------------------------------------------------------------------------------
@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    """A private etcd from scripts/etcd.sh (free port, its own data dir), stopped after."""
    if not shutil.which("etcd") and not os.path.exists("/usr/bin/etcd"):
        can_sudo = os.geteuid() == 0 or shutil.which("sudo")
        if not can_sudo:
            pytest.skip(
                "etcd is not installed and apt-get cannot install it here (no root, no sudo)"
            )
    data = tmp_path / "etcd"
    proc = subprocess.Popen(
        ["bash", str(REPO / "scripts" / "etcd.sh"), str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        endpoint = ""
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded: the script prints two lines then execs etcd
            if line.startswith("ETCD_ENDPOINT="):
                endpoint = line.strip().split("=", 1)[1]
                break
        if not endpoint:
            pytest.skip("scripts/etcd.sh could not install or start etcd (apt-get failed?)")
        deadline = time.monotonic() + 30
        import urllib.request

        while True:
            try:
                with urllib.request.urlopen(f"http://{endpoint}/v2/keys/", timeout=1) as r:
                    r.read()
                break
            except OSError:
                assert time.monotonic() < deadline, "etcd did not answer its v2 API within 30 s"
                time.sleep(0.2)
        yield endpoint
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.timeout(480)
def test_etcd_node_lost_with_paddle_and_torchrun_spellings(
    tmp_path: Path, agents: list[Agent], etcd: str
) -> None:
    """etcd rendezvous against a real etcd: one agent started with Paddle's flags
    (--elastic_server etcd://, --job_id, --np), one with torchrun's; the second is SIGKILLed and
    the first goes on alone from the checkpoint; a third joins and the world grows back to 2.
    Workers start afresh (``--warm_start off``)."""
    pytest.importorskip(
        "etcd", reason="python-etcd (the v2 client torch's etcd handler uses) is missing"
    )
    ckpt, stop = tmp_path / "ckpt", tmp_path / "stop"
    ckpt.mkdir()
    args = [str(ckpt), "--steps", "6", "--step_time", "0.1", "--stop_file", str(stop)]
    common = ["--max_restarts", "3", "--rdzv_timeout", "90", "--rdzv_conf", "last_call_timeout=1"]
    common += ["--warm_start", "off"]  # the c10d tests run with warm starts (the default)
    paddle = ["--elastic_server", f"etcd://{etcd}", "--job_id", "etcd-job", "--np", "1:2", *common]
    torchrun = [
        "--nnodes",
        "1:2",
        "--rdzv_backend",
        "etcd",
        "--rdzv_endpoint",
        etcd,
        "--rdzv_id",
        "etcd-job",
        *common,
    ]
    agents.append(Agent(tmp_path, "paddle", paddle, args))
    agents.append(Agent(tmp_path, "torchrun", torchrun, args))
    wait_for("steps at world 2", lambda: steps_since(ckpt, 0, 2), agents, timeout=150)
    agents[1].kill_with_workers()
    killed = time.time()
    wait_for("steps at world 1 after the kill", lambda: steps_since(ckpt, killed, 1), agents[:1])
    # a third agent joins: the running one leaves its round at once (deletes its etcd lease,
    # launcher.elastic.rdzv.leave_round) and the world grows back to 2
    agents.append(Agent(tmp_path, "joiner", torchrun, args))
    joined = time.time()
    wait_for(
        "steps at world 2 after the join",
        lambda: steps_since(ckpt, joined, 2),
        [agents[0], agents[2]],
    )
    stop.write_text("")
    assert agents[0].wait(60) == 0, agents[0].output()
    assert agents[2].wait(60) == 0, agents[2].output()
    recs = records(ckpt)
    check_continuous(recs, 6)
    out = agents[0].output()
    assert "(failure): left" in out and "(join): joined" in out, out
    assert_no_orphans(agents)
    # etcd-v2 (torch's dynamic rendezvous with its state in etcd), one agent, on the same etcd
    v2 = tmp_path / "v2"
    v2.mkdir()
    agents.append(
        Agent(
            tmp_path,
            "v2",
            [
                "--nnodes",
                "1:2",
                "--rdzv_backend",
                "etcd-v2",
                "--rdzv_endpoint",
                etcd,
                "--rdzv_id",
                "v2-job",
                *common,
            ],
            [str(v2), "--steps", "3", "--step_time", "0.05"],
        )
    )
    assert agents[-1].wait(120) == 0, agents[-1].output()
    assert [r["step"] for r in records(v2) if r["event"] == "step"] == [1, 2, 3]


# -- bad input that needs a process ---------------------------------------------------------------
@pytest.mark.timeout(60)
def test_unreachable_endpoint_is_named_within_rdzv_timeout(tmp_path: Path) -> None:
    port = find_free_port()
    out = subprocess.run(
        fleetrun_cmd(
            "--log_dir",
            str(tmp_path / "log"),
            "--nnodes",
            "1:2",
            "--rdzv_backend",
            "etcd",
            "--rdzv_endpoint",
            f"127.0.0.1:{port}",
            "--rdzv_timeout",
            "2",
            WORKER,
            str(tmp_path),
        ),
        cwd=str(REPO),
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 1, out.stderr
    assert f"cannot reach the rendezvous endpoint 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "--rdzv_endpoint" in out.stderr and "within 2 s (--rdzv_timeout)" in out.stderr


@pytest.mark.timeout(180)
def test_second_job_reusing_rdzv_id_is_refused(tmp_path: Path, agents: list[Agent]) -> None:
    """Job X waits for a second node (2:2); an agent of another job (other arguments) with the
    same --rdzv_id is refused before it joins, naming --rdzv_id; X is not disturbed."""
    port = find_free_port()
    flags = c10d_flags(port, "shared-id", "2:2")
    agents.append(Agent(tmp_path, "x", flags, [str(tmp_path), "--steps", "1"]))
    wait_for("the store", lambda: "hosts the store" in agents[0].output(), agents)
    other = subprocess.run(
        fleetrun_cmd(
            "--log_dir", str(tmp_path / "y"), *flags, WORKER, str(tmp_path), "--steps", "2"
        ),
        cwd=str(REPO),
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert other.returncode == 2, other.stderr
    assert "rendezvous id 'shared-id' is taken by another job" in other.stderr, other.stderr
    assert "--rdzv_id" in other.stderr and "--steps 1" in other.stderr
    assert agents[0].proc.poll() is None, "the first job was disturbed"


@pytest.mark.timeout(60)
def test_help_lists_elastic_flags_without_torch() -> None:
    code = (
        "import sys; from launcher.cli import run_command; from click.testing import CliRunner; "
        "r = CliRunner().invoke(run_command, ['--help']); print(r.output); "
        "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=60
    ).stdout
    for flag in (
        "--rdzv_backend",
        "--rdzv_endpoint",
        "--rdzv_id",
        "--rdzv_conf",
        "--standalone",
        "--monitor_interval",
        "--elastic_server",
        "--job_id",
        "--np",
    ):
        assert flag in out
    assert out.strip().endswith("NO_TORCH")
