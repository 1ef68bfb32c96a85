"""AMP: fleet's loss scaler (Paddle's amp_configs semantics), fleet.distributed_scaler agreeing on
found-inf across ranks (inject an inf on one rank at mp2 and dp2 x mp2: every rank skips the same
steps and the scale changes identically, for fleet's and torch's GradScaler), the autocast
forward of wrap_model_features with custom op lists, AMP O2 master weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import SCRIPTS, assert_all_ok, run_workers
from torch import nn

from collective.errors import ConfigError, FleetError
from fleet.meta_optimizers.amp import GradScaler, MasterWeightOptimizer
from fleet.parallelize.features import wrap_model_features, wrap_optimizer_features
from fleet.strategy import DistributedStrategy

FEATURES_AMP = SCRIPTS / "features_amp.py"
STEPS, INJECT = 9, (2, 5)


def _expected_scales() -> list[float]:
    """decr_every_n_nan_or_inf=1, decr_ratio=0.5, incr_every_n_steps=3, incr_ratio=2."""
    scale, good, out = 1024.0, 0, []
    for step in range(STEPS):
        if step in INJECT:
            scale, good = scale * 0.5, 0
        else:
            good += 1
            if good == 3:
                scale, good = scale * 2, 0
        out.append(scale)
    return out


def _check(tmp_path: Path, dp: int, mp: int) -> None:
    out = tmp_path / "out"
    world = dp * mp
    results = run_workers(
        FEATURES_AMP,
        world,
        ["--out", str(out), "--dp", str(dp), "--mp", str(mp)],
        timeout=100,
        tmp_path=tmp_path,
    )
    assert_all_ok(results)
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for kind in ("fleet", "torch"):
        for rec in recs:
            steps = rec[kind]
            # only rank 1 saw an inf of its own ...
            assert [s["local_inf"] for s in steps] == [
                rec["rank"] == 1 and i in INJECT for i in range(STEPS)
            ], (kind, rec["rank"])
            # ... yet every rank skipped exactly those steps and scaled identically
            assert [s["skipped"] for s in steps] == [i in INJECT for i in range(STEPS)], (
                kind,
                rec["rank"],
                steps,
            )
            assert [s["scale"] for s in steps] == _expected_scales(), (kind, rec["rank"])


@pytest.mark.timeout(120)
def test_distributed_scaler_mp2_all_ranks_skip_the_injected_steps(tmp_path: Path) -> None:
    _check(tmp_path, dp=1, mp=2)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_distributed_scaler_dp2_mp2_all_ranks_skip_the_injected_steps(tmp_path: Path) -> None:
    _check(tmp_path, dp=2, mp=2)


# ---- single process ------------------------------------------------------------------------------


def _step_with_grad(scaler: GradScaler, p: nn.Parameter, opt, value: float) -> None:
    p.grad = torch.full_like(p, value)
    scaler.step(opt)
    scaler.update()


@pytest.mark.timeout(30)
def test_scaler_follows_paddle_decr_every_n_and_incr_every_n() -> None:
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler(
        init_loss_scaling=8.0,
        incr_ratio=2.0,
        decr_ratio=0.5,
        incr_every_n_steps=2,
        decr_every_n_nan_or_inf=2,
    )
    scales = []
    for value in (1.0, float("nan"), 1.0, float("inf"), float("inf"), 1.0, 1.0, 1.0):
        _step_with_grad(scaler, p, opt, value)
        scales.append(scaler.get_scale())
    # one bad step is tolerated, the second consecutive one shrinks; two good ones grow
    assert scales == [8.0, 8.0, 8.0, 8.0, 4.0, 4.0, 8.0, 8.0]
    # finite steps updated p by -grad/scale... unscaled: 5 good steps of lr * 1/scale
    assert p.detach()[0].item() < 0
    # a fixed scale with use_dynamic_loss_scaling=False; never below 1
    fixed = GradScaler(init_loss_scaling=4.0, use_dynamic_loss_scaling=False)
    _step_with_grad(fixed, p, opt, float("inf"))
    assert fixed.get_scale() == 4.0
    tiny = GradScaler(init_loss_scaling=1.0, decr_every_n_nan_or_inf=1)
    _step_with_grad(tiny, p, opt, float("inf"))
    assert tiny.get_scale() == 1.0


@pytest.mark.timeout(30)
def test_scaler_unscales_once_and_round_trips_its_state() -> None:
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler(init_loss_scaling=4.0)
    scaler.scale(p.sum()).backward()
    assert p.grad.tolist() == [4.0, 4.0]
    scaler.unscale_(opt)
    assert p.grad.tolist() == [1.0, 1.0] and scaler.found_inf(opt) is False
    with pytest.raises(FleetError, match="already called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert p.detach().tolist() == [0.0, 0.0]
    again = GradScaler()
    again.load_state_dict(scaler.state_dict())
    assert again.get_scale() == 4.0
    with pytest.raises(ConfigError, match="decr_ratio"):
        GradScaler(decr_ratio=1.5)
    off = GradScaler(enable=False)
    assert off.scale(torch.tensor(3.0)).item() == 3.0 and off.get_scale() == 1.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fleet", "torch"])
def test_scalers_follow_gradient_merge(kind: str) -> None:
    from fleet.meta_optimizers.amp import _patch_torch_scaler
    from fleet.meta_optimizers.gradient_merge import DistributedOptimizer, GradientMergeState

    p = nn.Parameter(torch.zeros(2))
    gm = GradientMergeState(k_steps=2, avg=True)
    opt = DistributedOptimizer(torch.optim.SGD([p], lr=1.0), gm)
    if kind == "fleet":
        scaler = GradScaler(init_loss_scaling=4.0, decr_every_n_nan_or_inf=1, decr_ratio=0.5)
    else:
        scaler = _patch_torch_scaler(
            torch.amp.GradScaler("cpu", init_scale=4.0, backoff_factor=0.5), sync=False
        )
    for grads in ([1.0, 3.0], [float("inf"), 1.0], [1.0, 1.0], [3.0, 1.0]):
        scaler.scale((p * torch.tensor(grads)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    # cycle 1 overflowed at its boundary: dropped, scale halved; cycle 2 applied with the mean
    # of its two micro-gradients, unscaled at the scale they were taken with
    assert p.detach().tolist() == [-2.0, -1.0]
    assert float(scaler.get_scale()) == 2.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.softmax(self.norm(self.fc1(x)), dim=-1))


@pytest.mark.timeout(30)
def test_o1_autocast_forward_and_custom_black_list() -> None:
    s = DistributedStrategy(amp=True)
    s.amp_configs = {"dtype": "bfloat16"}
    net = wrap_model_features(_Net(), s)
    seen: dict[str, torch.dtype] = {}
    net.fc1.register_forward_hook(lambda m, i, o: seen.__setitem__("fc1", o.dtype))
    out = net(torch.randn(3, 8))
    assert seen["fc1"] == torch.bfloat16 and out.dtype == torch.bfloat16
    assert list(net.state_dict()) == list(_Net().state_dict())  # keys unchanged
    assert wrap_model_features(net, s) is net  # idempotent

    s.amp_configs = {"custom_black_list": ["linear"]}  # linear forced to float32
    net = wrap_model_features(_Net(), s)
    assert net(torch.randn(3, 8)).dtype == torch.float32
    s.amp_configs = {"custom_black_list": [], "custom_white_list": ["softmax"]}
    net2 = _Net()
    got: dict[str, torch.dtype] = {}
    net2.fc2.register_forward_pre_hook(lambda m, a: got.__setitem__("in", a[0].dtype))
    wrap_model_features(net2, s)(torch.randn(3, 8))
    assert got["in"] == torch.bfloat16  # softmax ran (and returned) in bf16


@pytest.mark.timeout(30)
def test_o2_casts_params_and_keeps_float32_master_weights() -> None:
    s = DistributedStrategy(amp=True)
    s.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    torch.manual_seed(0)
    ref = _Net()
    net = _Net()
    net.load_state_dict(ref.state_dict())
    opt = wrap_optimizer_features(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), s)
    net = wrap_model_features(net, s)
    assert isinstance(opt, MasterWeightOptimizer)
    assert net.fc1.weight.dtype == torch.bfloat16 and net.norm.weight.dtype == torch.float32
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        F.mse_loss(net(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    master = opt.master(net.fc1.weight)
    assert master.dtype == torch.float32 and master is not net.fc1.weight
    assert torch.equal(master.to(torch.bfloat16), net.fc1.weight.detach())
    state = opt.state_dict()["state"]
    assert all(v["momentum_buffer"].dtype == torch.float32 for v in state.values())
    # bf16 forward/backward: the float32 masters track the fp32 run closely
    assert (master - ref.fc1.weight).abs().max() < 1e-2


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_fp16_autocast_and_scaler_on_gpu() -> None:
    s = DistributedStrategy(amp=True)
    s.amp_configs = {"dtype": "float16"}
    net = wrap_model_features(_Net().cuda(), s)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = GradScaler.from_config(s.amp_configs)
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(4, 4, device="cuda")
    out = net(x)
    assert out.dtype == torch.float16
    scaler.scale(F.mse_loss(out.float(), y)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.found_inf(opt) is None  # cleared by update
    net.fc1.weight.grad = torch.full_like(net.fc1.weight, float("inf"))
    before = net.fc1.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(before, net.fc1.weight.detach())
