"""Global-norm gradient clipping across tensor-parallel shards (fleet.meta_optimizers.clip): at mp2 (and
dp2 x mp2) the norm of the TP model's gradients equals torch.nn.utils.clip_grad_norm_ on the
single-device model for the 2-, 1- and inf-norm, the clipped shards equal the slices of the
clipped dense gradients, and the optimizer hook (grad_clip) trains identically to clip + SGD."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_all_ok, run_workers

from collective.errors import ConfigError
from fleet.meta_optimizers.clip import ClipGradByGlobalNorm, clip_grad_norm_, get_grad_norm

FEATURES_CLIP = SCRIPTS / "features_clip.py"
TOL = 1e-5


def _check(tmp_path: Path, dp: int, mp: int) -> None:
    out = tmp_path / "out"
    world = dp * mp
    results = run_workers(
        FEATURES_CLIP,
        world,
        ["--out", str(out), "--dp", str(dp), "--mp", str(mp)],
        timeout=100,
        tmp_path=tmp_path,
    )
    assert_all_ok(results)
    for r in range(world):
        rec = json.loads((out / f"rank{r}.json").read_text())
        for norm_type, case in rec["cases"].items():
            assert abs(case["ours"] - case["ref"]) <= TOL * max(1.0, case["ref"]), (norm_type, case)
            assert case["grad_err"] < TOL, (norm_type, case)
            assert case["ref"] > 0.5  # the clip really scaled the gradients
        # per-shard clip_grad_norm_ is not the global norm (the test would notice)
        assert abs(rec["cases"]["2.0"]["naive"] - rec["cases"]["2.0"]["ref"]) > 1e-3
        assert rec["hook"]["param_err"] < TOL
        norms = rec["hook"]["norms"]
        assert all(abs(a - b) < TOL * max(1.0, a) for a, b in zip(norms[::2], norms[1::2])), norms
        assert rec["is_distributed"] == {
            "emb.weight": True,
            "fc1.weight": True,
            "fc1.bias": True,
            "fc2.weight": True,
            "fc2.bias": False,
            "norm.weight": False,
            "norm.bias": False,
        }


@pytest.mark.timeout(120)
def test_clip_mp2_equals_clip_grad_norm_on_the_dense_model(tmp_path: Path) -> None:
    _check(tmp_path, dp=1, mp=2)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_clip_dp2_mp2_equals_clip_grad_norm_on_the_dense_model(tmp_path: Path) -> None:
    _check(tmp_path, dp=2, mp=2)


@pytest.mark.timeout(30)
def test_single_process_equals_torch_and_bad_values_raise() -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p) * 4
        q.grad = p.grad.clone()
    ours = clip_grad_norm_(a, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    assert torch.allclose(ours, ref, atol=1e-6)
    assert all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(a, b))
    assert get_grad_norm([]).item() == 0.0
    with pytest.raises(ConfigError, match="max_norm"):
        clip_grad_norm_(a, 0.0)
    with pytest.raises(ConfigError, match="clip_norm"):
        ClipGradByGlobalNorm(-1)
