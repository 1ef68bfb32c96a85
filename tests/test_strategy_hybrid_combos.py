"""Hybrid combinations that the strategy supports, each against a single-process reference on the full
batch (real 4-rank gloo jobs, tests/scripts/combo_hybrid.py, several cases per job):

* sharding stage 3 (FSDP2) x tensor parallel (sharding 2 x mp 2) and x pipeline (pp 2 x
  sharding 2, also with an embedding tied between the first and the last stage);
* AMP O2 (bfloat16 on CPU) x sharding stages 1/2/3, the float32 master weights partitioned
  with the optimizer state;
* float16 dynamic loss scaling x sharding stage 2 and 3, and x stage 1 under pipeline parallelism, with
  an overflow on one replica only (every rank skips that step; the scale follows the
  reference's); float16 O2 + scaler + clip through a sharded optimizer and FSDP2 float16 mixed
  precision in one process (gloo on CPU; NCCL on a GPU, marked ``gpu``);
* global-norm clipping x sharding stages 1/2/3 (the norm over every partition and every mp/pp
  rank equals torch's ``clip_grad_norm_`` on the dense model);
* ``recompute_configs.enable_offload`` (one process: the recomputed blocks' inputs are what the
  offload hooks see; on a GPU they leave the device).

And what stays refused, with its message. float32 cases match to 1e-5; float16 O1 ones to 1e-4
(different batch splits sum float16 products in another order); bfloat16 O2 ones to 5e-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_all_ok, run_workers

import fleet
from collective.errors import ConfigError, FleetNotImplementedError
from fleet.parallelize.features import wrap_model_features
from fleet.strategy import check_composition

SCRIPT = SCRIPTS / "combo_hybrid.py"
TOL, FP16_TOL, BF16_TOL = 1e-5, 1e-4, 5e-3


def _run(tmp_path: Path, layout: str, cases: list[str]) -> list[dict]:
    out = tmp_path / "out"
    results = run_workers(
        SCRIPT,
        4,
        ["--out", str(out), "--layout", layout, "--ckpt", "--cases", ",".join(cases)],
        timeout=150,
        tmp_path=tmp_path,
    )
    assert_all_ok(results)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def _close(rec: dict, tol: float) -> None:
    assert all(v < tol for v in rec["errs"].values()), rec


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_sharding_x_tensor_parallel_combinations_equal_the_dense_model(tmp_path: Path) -> None:
    cases = ["s3_clip", "s1_clip", "s2_clip", "o2_s1", "o2_s2", "o2_s3", "fp16_s2", "fp16_s3"]
    recs = _run(tmp_path, "tp", cases)
    for rec in recs:
        # stage 3 over the TP layers: FSDP2 module, each rank holds 1/(mp x sharding) of the
        # TP-split weights and 1/sharding of the replicated bias (4 + 4 floats)
        s3 = rec["s3_clip"]
        assert s3["model_type"] == "FSDPSequential"
        assert s3["local_param_bytes"] == ((8 * 8 + 8 + 8 * 8) // 2 + 4) * 4 == 288
        # fleet.save_checkpoint of that 2-D layout is not built: refused, saying so
        assert s3["ckpt_err"].startswith("FleetNotImplementedError: fleet.save_checkpoint"), s3
        for case in ("s3_clip", "s1_clip", "s2_clip"):
            _close(rec[case], TOL)
            # the global norm over every partition and mp rank is torch's on the dense model
            assert rec[case]["norms"] == pytest.approx(rec[case]["ref_norms"], rel=1e-6), case
            assert len(rec[case]["norms"]) == 3
        for case in ("o2_s1", "o2_s2"):
            o2 = rec[case]
            _close(o2, BF16_TOL)
            assert o2["param_dtype"] == "torch.bfloat16" and o2["out_dtype"] == "torch.bfloat16"
            # float32 masters only for this rank's partition: half of its TP shard
            assert o2["masters_only_owned"] and o2["master_bytes"] == 576 // 2
            assert o2["master_errs"] and all(v < BF16_TOL for v in o2["master_errs"].values())
        o2 = rec["o2_s3"]  # FSDP2 MixedPrecisionPolicy: float32 shards, bfloat16 compute
        _close(o2, BF16_TOL)
        assert o2["param_dtype"] == "torch.float32" and o2["out_dtype"] == "torch.bfloat16"
        assert o2["local_param_bytes"] == 288
        for case in ("fp16_s2", "fp16_s3"):
            fp16 = rec[case]
            _close(fp16, FP16_TOL)
            # replica 1's overflow at step 1: every rank skipped it, the scale halved once
            assert fp16["skipped"] == fp16["ref_skipped"] == [False, True, False], case
            assert fp16["scales"] == fp16["ref_scales"] == [1024.0, 512.0, 512.0], case


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_sharding_x_pipeline_combinations_equal_the_single_process_model(tmp_path: Path) -> None:
    recs = _run(tmp_path, "pp", ["s3", "s3_tied", "s1_clip", "fp16_s1", "o2_s3"])
    for rank, rec in enumerate(recs):
        stage = rank // 2  # pp is the outer axis: ranks 0, 1 hold stage 0
        # s3_tied: an embedding tied between the stages (its gradient summed shard by shard)
        assert "shared_layers.embed.weight" in rec["s3_tied"]["errs"]
        for case in ("s3", "s3_tied", "s1_clip"):
            _close(rec[case], TOL)
        s3 = rec["s3"]
        assert s3["model_type"] == "PipelineParallel" and s3["stage_type"] == "FSDPPipelineLayer"
        assert s3["local_param_bytes"] == s3["stage_param_bytes"] // 2  # sharded over 2
        assert s3["ckpt_err"] == 0.0  # fleet.save_checkpoint / load_checkpoint round trip
        assert s3["names"] == (
            ["0.bias", "0.weight", "2.bias", "2.weight"]
            if stage == 0
            else ["4.bias", "4.weight", "6.bias", "6.weight"]
        )
        clip = rec["s1_clip"]  # norm over both stages and both partitions
        assert clip["norms"] == pytest.approx(clip["ref_norms"], rel=1e-6)
        fp16 = rec["fp16_s1"]
        _close(fp16, FP16_TOL)
        assert fp16["ref_skipped"] == [False, True, False]
        assert fp16["scales"] == fp16["ref_scales"] == [1024.0, 512.0, 512.0]
        _close(rec["o2_s3"], BF16_TOL)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.timeout(150)
def test_float16_o2_scaler_and_clip_through_a_sharded_optimizer_and_fsdp2(
    tmp_path: Path, device: str
) -> None:
    """World 1 (gloo on CPU, NCCL on a GPU): float16 O2 masters under a stage-2 sharded
    optimizer, the scaler reducing through it and skipping the overflowing step, the clip over
    the partition — equal to the same training without the sharded optimizer; FSDP2 with a
    float16 MixedPrecisionPolicy computes in float16 over float32 shards."""
    env = {"FLEET_BACKEND": "nccl"} if device == "cuda" else {}
    results = run_workers(
        SCRIPTS / "combo_gpu.py",
        1,
        ["--out", str(tmp_path / "o"), "--device", device],
        timeout=130,
        tmp_path=tmp_path,
        extra_env=env,
    )
    assert_all_ok(results)
    rec = json.loads((tmp_path / "o" / "rank0.json").read_text())
    assert rec["backend"] == ("nccl" if device == "cuda" else "gloo")
    assert rec["o2_dtype"] == "torch.float16" and rec["o2_vs_unsharded"] == 0.0
    assert rec["skipped"] == rec["ref_skipped"] == [False, True, False]
    assert rec["scales"] == rec["ref_scales"] == [1024.0, 512.0, 512.0]
    assert rec["fsdp_fp16"] == {
        "out_dtype": "torch.float16",
        "param_dtype": "torch.float32",
        "finite": True,
    }


# ---- recompute offload (one process) ---------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _net(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Block(), _Block(), torch.nn.Linear(16, 1)).to(device)


def _offload_strategy(offload: bool) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy(recompute=True)
    s.recompute_configs = {"checkpoints": ["0", "1"], "enable_offload": offload}
    return s


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model(x).pow(2).mean().backward()
    return [p.grad.detach().cpu() for p in model.parameters()]


@pytest.mark.timeout(60)
def test_recompute_offload_keeps_only_the_block_inputs_and_equal_gradients() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    plain = _grads(_net("cpu"), x)
    model = wrap_model_features(_net("cpu"), _offload_strategy(True))
    got = _grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    hooks = [model[i].forward for i in (0, 1)]
    # each block saved exactly its input (8 x 16 float32) under the offload hooks; on the host
    # already, so kept, not copied
    assert [h.wrap.kept_bytes for h in hooks] == [8 * 16 * 4] * 2
    assert [h.wrap.offloaded_bytes for h in hooks] == [0, 0]


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_recompute_offload_moves_the_block_inputs_off_the_gpu() -> None:
    x = torch.randn(256, 16, device="cuda", requires_grad=True)
    plain = _grads(_net("cuda"), x)
    model = wrap_model_features(_net("cuda"), _offload_strategy(True))
    got = _grads(model, x)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, plain))
    assert [model[i].forward.wrap.offloaded_bytes for i in (0, 1)] == [256 * 16 * 4] * 2


# ---- lifted and still refused ------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {
            "hybrid_configs": {"sharding_degree": 2, "mp_degree": 2},
            "sharding_configs": {"stage": 3},
        },
        {
            "hybrid_configs": {"sharding_degree": 2, "pp_degree": 2},
            "sharding_configs": {"stage": 3},
        },
        *(
            {
                "hybrid_configs": {"sharding_degree": 2},
                "sharding_configs": {"stage": st},
                "amp": True,
                "amp_configs": {"use_pure_fp16": True},
            }
            for st in (1, 2, 3)
        ),
        {"hybrid_configs": {"sharding_degree": 2}, "sharding_configs": {"stage": 2}, "amp": True},
        {"hybrid_configs": {"sharding_degree": 2, "pp_degree": 2}, "amp": True},
        {"recompute": True, "recompute_configs": {"checkpoints": ["0"], "enable_offload": True}},
    ],
)
@pytest.mark.timeout(30)
def test_lifted_combinations_pass_the_composition_check(settings: dict) -> None:
    check_composition(fleet.DistributedStrategy.from_dict(settings))


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        (
            {
                "hybrid_configs": {"pp_degree": 2},
                "gradient_merge": True,
                "gradient_merge_configs": {"k_steps": 2},
            },
            FleetNotImplementedError,
            r"gradient_merge with pipeline parallelism.*accumulate_steps",
        ),
        (
            {"hybrid_configs": {"sharding_degree": 2}, "localsgd": True},
            FleetNotImplementedError,
            r"strategy.localsgd with sharding stage 1.*pure data parallel",
        ),
        (
            {"hybrid_configs": {"mp_degree": 2}, "dgc": True},
            FleetNotImplementedError,
            r"strategy.dgc with hybrid_configs.mp_degree=2",
        ),
        (
            {
                "hybrid_configs": {"sharding_degree": 2},
                "sharding_configs": {"stage": 2},
                "fp16_allreduce": True,
            },
            FleetNotImplementedError,
            r"strategy.fp16_allreduce with sharding stage 2.*use sharding stage 1",
        ),
        (
            {"asp": True, "amp": True, "amp_configs": {"use_pure_fp16": True}},
            FleetNotImplementedError,
            r"strategy.asp with amp_configs.use_pure_fp16",
        ),
    ],
)
@pytest.mark.timeout(30)
def test_what_stays_refused_names_both_features(settings: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        check_composition(fleet.DistributedStrategy.from_dict(settings))


@pytest.mark.timeout(30)
def test_offload_without_recompute_checkpoints_is_still_an_error() -> None:
    s = fleet.DistributedStrategy(recompute=True)
    s.recompute_configs = {"enable_offload": True}
    with pytest.raises(ConfigError, match=r"recompute_configs.checkpoints"):
        wrap_model_features(_net("cpu"), s)
