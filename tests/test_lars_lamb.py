"""LARS and LAMB (fleet.meta_optimizers.lars_lamb) step by step against their published update formulas written
out in numpy (float64), including exclude_from_weight_decay by parameter name; the strategy swap
of fleet.parallelize.features.wrap_optimizer_features (Momentum -> LARS, Adam -> LAMB)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from collective.errors import ConfigError
from fleet.meta_optimizers.lars_lamb import LAMB, LARS
from fleet.parallelize.features import wrap_optimizer_features
from fleet.strategy import DistributedStrategy

STEPS = 5


def _params() -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("fc.weight", torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64))),
        ("fc.bias", torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64))),
        ("zero.weight", torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))),
    ]


def _grads(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal((4, 3)), rng.standard_normal(4), rng.standard_normal(3)]


def _norm(a: np.ndarray) -> float:
    return float(np.sqrt((a * a).sum()))


def _lars_numpy(ps, lr, mu, coeff, wd, eps, excluded):
    ps = [p.copy() for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    out = []
    for step in range(STEPS):
        for i, g in enumerate(_grads(step)):
            w = 0.0 if excluded[i] else wd
            pn, gn = _norm(ps[i]), _norm(g)
            local_lr = (
                lr * coeff * pn / (gn + w * pn + eps) if (w > 0 and pn > 0 and gn > 0) else lr
            )
            vs[i] = mu * vs[i] + local_lr * (g + w * ps[i])
            ps[i] = ps[i] - vs[i]
        out.append([p.copy() for p in ps])
    return out


def _lamb_numpy(ps, lr, b1, b2, eps, wd, excluded):
    ps = [p.copy() for p in ps]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    out = []
    for step in range(STEPS):
        t = step + 1
        for i, g in enumerate(_grads(step)):
            w = 0.0 if excluded[i] else wd
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat, v_hat = ms[i] / (1 - b1**t), vs[i] / (1 - b2**t)
            r = m_hat / (np.sqrt(v_hat) + eps) + w * ps[i]
            pn, rn = _norm(ps[i]), _norm(r)
            trust = pn / rn if (pn > 0 and rn > 0) else 1.0
            ps[i] = ps[i] - lr * trust * r
        out.append([p.copy() for p in ps])
    return out


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[list[np.ndarray]]:
    out = []
    for step in range(STEPS):
        for p, g in zip(params, _grads(step)):
            p.grad = torch.from_numpy(g)
        opt.step()
        out.append([p.detach().numpy().copy() for p in params])
    return out


def _assert_close(ours, ref) -> None:
    for step, (a, b) in enumerate(zip(ours, ref)):
        for i, (x, y) in enumerate(zip(a, b)):
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12, err_msg=f"step {step} p{i}")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("exclude", [(), ("bias",)])
def test_lars_matches_the_lars_momentum_formula(exclude) -> None:
    named = _params()
    init = [p.detach().numpy().copy() for _, p in named]
    opt = LARS(
        named,
        lr=0.1,
        momentum=0.9,
        lars_coeff=0.01,
        lars_weight_decay=0.001,
        epsilon=1e-8,
        exclude_from_weight_decay=exclude,
    )
    ours = _run(opt, [p for _, p in named])
    excluded = [any(e in n for e in exclude) for n, _ in named]
    _assert_close(ours, _lars_numpy(init, 0.1, 0.9, 0.01, 0.001, 1e-8, excluded))
    # the trust ratio really scales the step: it differs from plain momentum SGD
    assert not np.allclose(
        ours[0][0], _lars_numpy(init, 0.1, 0.9, 0.01, 0.0, 1e-8, [True] * 3)[0][0]
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("exclude", [(), ("bias", "zero")])
def test_lamb_matches_the_published_update_with_bias_correction(exclude) -> None:
    named = _params()
    init = [p.detach().numpy().copy() for _, p in named]
    opt = LAMB(
        named,
        lr=0.01,
        betas=(0.9, 0.99),
        eps=1e-6,
        lamb_weight_decay=0.02,
        exclude_from_weight_decay=exclude,
    )
    ours = _run(opt, [p for _, p in named])
    excluded = [any(e in n for e in exclude) for n, _ in named]
    _assert_close(ours, _lamb_numpy(init, 0.01, 0.9, 0.99, 1e-6, 0.02, excluded))


@pytest.mark.timeout(30)
def test_names_from_the_fleet_name_attribute_and_state_dict_round_trip() -> None:
    named = _params()
    for name, p in named:
        p.fleet_name = name
    opt = LAMB(
        [p for _, p in named], lr=0.01, lamb_weight_decay=0.1, exclude_from_weight_decay=("bias",)
    )
    assert [opt.excluded(p, ("bias",)) for _, p in named] == [False, True, False]
    _run(opt, [p for _, p in named])
    again = LAMB([p for _, p in named], lr=0.01)
    again.load_state_dict(opt.state_dict())
    assert again.state[named[0][1]]["step"] == STEPS


@pytest.mark.timeout(30)
def test_strategy_swaps_momentum_for_lars_and_adam_for_lamb() -> None:
    model = torch.nn.Linear(3, 2)
    s = DistributedStrategy(lars=True)
    s.lars_configs = {"lars_coeff": 0.002, "exclude_from_weight_decay": ["bias"]}
    lars = wrap_optimizer_features(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.8), s)
    assert isinstance(lars, LARS)
    assert lars.param_groups[0]["lr"] == 0.5 and lars.param_groups[0]["momentum"] == 0.8
    assert lars.param_groups[0]["lars_coeff"] == 0.002
    s = DistributedStrategy(lamb=True)
    s.lamb_configs = {"lamb_weight_decay": 0.03}
    lamb = wrap_optimizer_features(
        torch.optim.Adam(model.parameters(), lr=0.2, betas=(0.8, 0.9), eps=1e-5), s
    )
    assert isinstance(lamb, LAMB)
    g = lamb.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["lamb_weight_decay"]) == (0.2, (0.8, 0.9), 1e-5, 0.03)
    with pytest.raises(ConfigError, match="LARS wraps a momentum SGD"):
        wrap_optimizer_features(
            torch.optim.Adam(model.parameters()), DistributedStrategy(lars=True)
        )
    with pytest.raises(ConfigError, match="LAMB wraps an Adam"):
        wrap_optimizer_features(
            torch.optim.SGD(model.parameters(), lr=0.1), DistributedStrategy(lamb=True)
        )
    with pytest.raises(ConfigError, match="both"):
        wrap_optimizer_features(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            DistributedStrategy(lars=True, lamb=True),
        )


@pytest.mark.timeout(30)
def test_bad_hyper_parameters_name_the_key() -> None:
    with pytest.raises(ConfigError, match="lars_coeff"):
        LARS([torch.nn.Parameter(torch.zeros(2))], lars_coeff=0.0)
    with pytest.raises(ConfigError, match="betas"):
        LAMB([torch.nn.Parameter(torch.zeros(2))], betas=(1.0, 0.9))
