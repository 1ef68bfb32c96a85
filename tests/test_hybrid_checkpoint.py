"""Hybrid checkpoints (fleet.checkpoint) on real processes (CPU, gloo): saved at one layout,
loaded at another — sharding 2 -> sharding 1 (one process), dp 2, another sharding stage (2 and
FSDP2's 3); saved by FSDP2 (stage 3) -> one process. After loading, the parameters equal the
saved ones exactly and two more training steps equal the saving job's own continuation (so the
optimizer state came back too). Tensor-/pipeline-parallel degree changes (tp_pp_checkpoint.py):
mp2 -> mp1 (a dense single-process model), mp1 -> mp2, pp2 -> pp1 and pp1 -> pp2 with a tied
weight, mp2 x pp2 -> one process and -> mp2 x sharding2; parameters and Adam state equal the
saved ones and one more step equals the saving job's own continuation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_all_ok, run_workers

SCRIPT = SCRIPTS / "sharding_checkpoint.py"
TOL = 1e-5


def _job(tmp_path: Path, world: int, *args: str) -> None:
    results = run_workers(
        SCRIPT,
        world,
        ["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), *args],
        timeout=150,
        tmp_path=tmp_path,
    )
    assert_all_ok(results)


def _loaded(tmp_path: Path, world: int, *layout: str) -> list[dict]:
    _job(tmp_path, world, "--mode", "load", *layout)
    recs = [json.loads((tmp_path / "out" / f"load_rank{r}.json").read_text()) for r in range(world)]
    for rec in recs:
        assert rec["load_err"] == 0.0, rec
        assert rec["continue_err"] < TOL, rec
        assert "is not a fleet checkpoint" in rec["bad_path"]
    return recs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_saved_at_sharding2_loads_at_sharding1_dp2_and_other_stages(tmp_path: Path) -> None:
    _job(tmp_path, 2, "--mode", "save", "--sharding", "2", "--stage", "1")
    manifest = json.loads((tmp_path / "ckpt" / "fleet_manifest.json").read_text())
    assert manifest["degrees"] == {
        "dp_degree": 1,
        "mp_degree": 1,
        "pp_degree": 1,
        "sharding_degree": 2,
    }
    optim = manifest["optimizer"]
    assert optim["class"] == "Adam" and optim["sharding_stage"] == 1
    assert sorted(set(optim["owners"].values())) == [0, 1]  # both ranks wrote a shard
    assert set(optim["state_keys"]) == set(manifest["params"])  # every parameter's state saved
    assert manifest["params"]["0.weight"] == {"shape": [32, 32], "dtype": "float32"}

    (one,) = _loaded(tmp_path, 1)  # sharding 1, one process: holds the whole state
    assert one["state_params"] == len(manifest["params"])
    assert "has format 1, this fleet reads format 2" in one["old_format"]
    for rec in _loaded(tmp_path, 2, "--dp", "2"):
        assert rec["state_params"] == len(manifest["params"])
    stage2 = _loaded(tmp_path, 2, "--sharding", "2", "--stage", "2")
    assert sum(rec["state_params"] for rec in stage2) == len(manifest["params"])
    _loaded(tmp_path, 2, "--sharding", "2", "--stage", "3")  # into FSDP2's DTensor shards


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_saved_by_fsdp2_stage3_loads_in_one_process(tmp_path: Path) -> None:
    _job(tmp_path, 2, "--mode", "save", "--sharding", "2", "--stage", "3")
    manifest = json.loads((tmp_path / "ckpt" / "fleet_manifest.json").read_text())
    assert manifest["fsdp_stage3"] is True and manifest["optimizer"]["sharding_stage"] == 0
    (one,) = _loaded(tmp_path, 1)
    assert one["state_params"] == len(manifest["params"])


TP_PP = SCRIPTS / "tp_pp_checkpoint.py"


def _tp_pp(tmp_path: Path, world: int, mode: str, *layout: str) -> list[dict]:
    results = run_workers(
        TP_PP,
        world,
        ["--mode", mode, "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), *layout],
        timeout=100,
        tmp_path=tmp_path,
    )
    assert_all_ok(results)
    if mode == "save":
        return []
    recs = [json.loads((tmp_path / "out" / f"load_rank{r}.json").read_text()) for r in range(world)]
    for rec in recs:
        assert rec["param_err"] == 0.0 and rec["state_err"] == 0.0, rec
        assert rec["continue_err"] < TOL, rec
    return recs


ALL_PARAMS = [
    "1.bias",
    "1.weight",
    "3.bias",
    "3.weight",
    "shared_layers.tied.bias",
    "shared_layers.tied.weight",
]


@pytest.mark.timeout(200)
def test_saved_in_one_process_loads_at_mp2_and_at_pp2(tmp_path: Path) -> None:
    _tp_pp(tmp_path, 1, "save")  # TP layers at mp 1: full tensors, one pipeline stage
    manifest = json.loads((tmp_path / "ckpt" / "fleet_manifest.json").read_text())
    assert manifest["format"] == 2 and sorted(manifest["params"]) == ALL_PARAMS
    assert manifest["params"]["1.weight"] == {"shape": [16, 8], "dtype": "float32"}
    for rec in _tp_pp(tmp_path, 2, "load", "--mp", "2"):  # each mp rank reads its slices
        assert rec["names"] == ALL_PARAMS
    stages = _tp_pp(tmp_path, 2, "load", "--pp", "2")  # both stages hold the tied weight
    assert [r["names"] for r in stages] == [ALL_PARAMS, ALL_PARAMS]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mp2_x_pp2_loads_into_a_dense_process_and_at_mp2_x_sharding2(tmp_path: Path) -> None:
    _tp_pp(tmp_path, 4, "save", "--mp", "2", "--pp", "2")
    manifest = json.loads((tmp_path / "ckpt" / "fleet_manifest.json").read_text())
    assert manifest["degrees"] == {
        "dp_degree": 1,
        "mp_degree": 2,
        "pp_degree": 2,
        "sharding_degree": 1,
    }
    params = manifest["params"]
    assert sorted(params) == ALL_PARAMS  # no per-rank keys: global names and shapes
    assert sorted(manifest["optimizer"]["state_keys"]) == ALL_PARAMS  # both stages' state
    assert params["1.weight"] == {"shape": [16, 8], "dtype": "float32", "split_axis": 0}
    assert params["1.bias"]["split_axis"] == 0
    assert params["3.weight"] == {"shape": [8, 16], "dtype": "float32", "split_axis": 1}
    assert params["3.bias"] == {"shape": [8], "dtype": "float32"}  # replicated
    # mp2 x pp2 -> one process of plain nn.Linear layers: parameters and Adam state equal
    (one,) = _tp_pp(tmp_path, 1, "load", "--dense")
    assert one["names"] == ALL_PARAMS and len(one["state_names"]) == 2 * len(ALL_PARAMS)
    assert "1.weight: saved [16, 8], here [32, 16]" in one["wrong_shape"]
    # -> mp2 x sharding2 (stage 1): each sharding rank loads the state of the shards it owns
    _tp_pp(tmp_path, 4, "load", "--mp", "2", "--sharding", "2")
