"""Fixture worker for tests/test_fleet_metrics.py: every ``fleet.metrics`` function over real
trainers, checked against the single-process value on the union of all trainers' data.

Every rank generates the same global dataset (seeded) and takes an *uneven* contiguous share
(rank r gets a share proportional to r + 1), so averaging per-rank metrics would give a wrong
answer. One run checks every metric, a sub-group, and that an invalid input on one rank raises
ConfigError on every rank (instead of leaving the others blocked in a collective). Prints
``rank R: OK <check>`` per check and ``rank R: ALL OK`` at the end; a wrong value fails with an
AssertionError naming the check, rank and values.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as tdist

import fleet
from collective.errors import ConfigError

RANK = 0
WORLD = 1
NUM_EXAMPLES = 20_000


def ok(check: str) -> None:
    print(f"rank {RANK}: OK {check}", flush=True)


def close(check: str, got: float, want: float, tol: float) -> None:
    assert isinstance(got, float), f"{check} on rank {RANK}: got {type(got).__name__}, not float"
    assert abs(got - want) <= tol, f"{check} on rank {RANK} of {WORLD}: got {got!r}, want {want!r}"


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Rank-based (Mann-Whitney) AUC, ties counting one half."""
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size)
    i = 0
    while i < scores.size:  # average rank over each run of ties
        j = i
        while j + 1 < scores.size and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    pos = labels == 1
    num_pos, num_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def single_process_auc(state: fleet.metrics.AucState) -> float:
    """Paddle's AUC loop on this process's histograms alone (AucState.auc() is a collective)."""
    area = pos = neg = 0.0
    for index in range(state.num_buckets - 1, -1, -1):
        new_pos = pos + state.stat_pos[index]
        new_neg = neg + state.stat_neg[index]
        area += (new_neg - neg) * (pos + new_pos) / 2
        pos, neg = new_pos, new_neg
    return 0.5 if pos * neg == 0 else float(area / (pos * neg))


def global_data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2024)
    x = rng.standard_normal(NUM_EXAMPLES)
    labels = (rng.random(NUM_EXAMPLES) < 1 / (1 + np.exp(-2.0 * x))).astype(np.int64)
    preds = 1 / (1 + np.exp(-(1.5 * x + 0.5 * rng.standard_normal(NUM_EXAMPLES))))
    preds = np.round(preds, 3)  # some exact ties
    return {"preds": preds, "labels": labels, "y": rng.standard_normal(NUM_EXAMPLES)}


def my_slice(n: int, rank: int, world: int) -> slice:
    """Rank r's contiguous share, proportional to r + 1."""
    weights = np.arange(1, world + 1)
    bounds = np.concatenate([[0], np.cumsum(weights)]) * n // weights.sum()
    return slice(int(bounds[rank]), int(bounds[rank + 1]))


def check_auc(data: dict[str, np.ndarray]) -> None:
    mine = my_slice(NUM_EXAMPLES, RANK, WORLD)
    local = fleet.metrics.AucState()
    # half the batches as torch tensors, half as numpy: both are accepted
    half = (mine.start + mine.stop) // 2
    local.update(
        torch.tensor(data["preds"][mine.start : half]),
        torch.tensor(data["labels"][mine.start : half]),
    )
    local.update(data["preds"][half : mine.stop], data["labels"][half : mine.stop])
    whole = fleet.metrics.AucState()
    whole.update(data["preds"], data["labels"])
    want = single_process_auc(whole)
    got = fleet.metrics.auc(local.stat_pos, local.stat_neg)
    close("auc vs single-process bucketed", got, want, 1e-6)
    close("auc vs exact", got, exact_auc(data["preds"], data["labels"]), 0.01)
    close("AucState.auc", local.auc(), want, 1e-6)
    # Paddle's [1, num_buckets] layout, as torch tensors
    got = fleet.metrics.auc(
        torch.tensor(local.stat_pos[None, :]), torch.tensor(local.stat_neg[None, :])
    )
    close("auc [1, n] tensors", got, want, 1e-6)
    mine_auc = exact_auc(data["preds"][mine], data["labels"][mine])
    assert abs(mine_auc - want) > 1e-4, f"rank {RANK}: shard AUC equals the global one; weak test"
    ok("auc")


def check_ratio_metrics(data: dict[str, np.ndarray]) -> None:
    mine = my_slice(NUM_EXAMPLES, RANK, WORLD)
    p, y, t = data["preds"], data["labels"], data["y"]

    def correct(s: slice) -> int:
        return int(((p[s] > 0.5) == (y[s] == 1)).sum())

    err = p - t
    everything = slice(0, NUM_EXAMPLES)
    n_mine = mine.stop - mine.start
    close(
        "acc", fleet.metrics.acc(correct(mine), n_mine), correct(everything) / NUM_EXAMPLES, 1e-12
    )
    close(
        "acc np[1]",
        fleet.metrics.acc(np.array([correct(mine)]), np.array([n_mine])),
        correct(everything) / NUM_EXAMPLES,
        1e-12,
    )
    close(
        "mae",
        fleet.metrics.mae(torch.tensor(np.abs(err[mine]).sum()), n_mine),
        float(np.abs(err).mean()),
        1e-9,
    )
    close(
        "mse",
        fleet.metrics.mse(float((err[mine] ** 2).sum()), n_mine),
        float((err**2).mean()),
        1e-9,
    )
    close(
        "rmse",
        fleet.metrics.rmse(float((err[mine] ** 2).sum()), n_mine),
        math.sqrt(float((err**2).mean())),
        1e-9,
    )
    # a rank with no instances of its own is fine as long as the global total is not 0
    close(
        "acc with an empty rank",
        fleet.metrics.acc(0 if RANK == 0 else 1, 0 if RANK == 0 else 2),
        0.5,
        1e-12,
    )
    ok("acc/mae/mse/rmse")


def check_elementwise() -> None:
    ranks = np.arange(WORLD)
    got = fleet.metrics.sum(np.array([RANK, 10 * RANK, 1]))
    assert isinstance(got, np.ndarray) and got.dtype == np.int64, (got, type(got))
    assert got.tolist() == [int(ranks.sum()), int(10 * ranks.sum()), WORLD], got
    got = fleet.metrics.max(torch.tensor([[RANK + 0.5, -RANK]], dtype=torch.float32))
    assert got.dtype == np.float64 and got.shape == (1, 2), got
    assert got.tolist() == [[WORLD - 0.5, 0.0]], got
    got = fleet.metrics.min(np.array([RANK, -RANK], dtype=np.float32))
    assert got.tolist() == [0.0, -(WORLD - 1)], got
    got = fleet.metrics.sum(RANK + 1)
    assert isinstance(got, float) and got == WORLD * (WORLD + 1) / 2, got
    got = fleet.metrics.max(float(RANK))
    assert isinstance(got, float) and got == WORLD - 1, got
    ok("sum/max/min")


def check_group(data: dict[str, np.ndarray]) -> None:
    group = tdist.new_group([0, 1])  # every rank must call new_group
    if RANK > 1:
        try:
            fleet.metrics.acc(1, 2, group=group)
        except ConfigError as exc:
            assert exc.key == "group" and "not a member" in str(exc), exc
        else:
            raise AssertionError(f"rank {RANK}: a metric over a group it is not in did not raise")
        ok("group")
        return
    first_two = slice(0, my_slice(NUM_EXAMPLES, 1, WORLD).stop)
    local = fleet.metrics.AucState()
    mine = my_slice(NUM_EXAMPLES, RANK, WORLD)
    local.update(data["preds"][mine], data["labels"][mine])
    reference = fleet.metrics.AucState()
    reference.update(data["preds"][first_two], data["labels"][first_two])
    close("auc over group [0, 1]", local.auc(group=group), single_process_auc(reference), 1e-6)
    got = fleet.metrics.sum(np.array([1.0]), group=group)
    assert got.tolist() == [2.0], got
    ok("group")


def expect_config_error(check: str, call, key: str, text: str) -> None:
    try:
        call()
    except ConfigError as exc:
        assert exc.key == key and text in str(exc), f"{check} on rank {RANK}: {exc!r}"
    else:
        raise AssertionError(f"{check} on rank {RANK}: no ConfigError")


def check_errors_on_every_rank() -> None:
    pos, neg = np.ones(16, dtype=np.int64), np.ones(16, dtype=np.int64)
    # rank 1 alone passes a negative count: it names its own argument, the others name rank 1
    bad_pos = pos.copy()
    if RANK == 1:
        bad_pos[3] = -2
    want = ">= 0" if RANK == 1 else "invalid on rank 1"
    expect_config_error("negative count", lambda: fleet.metrics.auc(bad_pos, neg), "stat_pos", want)
    # rank 0 alone passes fewer buckets
    short = 8 if RANK == 0 else 16
    expect_config_error(
        "bucket count mismatch",
        lambda: fleet.metrics.auc(pos[:short], neg[:short]),
        "stat_pos",
        "different sizes",
    )
    # rank 0 alone passes integers
    values = np.array([1, 2]) if RANK == 0 else np.array([1.0, 2.0])
    expect_config_error(
        "dtype mismatch", lambda: fleet.metrics.sum(values), "input", "integers and others floats"
    )
    # a global total of zero
    expect_config_error("zero total", lambda: fleet.metrics.acc(0, 0), "total", "is 0")
    expect_config_error(
        "empty histograms", lambda: fleet.metrics.auc(pos * 0, neg * 0), "stat_pos", "all zero"
    )
    # the group still works after all of that
    assert fleet.metrics.sum(1.0) == float(WORLD)
    ok("errors raise on every rank")


def main() -> None:
    global RANK, WORLD
    fleet.init(is_collective=True)
    RANK, WORLD = fleet.worker_index(), fleet.worker_num()
    data = global_data()
    check_auc(data)
    check_ratio_metrics(data)
    check_elementwise()
    check_group(data)
    check_errors_on_every_rank()
    tdist.barrier()
    print(f"rank {RANK}: ALL OK", flush=True)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
