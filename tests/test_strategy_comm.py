"""Communication-efficient data parallel: fp16/bf16 all-reduce, local SGD,
adaptive local SGD, DGC, sync batch norm, ASP, DDP bucket keys and the no-op Paddle keys.

Pure tests (one process): the strategy sections, their validation and YAML, the refused
combinations, the DGC / adaptive-interval / 2:4-mask math. Real 2-rank gloo jobs
(tests/scripts/strategy_comm_*.py, started with the env contract as fleetrun gives it): parity with
torch's own hooks and optimizers on the same seed, collectives and bytes counted with
``CommCounter``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import SCRIPTS, assert_all_ok, run_workers

from collective.errors import ConfigError, FleetNotImplementedError
from fleet.meta_optimizers import asp
from fleet.meta_optimizers.dgc import (
    DGCMomentumOptimizer,
    accumulate_,
    scatter_mean,
    select_top_k_,
    sparsity_at,
    top_k_count,
)
from fleet.meta_optimizers.localsgd import AdaptiveModelAverager, next_k_steps
from fleet.strategy import NO_OP_KEYS, DistributedStrategy, check_composition

# ---- the strategy keys ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_new_keys_have_paddles_names_defaults_and_round_trip_through_yaml(tmp_path: Path) -> None:
    s = DistributedStrategy()
    assert (s.fp16_allreduce, s.localsgd, s.adaptive_localsgd, s.dgc, s.asp) == (False,) * 5
    assert s.localsgd_configs.k_steps == 1 and s.localsgd_configs.begin_step == 1
    assert s.adaptive_localsgd_configs.init_k_steps == 1
    assert s.dgc_configs.rampup_begin_step == 0 and s.dgc_configs.rampup_step == 1
    assert s.fuse_all_reduce_ops is True and s.last_comm_group_size_MB == 1.0
    s.localsgd = True
    s.localsgd_configs = {"k_steps": 4}  # a dict merges into the section
    assert s.localsgd_configs.begin_step == 1
    s.dgc_configs = {"sparsity": [0.75, 0.9375, 0.984375, 0.996, 0.999], "rampup_step": 10}
    s.fp16_allreduce_configs = {"dtype": "bfloat16"}
    s.nccl_comm_num = 2
    path = tmp_path / "s.yaml"
    path.write_text(s.to_yaml())
    back = DistributedStrategy.from_yaml(path)
    assert back.to_dict() == s.to_dict()
    assert back.dgc_configs.sparsity == (0.75, 0.9375, 0.984375, 0.996, 0.999)
    assert yaml.safe_load(path.read_text())["localsgd_configs"] == {"k_steps": 4, "begin_step": 1}


@pytest.mark.parametrize(
    ("attr", "value", "message"),
    [
        ("localsgd_configs", {"k_steps": -1}, r"^localsgd_configs\.k_steps: must be >= 1"),
        ("localsgd_configs", {"begin_step": -2}, r"^localsgd_configs\.begin_step: must be >= 0"),
        (
            "adaptive_localsgd_configs",
            {"init_k_steps": 17},
            r"^adaptive_localsgd_configs\.init_k_steps: must be between 1 and 16",
        ),
        (
            "dgc_configs",
            {"sparsity": [0.5, 1.0]},
            r"^dgc_configs\.sparsity: every value must be in \[0, 1\).*\[1\.0\]",
        ),
        ("dgc_configs", {"sparsity": [-0.1]}, r"^dgc_configs\.sparsity: every value"),
        ("dgc_configs", {"sparsity": []}, r"^dgc_configs\.sparsity: must list at least one"),
        ("dgc_configs", {"rampup_step": 0}, r"^dgc_configs\.rampup_step: must be >= 1"),
        ("dgc_configs", {"k_steps": 2}, r"^dgc_configs\.k_steps: unknown key"),
        (
            "fp16_allreduce_configs",
            {"dtype": "int8"},
            r"^fp16_allreduce_configs\.dtype: got 'int8'",
        ),
        ("last_comm_group_size_MB", 0, r"^last_comm_group_size_MB: must be > 0"),
        ("nccl_comm_num", 0, r"^nccl_comm_num: must be >= 1"),
        ("localsgd_k_steps", 4, r"^localsgd_k_steps: unknown key"),
        ("k_steps", 4, r"^k_steps: unknown key"),
    ],
)
@pytest.mark.timeout(30)
def test_bad_values_are_refused_naming_the_key(attr: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        setattr(DistributedStrategy(), attr, value)
    with pytest.raises(ConfigError, match=message):
        DistributedStrategy.from_dict({attr: value})


@pytest.mark.timeout(30)
def test_no_op_keys_are_accepted_and_each_has_its_reason() -> None:
    s = DistributedStrategy()
    fields = s.to_dict()
    for key, reason in NO_OP_KEYS.items():
        assert key in fields and len(reason) > 20
    s = DistributedStrategy.from_dict(
        {
            "sync_nccl_allreduce": False,
            "nccl_comm_num": 2,
            "use_hierarchical_allreduce": True,
            "hierarchical_allreduce_inter_nranks": 8,
            "without_graph_optimization": True,
            "fuse_grad_size_in_num": 4,
            "fuse_grad_merge": True,
            "conv_workspace_size_limit": 1024,
            "cudnn_batchnorm_spatial_persistent": True,
        }
    )
    check_composition(s)
    assert s.non_default_settings()["nccl_comm_num"] == 2
    assert set(s.no_op_settings()) == set(NO_OP_KEYS)  # every one set: every one reported
    assert DistributedStrategy(nccl_comm_num=2, dgc=True).no_op_settings() == {"nccl_comm_num": 2}


@pytest.mark.parametrize(
    ("settings", "error", "named"),
    [
        ({"dgc": True, "fp16_allreduce": True}, ConfigError, ("fp16_allreduce", "dgc")),
        (
            {"localsgd": True, "adaptive_localsgd": True},
            ConfigError,
            ("localsgd", "adaptive_localsgd"),
        ),
        ({"dgc": True, "localsgd": True}, ConfigError, ("dgc", "localsgd")),
        (
            {"dgc": True, "gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
            ConfigError,
            ("dgc", "gradient_merge"),
        ),
        ({"dgc": True, "lars": True}, ConfigError, ("dgc", "lars")),
        (
            {"localsgd": True, "pipeline": True, "hybrid_configs": {"pp_degree": 2}},
            FleetNotImplementedError,
            ("localsgd", "pp_degree=2"),
        ),
        (
            {"localsgd": True, "sharding": True, "hybrid_configs": {"sharding_degree": 2}},
            FleetNotImplementedError,
            ("localsgd", "sharding stage 1"),
        ),
        (
            {
                "fp16_allreduce": True,
                "hybrid_configs": {"sharding_degree": 2},
                "sharding_configs": {"stage": 2},
            },
            FleetNotImplementedError,
            ("fp16_allreduce", "sharding stage 2"),
        ),
        (
            {"dgc": True, "hybrid_configs": {"mp_degree": 2}},
            FleetNotImplementedError,
            ("dgc", "mp_degree=2"),
        ),
        (
            {
                "adaptive_localsgd": True,
                "gradient_merge": True,
                "gradient_merge_configs": {"k_steps": 4},
            },
            FleetNotImplementedError,
            ("adaptive_localsgd", "gradient_merge"),
        ),
        (
            {"asp": True, "amp": True, "amp_configs": {"use_pure_fp16": True}},
            FleetNotImplementedError,
            ("asp", "use_pure_fp16"),
        ),
    ],
)
@pytest.mark.timeout(30)
def test_combinations_that_cannot_work_name_both_keys(
    settings: dict, error: type, named: tuple[str, str]
) -> None:
    with pytest.raises(error) as err:
        check_composition(DistributedStrategy.from_dict(settings))
    assert all(n in str(err.value) for n in named), str(err.value)


@pytest.mark.timeout(30)
def test_combinations_that_work_pass() -> None:
    for settings in (
        {"fp16_allreduce": True, "localsgd": True},
        {"fp16_allreduce": True, "gradient_merge": True},
        {"fp16_allreduce": True, "hybrid_configs": {"mp_degree": 2}},
        {"dgc": True, "sync_batch_norm": True, "asp": True},
        {"localsgd": True, "lars": True, "sync_batch_norm": True},
    ):
        check_composition(DistributedStrategy.from_dict(settings))


# ---- DGC math ---------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_dgc_sparsity_schedule_and_k_follow_paddle() -> None:
    schedule = [0.75, 0.9375, 0.984375, 0.996, 0.999]
    # rampup_step 10 over 5 entries: 2 steps each, then the last one for ever
    got = [sparsity_at(t, 10, schedule) for t in range(13)]
    assert got == [
        0.75,
        0.75,
        0.9375,
        0.9375,
        0.984375,
        0.984375,
        0.996,
        0.996,
        0.999,
        0.999,
        0.999,
        0.999,
        0.999,
    ]
    assert sparsity_at(0, 1, schedule) == 0.75 and sparsity_at(1, 1, schedule) == 0.999
    assert top_k_count(16384, 0.999) == 16 and top_k_count(100, 0.999) == 1
    assert top_k_count(1000, 0.75) == 250


@pytest.mark.timeout(30)
def test_dgc_momentum_correction_accumulation_and_masking() -> None:
    m = 0.9
    u, v = torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.tensor([0.1, 0.0, -0.2, 0.3])
    g = torch.tensor([0.5, 0.5, -1.0, 2.0])
    accumulate_(u, v, g, m, nesterov=False)
    assert torch.allclose(u, torch.tensor([1.4, -1.3, -0.55, 2.0]))  # m*u + g
    assert torch.allclose(v, torch.tensor([1.5, -1.3, -0.75, 2.3]))  # v + u
    values, idx = select_top_k_(u, v, 2)
    assert sorted(idx.tolist()) == [0, 3]
    assert torch.allclose(values.sort().values, torch.tensor([1.5, 2.3]))
    assert torch.allclose(v, torch.tensor([0.0, -1.3, -0.75, 0.0]))  # masked
    assert torch.allclose(u, torch.tensor([0.0, -1.3, -0.55, 0.0]))
    # Nesterov: u = m*(u + g); v = v + u + g
    u, v = torch.tensor([1.0]), torch.tensor([0.5])
    accumulate_(u, v, torch.tensor([1.0]), m, nesterov=True)
    assert torch.allclose(u, torch.tensor([1.8])) and torch.allclose(v, torch.tensor([3.3]))
    # the mean of two ranks' sparse vectors
    dense = scatter_mean(torch.tensor([[1.0, 2.0], [4.0, -2.0]]), torch.tensor([[0, 3], [0, 1]]), 4)
    assert dense.tolist() == [2.5, -1.0, 0.0, 1.0]


@pytest.mark.timeout(30)
def test_dgc_needs_a_momentum_sgd() -> None:
    params = torch.nn.Linear(4, 2).parameters()
    for opt in (
        torch.optim.Adam(params),
        torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1),
    ):
        with pytest.raises(
            ConfigError,
            match=r"^dgc: DGC's momentum correction needs a "
            r"momentum SGD",
        ):
            DGCMomentumOptimizer(opt)
    DGCMomentumOptimizer(
        torch.optim.SGD(
            torch.nn.Linear(4, 2).parameters(),
            lr=0.1,
            momentum=0.9,
            nesterov=True,
            weight_decay=1e-4,
        )
    )


# ---- adaptive local SGD -----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_adaptive_interval_follows_paddles_rule_on_a_scripted_loss_sequence() -> None:
    lr_0, loss_0, init_k = 0.1, 2.0, 4
    # ceil(sqrt(lr_0 * loss / (lr * loss_0) * init_k)), clipped to [1, 16]
    script = [
        (0.1, 2.0, 2),
        (0.1, 1.0, 2),
        (0.1, 0.5, 1),
        (0.01, 0.5, 4),
        (0.001, 0.5, 10),
        (0.0001, 0.5, 16),
        (0.1, 8.0, 4),
        (0.1, 0.0, 1),
    ]
    for lr, loss, expected in script:
        assert next_k_steps(init_k, lr_0, loss_0, lr, loss) == expected
        assert expected == max(
            1, min(16, math.ceil(math.sqrt(lr_0 * loss / (lr * loss_0) * init_k)))
        )
    assert next_k_steps(init_k, lr_0, 0.0, 0.1, 1.0) == 1  # first loss 0: smallest interval
    assert next_k_steps(init_k, lr_0, loss_0, 0.1, float("nan")) == 1


@pytest.mark.timeout(30)
def test_adaptive_local_sgd_without_the_loss_names_the_key() -> None:
    averager = AdaptiveModelAverager(init_k_steps=2, warmup_steps=0, process_group=object())
    averager.lr_0, averager.loss_0 = 0.1, 1.0  # as after the first step
    groups = [{"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.1}]
    with pytest.raises(ConfigError, match=r"^adaptive_localsgd: .*optimizer\.set_loss\(loss\)"):
        averager.average_parameters(groups)


# ---- ASP ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_asp_mask_keeps_the_two_largest_of_every_four_along_the_input_dim() -> None:
    from torch.ao.pruning import WeightNormSparsifier

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 6)
    mask = asp.create_mask(lin.weight)
    rows = (lin.weight.detach().abs() * mask).reshape(-1, 4)
    dropped = (lin.weight.detach().abs() * (1 - mask)).reshape(-1, 4)
    assert ((mask.reshape(-1, 4)).sum(dim=1) == 2).all()
    kept_min = torch.where(rows > 0, rows, torch.inf).min(dim=1).values
    assert (kept_min >= dropped.max(dim=1).values).all()
    # the same mask as torch.ao.pruning's 2:4 block sparsifier for a Linear weight
    ref = torch.nn.Sequential(torch.nn.Linear(16, 6))
    ref[0].weight.data.copy_(lin.weight.detach())
    sparsifier = WeightNormSparsifier(
        sparsity_level=1.0, sparse_block_shape=(1, 4), zeros_per_block=2
    )
    sparsifier.prepare(ref, [{"tensor_fqn": "0.weight"}])
    sparsifier.step()
    assert torch.equal(ref[0].parametrizations.weight[0].mask.float(), mask)
    # a convolution groups along its input channels (dim 1), per output channel and position
    conv = torch.nn.Conv2d(8, 3, 3)
    cmask = asp.create_mask(conv.weight)
    assert cmask.shape == conv.weight.shape
    assert (cmask.movedim(1, -1).reshape(-1, 4).sum(dim=1) == 2).all()


@pytest.mark.timeout(60)
def test_asp_prune_and_decorate_keep_weights_sparse_in_one_process() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3), torch.nn.Linear(3, 2)
    )
    asp.set_excluded_layers(model, ["2.weight"])
    with pytest.raises(ConfigError, match=r"^asp: the model has no parameter \['nope'\]"):
        asp.set_excluded_layers(model, ["nope"])
    masks = asp.prune_model(model)
    assert sorted(masks) == ["0.weight"]  # 2.weight excluded, 3.weight has 3 inputs
    assert asp.calculate_density(model[0].weight) == 0.5
    opt = asp.decorate(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    assert asp.decorate(opt) is opt
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert asp.check_sparsity(model[0].weight) and asp.calculate_density(model[0].weight) == 0.5
    assert asp.calculate_density(model[2].weight) == 1.0
    assert asp.prune_model(model)["0.weight"] is masks["0.weight"]  # pruning again: same mask
    asp.reset_excluded_layers(model)


# ---- 2-rank jobs ------------------------------------------------------------------------------


def _job(tmp_path: Path, script: str, case: str) -> list[dict]:
    out = tmp_path / "out"
    results = run_workers(
        SCRIPTS / script, 2, ["--case", case, "--out", str(out)], timeout=150, tmp_path=tmp_path
    )
    assert_all_ok(results)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(180)
def test_fp16_and_bf16_allreduce_equal_torchs_compress_hooks_with_half_the_bytes(
    tmp_path: Path,
) -> None:
    for rec in _job(tmp_path, "strategy_comm_dp.py", "fp16"):
        for dtype in ("float16", "bfloat16"):
            got = rec[dtype]
            assert got["vs_torch"] <= 1e-6 and got["spread"] == 0.0
            assert got["bytes"] == got["torch_bytes"]
            assert all(b * 2 == f for b, f in zip(got["bytes"], rec["fp32_bytes"]))
        # the default buckets: last_comm_group_size_MB (1 MiB) first, then fuse_grad_size_in_MB
        assert rec["bucket_caps"] == [1 << 20, 32 << 20]
        # fuse_all_reduce_ops=False: one all-reduce per parameter (after DDP's first step,
        # which always uses a single bucket)
        assert rec["unfused_allreduce"][1:] == [rec["num_params"]] * 2


@pytest.mark.timeout(180)
def test_localsgd_equals_torchs_post_local_sgd_with_a_quarter_of_the_allreduces(
    tmp_path: Path,
) -> None:
    for rec in _job(tmp_path, "strategy_comm_dp.py", "localsgd"):
        assert rec["loss_vs_torch"] <= 1e-6 and rec["params_vs_torch"] <= 1e-6
        assert rec["allreduce"] == rec["torch_allreduce"]
        # 2 warm-up steps all-reduce gradients, then one parameter average every 4 steps
        assert rec["allreduce"] == [1, 1] + [1, 0, 0, 0] * 3 + [1]
        after = rec["allreduce"][2:14]
        assert sum(after) / len(after) == 0.25
        # replicas equal right after each averaging, apart in between
        assert [rec["spread"][i] for i in (0, 1, 2, 6, 10, 14)] == [0.0] * 6
        assert rec["spread"][4] > 0
        assert rec["state_dict_step"] == 15
        # with fp16_allreduce the warm-up all-reduce travels in float16
        assert [2 * b for b in rec["fp16_warmup_bytes"]] == rec["fp32_warmup_bytes"]
        assert rec["fp16_allreduce"] == [1, 1, 1, 0, 0, 0]


@pytest.mark.timeout(180)
def test_adaptive_localsgd_interval_follows_the_rule_and_training_converges(tmp_path: Path) -> None:
    for rec in _job(tmp_path, "strategy_comm_dp.py", "adaptive"):
        assert rec["scripted_history"] == rec["scripted_expected"]
        ks = {k for _, k in rec["scripted_history"]}
        assert len(ks) > 1  # the interval did change
        assert rec["finite"] and rec["last_loss"] < rec["first_loss"]
        assert rec["spreads_after_avg"] and set(rec["spreads_after_avg"]) == {0.0}
        steps = [s for s, _ in rec["real_history"]]
        assert all(b - a == k for (a, k), b in zip(rec["real_history"], steps[1:]))


@pytest.mark.timeout(180)
def test_dgc_sparse_exchange_equals_the_reference_and_sends_under_two_percent(
    tmp_path: Path,
) -> None:
    for rec in _job(tmp_path, "strategy_comm_dgc.py", "dgc"):
        assert rec["compressed"] == ["0.weight", "2.weight"]
        assert rec["dense_vs_ddp"] == [0.0, 0.0]  # before rampup_begin_step: DDP + momentum
        assert len(rec["exchange_err"]) == 10 and max(rec["exchange_err"]) <= 1e-6
        assert rec["sparse_bytes"] and max(rec["sparse_bytes"]) <= 0.02 * rec["dense_bytes"]
        assert max(rec["grad_density"]) <= 2 * 0.001 + 1e-9  # at most world * k entries
        assert set(rec["spreads"]) == {0.0} and rec["final_spread"] == 0.0
        assert rec["last_loss"] < rec["first_loss"]


@pytest.mark.timeout(180)
def test_sync_batch_norm_on_two_ranks_equals_one_process_with_the_whole_batch(
    tmp_path: Path,
) -> None:
    recs = _job(tmp_path, "strategy_comm_features.py", "sync_bn")
    for rec in recs:
        assert rec["sync_is_fleet_sync_bn"] and rec["sync_vs_whole_batch"] <= 1e-12
        assert rec["plain_bn_type"] == "BatchNorm1d" and rec["plain_vs_whole_batch"] > 1e-3
        assert rec["eval_ok"]
        assert rec["cudnn_benchmark"] is True  # cudnn_exhaustive_search


@pytest.mark.timeout(180)
def test_asp_masks_are_two_of_four_after_pruning_and_after_steps(tmp_path: Path) -> None:
    for rec in _job(tmp_path, "strategy_comm_features.py", "asp"):
        sparse = {"0.weight": True, "3.weight": True, "5.weight": False, "7.weight": True}
        assert rec["after_prune"] == sparse and rec["after_steps"] == sparse
        assert rec["density"]["0.weight"] == rec["density"]["3.weight"] == 0.5
        assert rec["density"]["5.weight"] == 1.0  # excluded
        assert rec["spread"] == 0.0


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_gpu_paths_nccl_fp16_bf16_dgc_and_torchs_sync_batch_norm(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    results = run_workers(
        SCRIPTS / "strategy_comm_gpu.py",
        1,
        ["--out", str(tmp_path / "o")],
        timeout=150,
        tmp_path=tmp_path,
        extra_env={"FLEET_BACKEND": "nccl"},
    )
    assert_all_ok(results)
    rec = json.loads((tmp_path / "o" / "rank0.json").read_text())
    assert rec["backend"] == "nccl" and rec["sync_bn_type"] == "SyncBatchNorm"
    assert rec["sync_bn_module"] == "torch.nn.modules.batchnorm"
    for key in ("fp16", "bf16", "dgc"):
        assert rec[key]["finite"] and rec[key]["device"].startswith("cuda"), (key, rec)
    assert rec["fp16"]["bytes"] * 2 == rec["fp32_bytes"] == rec["bf16"]["bytes"] * 2
