"""Hybrid checkpoints (fleet.checkpoint) on real processes (CPU, gloo): saved at one layout,
loaded at another — sharding 2 -> sharding 1 (one process), dp 2, another sharding stage (2 and
FSDP2's 3); saved by FSDP2 (stage 3) -> one process. After loading, the parameters equal the
saved ones exactly and two more training steps equal the saving job's own continuation (so the
optimizer state came back too). A checkpoint of another tensor-parallel degree is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_all_ok, run_workers

SCRIPT = SCRIPTS / "sharding_checkpoint.py"
TOL = 1e-5


def _job(tmp_path: Path, world: int, *args: str) -> None:
    results = run_workers(
        SCRIPT, world,
        ["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), *args],
        timeout=150, tmp_path=tmp_path,
    )
    assert_all_ok(results)


def _loaded(tmp_path: Path, world: int, *layout: str) -> list[dict]:
    _job(tmp_path, world, "--mode", "load", *layout)
    recs = [json.loads((tmp_path / "out" / f"load_rank{r}.json").read_text())
            for r in range(world)]
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
    assert manifest["degrees"] == {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
                                   "sharding_degree": 2}
    optim = manifest["optimizer"]
    assert optim["class"] == "Adam" and optim["sharding_stage"] == 1
    assert sorted(set(optim["owners"].values())) == [0, 1]  # both ranks wrote a shard
    assert set(optim["state_keys"]) == set(manifest["params"])  # every parameter's state saved
    assert manifest["params"]["0.weight"] == {"shape": [32, 32], "dtype": "float32"}

    (one,) = _loaded(tmp_path, 1)  # sharding 1, one process: holds the whole state
    assert one["state_params"] == len(manifest["params"])
    assert "mp_degree=2" in one["other_mp"] and "is not implemented yet" in one["other_mp"]
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
