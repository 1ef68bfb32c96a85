"""fleet data parallel on real processes (CPU, gloo): roles, DDP equal to single-process training,
gradient merge equal to one large-batch step with the all-reduce skipped in between, world 1
launched and plain, and the DP example training to a lower loss."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SCRIPTS, assert_all_ok, base_env, run_workers

FLEET_DP = SCRIPTS / "fleet_dp.py"
EXAMPLE = REPO / "examples" / "dp" / "train.py"
TOL = 1e-6


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _check_training(recs: list[dict]) -> None:
    """What every world size must show: DDP, identical replicas equal to the reference."""
    for rec in recs:
        assert "call fleet.init" in rec["before_init"]
        assert rec["dp_is_ddp"] and rec["opt_is_optimizer"] and rec["opt_param_groups_shared"]
        assert rec["opt_state_dict_passthrough"]
        assert rec["dp_spread"] == 0.0 and rec["gm_spread"] == 0.0
        assert rec["gm_linked"]
        # micro-steps 1..3 of each cycle keep the gradient, the 4th updates and clears it
        assert rec["gm_grad_kept"] == [True, True, True, False] * 2
        # one all-reduce (one bucket) per update, none on the micro-steps in between
        assert rec["gm_reduce_counts"] == [0, 0, 0, 1, 1, 1, 1, 2]
        assert (
            "strategy.tensor_parallel" in rec["ni_model"]
            and "fleet.distributed_model" in rec["ni_model"]
        )
        assert "strategy.tensor_parallel" in rec["ni_optimizer"]
    assert recs[0]["dp_vs_reference"] < TOL
    assert recs[0]["gm_vs_reference"] < TOL


@pytest.mark.timeout(120)
def test_world_2_roles_data_parallel_and_gradient_merge(tmp_path: Path) -> None:
    out = tmp_path / "out"
    results = run_workers(FLEET_DP, 2, ["--out", str(out)], timeout=100, tmp_path=tmp_path)
    assert_all_ok(results)
    recs = _records(out, 2)
    _check_training(recs)
    r0, r1 = recs
    assert (r0["rank"], r1["rank"]) == (0, 1) and r0["world"] == r1["world"] == 2
    assert r0["is_first_worker"] and not r1["is_first_worker"]
    assert (r0["local_rank"], r1["local_rank"]) == (0, 1)
    assert len(r0["endpoints"]) == 2 and len(set(r0["endpoints"])) == 2
    assert r0["endpoints"] == r1["endpoints"]
    assert r0["endpoints_str"] == ",".join(r0["endpoints"])
    # Paddle's split of 5 files over 2 trainers: contiguous, the first gets the extra one
    assert r0["shard"] == ["part-0", "part-1", "part-2"] and r1["shard"] == ["part-3", "part-4"]
    assert r0["dp_bucket_bytes_cap"] == 32 * 1024 * 1024  # fuse_grad_size_in_MB default


@pytest.mark.timeout(120)
def test_world_1_launched_with_the_jobs_strategy_file(tmp_path: Path) -> None:
    strategy = tmp_path / "strategy.yaml"
    strategy.write_text(yaml.safe_dump({"fuse_grad_size_in_MB": 16}))
    out = tmp_path / "out"
    results = run_workers(
        FLEET_DP,
        1,
        ["--out", str(out)],
        timeout=100,
        tmp_path=tmp_path,
        extra_env={"FLEET_STRATEGY": str(strategy)},
    )
    assert_all_ok(results)
    (rec,) = _records(out, 1)
    _check_training([rec])
    assert rec["world"] == 1 and rec["is_first_worker"]
    assert rec["shard"] == [f"part-{i}" for i in range(5)]
    assert rec["strategy"] == {"fuse_grad_size_in_MB": 16}
    assert rec["dp_bucket_bytes_cap"] == 16 * 1024 * 1024


@pytest.mark.timeout(120)
def test_plain_python_without_launcher_is_a_world_of_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(FLEET_DP), "--out", str(out)],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (rec,) = _records(out, 1)
    _check_training([rec])
    assert rec["world"] == 1 and rec["local_rank"] == 0
    assert len(rec["endpoints"]) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", rec["endpoints"][0])


@pytest.mark.timeout(120)
def test_dp_example_loss_falls_on_two_ranks(tmp_path: Path) -> None:
    results = run_workers(
        EXAMPLE,
        2,
        [
            "--steps",
            "80",
            "--log_every",
            "20",
            "--strategy",
            str(REPO / "configs" / "strategy_dp.yaml"),
        ],
        timeout=100,
        tmp_path=tmp_path,
    )
    assert_all_ok(results)
    pattern = re.compile(r"^step +\d+ .* loss ([0-9.]+)$", re.MULTILINE)
    losses = [float(v) for v in pattern.findall(results[0].output)]
    assert len(losses) == 5, results[0].output  # steps 1, 20, 40, 60, 80 on rank 0 only
    assert losses[-1] < 0.75 * losses[0], results[0].output
    assert "step" not in results[1].output  # only rank 0 prints
