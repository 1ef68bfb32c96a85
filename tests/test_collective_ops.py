"""The communication API (collective.comm) and collective.spawn.

Multi-process checks run real gloo process groups: one fixture-script run per world size checks
every op (torch is imported once per rank), see tests/scripts/collective_ops.py. The spawn checks
run tests/scripts/collective_spawn.py once, as a user script would call spawn.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as tdist
from conftest import SCRIPTS, assert_all_ok, base_env, run_workers

from collective.comm import REDUCE_OP_NAMES, ReduceOp, to_torch_op, wait
from collective.env import Backend, read_worker_env
from collective.errors import ConfigError
from collective.spawn import make_spawn_envs, spawn

# What tests/scripts/collective_ops.py reports per rank when every check passed.
OP_CHECKS = [
    "broadcast",
    *(f"all_reduce {name}" for name in REDUCE_OP_NAMES.values()),
    "all_reduce int AVG and torch op",
    "reduce",
    "all_gather",
    "all_gather_object",
    "scatter",
    "barrier",
    "send/recv",
    "isend/irecv",
    "new_group",
]


# ---------------------------------------------------------------- pure unit tests


@pytest.mark.timeout(30)
def test_reduce_op_values_match_paddle() -> None:
    assert [(n, getattr(ReduceOp, n)) for n in REDUCE_OP_NAMES.values()] == [
        ("SUM", 0),
        ("MAX", 1),
        ("MIN", 2),
        ("PROD", 3),
        ("AVG", 4),
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("op", "want"),
    [
        (ReduceOp.SUM, tdist.ReduceOp.SUM),
        (ReduceOp.MAX, tdist.ReduceOp.MAX),
        (ReduceOp.MIN, tdist.ReduceOp.MIN),
        (ReduceOp.PROD, tdist.ReduceOp.PRODUCT),
        (ReduceOp.AVG, tdist.ReduceOp.AVG),
        (0, tdist.ReduceOp.SUM),  # Paddle's ReduceOp constants are plain ints
        (4, tdist.ReduceOp.AVG),
        (np.int64(3), tdist.ReduceOp.PRODUCT),  # not an identity hit: the slow path
    ],
)
def test_reduce_op_maps_to_torch(op: object, want: object) -> None:
    assert to_torch_op(op) == want


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "op",
    [
        tdist.ReduceOp.SUM,
        tdist.ReduceOp.AVG,  # == 1 as an int, which is Paddle's MAX: must stay AVG
        tdist.ReduceOp.PRODUCT,
        tdist.ReduceOp.MAX,
        tdist.ReduceOp.BAND,
    ],
)
def test_torch_reduce_op_passes_through(op: object) -> None:
    assert to_torch_op(op) is op or to_torch_op(op) == op
    assert type(to_torch_op(op)) is type(op)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("op", ["sum", 7, -1, None, 1.5, [0], True])
def test_unknown_reduce_op_raises_config_error(op: object) -> None:
    with pytest.raises(ConfigError) as info:
        to_torch_op(op)
    msg = str(info.value)
    assert info.value.key == "op"
    assert msg.startswith("op: ") and repr(op) in msg and "ReduceOp.AVG" in msg


@pytest.mark.timeout(30)
def test_wait_accepts_none_and_rejects_non_tasks() -> None:
    wait(None)

    class Task:
        waited = False

        def wait(self) -> None:
            Task.waited = True

    wait(Task())
    assert Task.waited
    with pytest.raises(ConfigError, match=r"task: 42 is not a communication task"):
        wait(42)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "key", "value"),
    [
        ({"nprocs": 0}, "nprocs", "0"),
        ({"nprocs": -2}, "nprocs", "-2"),
        ({"nprocs": "2"}, "nprocs", "'2'"),
        ({"backend": "mpi"}, "backend", "'mpi'"),
        ({"ips": "10.0.0.1"}, "options", "ips"),
    ],
)
def test_spawn_rejects_bad_arguments_before_starting(kwargs: dict, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        spawn(print, **kwargs)
    assert info.value.key == key and value in str(info.value)


@pytest.mark.timeout(30)
def test_spawn_envs_follow_the_env_contract(tmp_path: Path) -> None:
    envs = make_spawn_envs(3, Backend.GLOO, str(tmp_path))
    parsed = [read_worker_env(e) for e in envs]
    assert [(w.rank, w.world_size, w.local_rank) for w in parsed] == [(r, 3, r) for r in range(3)]
    assert len({(w.master_addr, w.master_port) for w in parsed}) == 1
    assert parsed[0].master_port > 0 and all(w.backend is Backend.GLOO for w in parsed)
    assert [w.current_endpoint for w in parsed] == list(parsed[0].trainer_endpoints)
    assert all(w.launched for w in parsed)


# ---------------------------------------------------------------- real process groups


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_against_expected_values(world_size: int, tmp_path: Path) -> None:
    results = run_workers(
        SCRIPTS / "collective_ops.py",
        world_size,
        args=[str(tmp_path)],
        timeout=150,
        tmp_path=tmp_path,
    )
    assert_all_ok(results)
    for r in results:
        missing = [c for c in OP_CHECKS if f"rank {r.rank}: OK {c}\n" not in r.output]
        assert not missing, f"rank {r.rank} did not report {missing}:\n{r.output}"
        assert f"rank {r.rank}: ALL OK" in r.output, r.output


@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """One run of the spawn fixture script (success phase, then failure phase)."""
    out_dir = tmp_path_factory.mktemp("spawn")
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "collective_spawn.py"), str(out_dir)],
        check=False,
        cwd=out_dir,  # spawn's default log dir lands here, not in the repo
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )


def _spawn_output(run: subprocess.CompletedProcess[str]) -> str:
    return f"exit {run.returncode}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr[-4000:]}"


@pytest.mark.timeout(180)
def test_spawn_runs_workers_with_the_env_contract(
    spawn_run: subprocess.CompletedProcess[str],
) -> None:
    assert "SPAWN OK" in spawn_run.stdout, _spawn_output(spawn_run)


@pytest.mark.timeout(180)
def test_spawn_failing_child_raises_worker_failed_error_with_traceback(
    spawn_run: subprocess.CompletedProcess[str],
) -> None:
    out = _spawn_output(spawn_run)
    assert spawn_run.returncode == 0, out
    match = re.search(r"--- ERROR BEGIN\n(.*)\n--- ERROR END", spawn_run.stdout, re.DOTALL)
    assert match, out
    error = match.group(1)
    assert error.startswith("spawn: rank 1 (pid "), error
    assert "Traceback (most recent call last)" in error, error
    assert "in failing_worker" in error, error
    assert "ValueError: deliberate failure marker 4711" in error, error
    # rank 0 was blocked in a barrier: it must have been stopped, not left behind
    assert "ORPHANS []" in spawn_run.stdout, out
