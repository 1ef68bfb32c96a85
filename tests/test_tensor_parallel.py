"""Tensor parallelism on real processes (CPU, gloo): fleet.init with mp_degree builds the hybrid
groups of the topology; every TP layer's output and gradients (weights, bias, inputs) equal the
single-device layer's; the RNG tracker; distributed_model over the data-parallel group only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_all_ok, run_workers

from fleet.base.topology import HYBRID_AXES, CommunicateTopology

HYBRID_TP = SCRIPTS / "hybrid_tp.py"
TOL = 1e-5  # float32


def _run(tmp_path: Path, dp: int, mp: int) -> list[dict]:
    out = tmp_path / "out"
    world = dp * mp
    results = run_workers(
        HYBRID_TP,
        world,
        ["--out", str(out), "--dp", str(dp), "--mp", str(mp)],
        timeout=100,
        tmp_path=tmp_path,
    )
    assert_all_ok(results)
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    topo = CommunicateTopology(list(HYBRID_AXES), [dp, 1, 1, mp])
    for rank, rec in enumerate(recs):
        assert rec["rank"] == rank
        assert rec["coord"] == topo.get_coord(rank)
        assert rec["sizes"] == [dp, 1, 1, mp]
        for axis in HYBRID_AXES:
            mine = [g for g in topo.get_comm_list(axis) if rank in g]
            assert rec["group_ranks"][axis] == mine[0]
            assert rec["group_sums"][axis] == sum(mine[0])  # the torch group connects them
        assert rec["group_ranks"]["check"] == list(range(world))
        bad = {k: v for k, v in rec["layer_errs"].items() if not v < TOL}
        assert not bad, f"rank {rank}: TP differs from the dense layer: {bad}"
        assert len(rec["layer_errs"]) == 23
        assert "out_features=7 does not divide by the model-parallel degree 2" in rec["uneven"]
        assert rec["rng"] == {
            "global_same_over_mp": True,
            "tracked_differs_over_mp": True,
            "tracked_differs_from_global": True,
            "global_stream_undisturbed": True,
        }
        dm = rec["distributed_model"]
        assert all(v < TOL for v in dm["errs"].values()), dm
    return recs


@pytest.mark.timeout(120)
def test_mp2_layers_equal_dense_and_model_is_not_wrapped(tmp_path: Path) -> None:
    for rec in _run(tmp_path, dp=1, mp=2):
        # dp_degree 1: nothing to average, the model comes back as it is
        assert rec["distributed_model"]["is_model"] and not rec["distributed_model"]["is_ddp"]


@pytest.mark.timeout(150)
def test_dp2_mp2_groups_layers_and_ddp_over_the_data_parallel_group(tmp_path: Path) -> None:
    for rec in _run(tmp_path, dp=2, mp=2):
        # DDP over the dp group: shard gradients equal the dense model's on the global batch
        assert rec["distributed_model"]["is_ddp"] and not rec["distributed_model"]["is_model"]
