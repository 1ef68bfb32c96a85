"""AMP bf16 + recompute + gradient merge combined at world 2 through fleet.init /
distributed_model / distributed_optimizer / distributed_scaler, against the single-process
reference with the same settings on the global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_all_ok, run_workers

FEATURES_COMBINED = SCRIPTS / "features_combined.py"
TOL = 2e-3  # bf16 matmuls on a 4-row vs an 8-row batch


@pytest.mark.timeout(120)
def test_amp_bf16_recompute_gradient_merge_world2_equals_single_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    results = run_workers(FEATURES_COMBINED, 2, ["--out", str(out)], timeout=100, tmp_path=tmp_path)
    assert_all_ok(results)
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rec in recs:
        assert rec["is_ddp"]
        assert rec["out_dtypes"] == ["torch.bfloat16"]  # autocast through DDP
        assert rec["recompute_wrapped"] == ["_WrappedForward", "_WrappedForward"]
        assert rec["updates"] == 3  # 6 micro-steps, k_steps 2
        assert rec["spread"] == 0.0  # replicas identical
        assert rec["scale"] == 256.0
    assert recs[0]["moved"] > 1e-2  # training changed the parameters ...
    assert recs[0]["vs_reference"] < TOL, recs[0]  # ... exactly as the reference did
