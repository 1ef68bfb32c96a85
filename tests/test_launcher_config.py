"""Job file, flags and environment: precedence, validation errors naming the key, --help."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SCRIPTS, run_fleetrun

from collective.errors import ConfigError
from launcher.attempt import Decision, decide
from launcher.spec import Mode, Tee, build_spec, spec_to_dict
from launcher.summary import Failure, format_summary, root_first

WORKER = str(SCRIPTS / "launcher_worker.py")


def _job(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


# -- pure: the spec ---------------------------------------------------------------------------
def test_spec_defaults_and_roundtrip() -> None:
    spec = build_spec(
        {"entrypoint": {"script": "t.py", "args": ["--x", 1]}, "sizes": {"nproc_per_node": 2}}
    )
    assert spec.sizes.nproc_per_node == 2 and spec.entrypoint.args == ("--x", "1")
    assert spec.mode is Mode.COLLECTIVE and spec.tee is Tee.RANK0 and spec.world_size == 2
    assert build_spec(spec_to_dict(spec)) == spec


@pytest.mark.parametrize(
    "data,key,fragment",
    [
        ({"sizes": {"nproc_per_nod": 2}}, "sizes.nproc_per_nod", "did you mean 'nproc_per_node'"),
        ({"sizes": {"nproc_per_node": "two"}}, "sizes.nproc_per_node", "'auto'"),
        ({"sizes": {"nnodes": 0}}, "sizes.nnodes", "must be >= 1, got 0"),
        ({"mode": "hybrid"}, "mode", "'collective' | 'ps'"),
        ({"max_restarts": -1}, "max_restarts", "must be >= 0"),
        ({"rendezvous": {"master_port": 70000}}, "rendezvous.master_port", "1..65535"),
        ({"rendezvous": {"ips": "a,b", "node_rank": 2}}, "rendezvous.node_rank", "only 2 node(s)"),
        ({"entrypoint": {"script": "a.py", "module": "b"}}, "entrypoint.script", "not both"),
        ({"env": ["A=1"]}, "env", "expected a mapping"),
        ({"tee": "some"}, "tee", "'rank0' | 'all' | 'none'"),
        ({"bogus": 1}, "bogus", "allowed keys: name, entrypoint"),
    ],
)
def test_spec_errors_name_the_key(data: dict, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_spec(data)
    assert info.value.key == key
    assert fragment in str(info.value)


def test_restart_decision_is_plain_data() -> None:
    assert decide(False, 0, 0) is Decision.SUCCEED
    assert decide(True, 0, 2) is Decision.RESTART
    assert decide(True, 2, 2) is Decision.FAIL


def _failure(rank: int, t: float, msg: str = "ValueError: x", desc: str = "exit code 1") -> Failure:
    return Failure(
        "trainer",
        rank,
        rank,
        0,
        "h",
        100 + rank,
        desc,
        t,
        0,
        f"log/workerlog.{rank}",
        "e.json" if msg else None,
        msg,
        "Traceback...\n  boom\n" + msg if msg else "",
    )


def test_summary_groups_identical_failures_root_first() -> None:
    text = format_summary(
        "j",
        [
            _failure(3, 3.0),
            _failure(1, 1.0),
            _failure(2, 2.0),
            _failure(5, 4.0, "", "signal SIGKILL (9)"),
        ],
        [("trainer", 0)],
        "log",
        0,
        0,
    )
    lines = text.splitlines()
    assert lines[1] == "Root cause (first observed failure):"
    assert "trainer  : rank 1 " in text
    assert "[ranks 2, 3] exit code 1: ValueError: x (same as root cause)" in text
    assert "[rank 5] signal SIGKILL (9)" in text
    assert "Stopped by fleetrun after the root cause: rank 0" in text


def test_a_rank_that_only_lost_its_peer_is_not_the_root_cause() -> None:
    """Rank 2 exited first, but only because rank 3's teardown closed their connection (gloo's
    words); rank 3's own error is the root cause. Lost peers alone: the earliest of them."""
    lost = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?"  # fmt: skip
    failures = [_failure(2, 1.0, lost), _failure(3, 1.2, "RuntimeError: injected")]
    assert [f.rank for f in root_first(failures)] == [3, 2]
    text = format_summary("j", failures, [], "log", 0, 0)
    assert "trainer  : rank 3 " in text and "RuntimeError: injected" in text
    reset = "Connection reset by peer"
    assert [f.rank for f in root_first([_failure(4, 2.0, reset), _failure(1, 1.5, lost)])] == [1, 4]


# -- the CLI ----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_job_file_with_cli_and_env_overrides(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = _job(
        tmp_path,
        f"""
name: cfgtest
entrypoint: {{script: {WORKER}, args: ["--out", "{out}"]}}
sizes: {{nproc_per_node: 3}}
log_dir: {tmp_path / "log"}
env: {{MY_FLAG: hello}}
max_restarts: 1
""",
    )
    # env overrides the file (3 -> 2); a flag overrides env for max_restarts
    r = run_fleetrun(
        "-c",
        job,
        "--max_restarts",
        "0",
        env={"FLEETRUN_NPROC_PER_NODE": "2", "FLEETRUN_MAX_RESTARTS": "5"},
    )
    assert r.returncode == 0, r.stderr
    recs = sorted(out.glob("rank*.json"))
    assert len(recs) == 2
    env = json.loads(recs[0].read_text())["env"]
    assert env["MY_FLAG"] == "hello" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
    assert env["FLEET_JOB_NAME"] == "cfgtest"
    assert "job        : cfgtest" in r.stderr
    assert (tmp_path / "log" / "job.yaml").exists()


@pytest.mark.timeout(60)
def test_bad_yaml_key_exits_2_naming_it(tmp_path: Path) -> None:
    job = _job(tmp_path, "sizes:\n  nproc_per_nodes: 2\n")
    r = run_fleetrun("-c", job, WORKER)
    assert r.returncode == 2
    assert "sizes.nproc_per_nodes: unknown key (did you mean 'nproc_per_node'?)" in r.stderr


@pytest.mark.timeout(60)
def test_bad_flag_values(tmp_path: Path) -> None:
    r = run_fleetrun("--nproc_per_node", "zero", WORKER)
    assert (
        r.returncode == 2 and "sizes.nproc_per_node" in r.stderr and "--nproc_per_node" in r.stderr
    )
    r = run_fleetrun("--nproc_per_nod", "2", WORKER)
    assert r.returncode == 2 and "No such option '--nproc_per_nod'" in r.stderr
    r = run_fleetrun("--backend", "mpi", WORKER)
    assert r.returncode == 2 and "'mpi' is not one of 'auto', 'gloo', 'nccl'" in r.stderr
    r = run_fleetrun("--log_dir", str(tmp_path))
    assert r.returncode == 2 and "nothing to run" in r.stderr
    r = run_fleetrun("--log_dir", str(tmp_path), "missing_script.py")
    assert r.returncode == 2 and "script 'missing_script.py' not found" in r.stderr
    r = run_fleetrun("--run_mode", "ps", "--log_dir", str(tmp_path), WORKER)
    assert r.returncode == 2 and "PS mode needs server_num >= 1 and worker_num >= 1" in r.stderr
    r = run_fleetrun("--dry_run", "--log_dir", str(tmp_path), WORKER)
    assert r.returncode == 2 and "--dry_run prints Kubernetes manifests" in r.stderr
    r = run_fleetrun("--warm_imports", "numpy,my model", WORKER)
    assert r.returncode == 2 and "'my model' is not a module name" in r.stderr, r.stderr
    r = run_fleetrun("-c", str(tmp_path / "nope.yaml"), WORKER)
    assert r.returncode == 2 and "nope.yaml' does not exist" in r.stderr


@pytest.mark.timeout(60)
def test_help_documents_every_option() -> None:
    r = run_fleetrun("--help")
    assert r.returncode == 0
    for opt in [
        "--nproc_per_node",
        "--nproc-per-node",
        "--nnodes",
        "--node_rank",
        "--master_addr",
        "--master_port",
        "--ips",
        "--backend",
        "--log_dir",
        "--max_restarts",
        "--run_id",
        "-c, --config",
        "--tee",
        "-m, --module",
        "Examples:",
        "FLEETRUN_",
    ]:
        assert opt in r.stdout, opt
