"""fleet.metrics: distributed metrics equal to the single-process metric of the union of the data.

The multi-process checks run tests/scripts/fleet_metrics.py once per world size (2 and 3) on real
gloo process groups; the rest are single-process unit tests of the formulas and the errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import SCRIPTS, assert_all_ok, run_workers

from collective.errors import ConfigError
from fleet import metrics

FIXTURE = SCRIPTS / "fleet_metrics.py"
CHECKS = ["auc", "acc/mae/mse/rmse", "sum/max/min", "group", "errors raise on every rank"]


def paddle_auc(stat_pos: np.ndarray, stat_neg: np.ndarray) -> float:
    """Paddle's fleet.metrics.auc loop, transcribed (the reference for the vectorised one)."""
    area = pos = neg = 0.0
    for index in range(len(stat_pos) - 1, -1, -1):
        new_pos = pos + stat_pos[index]
        new_neg = neg + stat_neg[index]
        area += (new_neg - neg) * (pos + new_pos) / 2
        pos, neg = new_pos, new_neg
    return 0.5 if pos * neg == 0 else area / (pos * neg)


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Rank-based AUC by brute force over all pairs (small inputs only)."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_metrics_over_trainers_equal_the_union(world: int, tmp_path) -> None:
    results = run_workers(FIXTURE, world, timeout=150, tmp_path=tmp_path)
    assert_all_ok(results)
    for r in results:
        for check in CHECKS:
            assert f"rank {r.rank}: OK {check}\n" in r.output, r.output
        assert f"rank {r.rank}: ALL OK" in r.output


# --- AUC -----------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_auc_matches_paddles_loop_and_the_exact_auc() -> None:
    rng = np.random.default_rng(0)
    scores = rng.random(3000)
    labels = (rng.random(3000) < scores).astype(np.int64)
    state = metrics.AucState()
    state.update(scores, labels)
    got = metrics.auc(state.stat_pos, state.stat_neg)
    assert got == pytest.approx(paddle_auc(state.stat_pos, state.stat_neg), abs=1e-12)
    assert got == pytest.approx(exact_auc(scores, labels), abs=1e-3)
    assert state.auc() == got and state.num_instances == 3000


@pytest.mark.timeout(30)
def test_auc_edge_values() -> None:
    state = metrics.AucState(num_buckets=4)
    state.update([0.0, 0.1, 0.9, 1.0], [0, 0, 1, 1])
    assert state.stat_neg.tolist() == [2, 0, 0, 0] and state.stat_pos.tolist() == [0, 0, 1, 1]
    assert state.auc() == 1.0
    state.reset()
    state.update(np.array([0.9, 1.0]), np.array([0, 0]))
    state.update(np.array([0.0]), np.array([1]))
    assert state.auc() == 0.0
    # every prediction in one bucket: all pairs tie
    assert metrics.auc([0, 5, 0], [0, 7, 0]) == 0.5
    # one class only: 0.5, as Paddle
    assert metrics.auc([1, 2, 3], [0, 0, 0]) == 0.5
    # Paddle's [1, n] histograms, torch tensors, bool labels, [N, 2] and [N, 1] predictions
    assert metrics.auc(torch.tensor([[0, 1]]), torch.tensor([[1, 0]])) == 1.0
    state = metrics.AucState(num_buckets=16)
    state.update(torch.tensor([[0.7, 0.3], [0.2, 0.8]]), torch.tensor([[False], [True]]))
    assert state.auc() == 1.0
    # AMP outputs: bfloat16 / float16 predictions that still require grad
    logits = torch.tensor([2.0, -1.0, 0.5], requires_grad=True)
    state.update(torch.sigmoid(logits).bfloat16(), torch.tensor([1, 0, 1]))
    state.update(torch.sigmoid(logits).half(), np.array([1.0, 0.0, 1.0]))
    assert state.num_instances == 8 and state.auc() == 1.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("call", "key", "text"),
    [
        (lambda: metrics.auc([0, 0], [0, 0]), "stat_pos", "all zero"),
        (lambda: metrics.auc([1, -1], [0, 1]), "stat_pos", ">= 0"),
        (lambda: metrics.auc([1, 1], [0, float("nan")]), "stat_neg", "not NaN"),
        (lambda: metrics.auc([1, 1], [0, 1, 2]), "stat_neg", "same number of buckets"),
        (lambda: metrics.auc(np.ones((2, 4)), np.ones((2, 4))), "stat_pos", "[1, num_buckets]"),
        (lambda: metrics.auc([], []), "stat_pos", "shape"),
        (lambda: metrics.auc("abc", [1]), "stat_pos", "expected a number"),
        (lambda: metrics.AucState(1), "num_buckets", "int >= 2"),
        (lambda: metrics.AucState().update([0.5, 1.5], [0, 1]), "preds", "sigmoid"),
        (lambda: metrics.AucState().update([0.5, float("nan")], [0, 1]), "preds", "[0, 1]"),
        (lambda: metrics.AucState().update([0.5, 0.5], [0, 2]), "labels", "0 or 1"),
        (lambda: metrics.AucState().update([0.5, 0.5], [0, 1, 1]), "labels", "same N"),
        (lambda: metrics.auc([1], [1], group=object()), "group", "not initialised"),
    ],
)
def test_auc_errors_name_the_argument(call, key: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.key == key and text in str(info.value)


# --- ratio metrics -------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_ratio_metrics_single_process() -> None:
    assert metrics.acc(3, 4) == 0.75
    assert metrics.acc(np.array([3]), torch.tensor([4])) == 0.75
    assert metrics.acc(torch.tensor(0), 5) == 0.0
    assert metrics.mae(6.0, 4) == 1.5
    assert metrics.mse(np.float32(8.0), np.int64(4)) == 2.0
    assert metrics.rmse(8.0, 2) == 2.0
    for value in (metrics.acc(1, 2), metrics.mae(1, 2), metrics.mse(1, 2), metrics.rmse(1, 2)):
        assert type(value) is float


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("call", "key", "text"),
    [
        (lambda: metrics.acc(0, 0), "total", "is 0"),
        (lambda: metrics.mae(0.0, 0), "total_ins_num", "is 0"),
        (lambda: metrics.rmse(1.0, 0), "total_ins_num", "is 0"),
        (lambda: metrics.acc(5, 4), "correct", "more than total"),
        (lambda: metrics.acc(-1, 4), "correct", ">= 0"),
        (lambda: metrics.mse(-0.5, 4), "sqrerr", ">= 0"),
        (lambda: metrics.mae(1.0, -4), "total_ins_num", ">= 0"),
        (lambda: metrics.acc(np.array([1, 2]), 4), "correct", "one number"),
        (lambda: metrics.acc("3", 4), "correct", "expected a number"),
        (lambda: metrics.mse(1 + 2j, 4), "sqrerr", "dtype complex"),
    ],
)
def test_ratio_errors_name_the_argument(call, key: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.key == key and text in str(info.value)


# --- sum / max / min -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_elementwise_single_process_types() -> None:
    got = metrics.sum(np.array([1, 2], dtype=np.int32))
    assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.tolist() == [1, 2]
    got = metrics.max(torch.tensor([[1.5, -2.0]]))
    assert got.dtype == np.float64 and got.shape == (1, 2) and got.tolist() == [[1.5, -2.0]]
    assert metrics.min(np.array([True, False])).tolist() == [1, 0]
    assert metrics.sum(3) == 3.0 and type(metrics.sum(3)) is float
    assert type(metrics.max(torch.tensor(2.5))) is float
    with pytest.raises(ConfigError) as info:
        metrics.min(["a", "b"])
    assert info.value.key == "input"


@pytest.mark.timeout(30)
def test_module_names_shadow_builtins_only_in_the_module() -> None:
    # Paddle's names are there and are ours; the builtins are untouched
    assert metrics.sum is not sum and metrics.max is not max and metrics.min is not min
    assert sum([1, 2]) == 3 and max(1, 2) == 2 and min(1, 2) == 1
    assert set(metrics.__all__) >= {
        "auc",
        "acc",
        "mae",
        "mse",
        "rmse",
        "sum",
        "max",
        "min",
        "AucState",
    }
    # fleet exposes it lazily
    import fleet

    assert fleet.metrics is metrics
    assert math.isclose(fleet.metrics.rmse(18.0, 2), 3.0)
