"""Hybrid composition through fleet.parallelize on real processes (CPU, gloo, world 4):
dp2 x mp2 and sharding2 x mp2 with a tensor-parallel MLP, pp2 x sharding2 with a PipelineLayer,
each equal to single-process training on the full batch (float32, 1e-5); a hybrid checkpoint
round trip at dp2 x mp2; and the combinations that are refused, naming both features and the
fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_all_ok, run_workers

import fleet
from collective.errors import ConfigError, FleetNotImplementedError
from fleet.strategy import check_composition

SCRIPT = SCRIPTS / "compose_hybrid.py"
TOL = 1e-5


def _run(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "out"
    results = run_workers(SCRIPT, 4, ["--out", str(out), *args], timeout=200, tmp_path=tmp_path)
    assert_all_ok(results)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "wrapped", "sharded"),
    [
        (["--dp", "2", "--mp", "2"], "DataParallel", False),
        (["--sharding", "2", "--mp", "2", "--stage", "2"], "Sequential", True),
    ],
)
@pytest.mark.timeout(220)
def test_tensor_parallel_mlp_with_dp_or_sharding_equals_dense(
    tmp_path: Path, layout: list[str], wrapped: str, sharded: bool
) -> None:
    for rec in _run(tmp_path, "--case", "tp", *layout):
        assert rec["model_type"] == wrapped and rec["sharded"] is sharded
        assert all(v < TOL for v in rec["errs"].values()), rec
        # checkpoint round trip: every mp rank got its own shard and optimizer state back
        assert rec["ckpt_param_err"] == 0.0 and rec["ckpt_state_err"] == 0.0, rec
    assert (tmp_path / "out" / "ckpt" / "fleet_manifest.json").exists()
    manifest = json.loads((tmp_path / "out" / "ckpt" / "fleet_manifest.json").read_text())
    assert manifest["params"]["0.weight"] == {"shape": [16, 8], "dtype": "float32", "split_axis": 0}
    assert manifest["params"]["2.bias"] == {"shape": [4], "dtype": "float32"}  # replicated


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.timeout(220)
def test_pipeline2_x_sharding2_equals_single_process(tmp_path: Path, stage: int) -> None:
    recs = _run(tmp_path, "--case", "pp", "--pp", "2", "--sharding", "2", "--stage", str(stage))
    for rec in recs:
        assert rec["model_type"] == "PipelineParallel" and rec["sharded"]
        assert all(v < TOL for v in rec["errs"].values()), rec
    # stage 0 holds the first two linears, stage 1 the last two
    assert recs[0]["names"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert recs[3]["names"] == ["4.bias", "4.weight", "6.bias", "6.weight"]


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        (
            {"sharding": True},
            ConfigError,
            r"hybrid_configs.sharding_degree: strategy.sharding is on but .*sharding_degree is 1",
        ),
        (
            {"hybrid_configs": {"sharding_degree": 2}, "sharding_configs": {"sharding_degree": 4}},
            ConfigError,
            r"sharding_configs.sharding_degree=4 but hybrid_configs.sharding_degree=2",
        ),
        # (stage 3 with pp/mp, AMP O2 and float16 scaling with sharding are supported:
        # tests/test_strategy_hybrid_combos.py)
        (
            {"pipeline": True},
            ConfigError,
            r"strategy.pipeline is on but hybrid_configs.pp_degree is 1",
        ),
        (
            {
                "hybrid_configs": {"pp_degree": 2},
                "gradient_merge": True,
                "gradient_merge_configs": {"k_steps": 2},
            },
            FleetNotImplementedError,
            r"gradient_merge with pipeline parallelism.*accumulate_steps",
        ),
    ],
)
@pytest.mark.timeout(60)
def test_unsupported_combinations_name_both_features_and_the_fix(
    settings: dict, error: type, message: str
) -> None:
    s = fleet.DistributedStrategy.from_dict(settings)
    with pytest.raises(error, match=message):
        check_composition(s)
    with pytest.raises(error, match=message):  # refused at fleet.init, before any process group
        fleet.init(is_collective=True, strategy=s)
