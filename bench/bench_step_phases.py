"""Overhead of the step-time breakdown: ``fleet.train_from_dataset`` against the same loop untimed.

``fleet.train_from_dataset`` times each phase of every step (data, pull wait, forward, backward,
push/optimizer, other: about ten ``perf_counter`` reads, the pull-wait and data hooks, one
:class:`fleet.telemetry.PhaseTimer` add, and with metrics on six histogram observations). The
peer is :func:`untimed_loop`: the same loop body without any of it (the function as it was
before the breakdown), over the same batches, model, communicator and optimizer.

The step is a small PS-style CTR step of a few ms on one CPU thread: two sparse slots pulled
through a real :class:`fleet.ps.communicator.Communicator` (its client a local in-memory table,
so the pull-wait hook runs on every step), an ``EmbeddingBag`` + MLP forward, BCE loss,
backward, Adam. Interleaved A/B: each round runs both loops (order alternating) for
``--steps`` steps, with metrics off and on (``fleet.telemetry.start``); per loop the mean step
time of the round, on this thread's CPU clock (what a loaded machine does not stretch) and on
the wall clock. Printed: median [min .. max] per variant, the ratio of medians and the paired
median of per-round ratios, and the per-step cost of the timing code itself (a tight loop over
the same calls, ``--cost_reps`` times) as a share of the step: goal <= 1 %. On a loaded machine
the A/B rows spread by more than the goal; the share is the figure that resolves it. Usage::

    python bench/bench_step_phases.py [--rounds 15] [--steps 60] [--batch 128] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
from common import Stats, report

import fleet
import fleet.telemetry as telemetry
from fleet import metrics, train_loop
from fleet.base import lookahead
from fleet.ps.communicator import Communicator
from fleet.train_loop import loss_target, positive_scores

ROWS, DIM, SLOTS = 20000, 16, 2
CLOCKS = ("cpu", "wall")


class LocalTable:
    """A PS client over one in-memory table (a pull is a gather, as a server's would be)."""

    def __init__(self) -> None:
        self.rows = np.random.default_rng(0).normal(0, 0.01, (ROWS, DIM)).astype(np.float32)

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        return self.rows[keys % ROWS]


class CTR(torch.nn.Module):
    """Sparse slots pulled through the communicator, pooled, concatenated with dense, MLP."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        self.proj = torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(SLOTS * DIM + 8, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 1),
        )

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        pooled = []
        for s in range(SLOTS):
            ids = batch[f"s{s}"]
            keys, inverse = np.unique(ids, return_inverse=True)
            rows = torch.from_numpy(self.comm.pull_sparse("emb", keys))
            picked = rows[torch.from_numpy(inverse.reshape(-1))].view(ids.shape[0], -1, DIM)
            pooled.append(self.proj(picked).sum(1))
        return self.mlp(torch.cat([*pooled, batch["dense"]], dim=1))


def make_batches(n: int, batch: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        dense = torch.from_numpy(rng.normal(size=(batch, 8)).astype(np.float32))
        b = {f"s{s}": rng.integers(0, ROWS * 4, (batch, 3)) for s in range(SLOTS)}
        b["dense"] = dense
        b["click"] = (dense[:, :1] > 0).float()
        out.append(b)
    return out


def untimed_loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Iterable[Mapping[str, Any]],
    loss_fn: Any,
    label: str,
    print_period: int,
) -> int:
    """``train_from_dataset`` without the phase timing (the peer): the same set-up, loop body
    and end of pass (the AUCs)."""
    train_loop._dataset_size(dataset)
    train_loop._trainer_rank()
    state = metrics.AucState()
    model.train()
    steps = 0
    loss_sum = 0.0
    for batch in lookahead.batches(dataset):
        inputs = {k: v for k, v in batch.items() if k != label}
        output = model(inputs)
        target = loss_target(loss_fn, output, batch[label], label)
        loss = loss_fn(output, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        size = int(target.shape[0])
        value = float(loss.detach())
        steps += 1
        loss_sum += value
        telemetry.report(loss=value, samples=size, step=True)
        preds = positive_scores(output, True)
        state.update(preds, target.detach().reshape(-1))
        if steps % print_period == 0:
            train_loop._local_auc(state)
    train_loop._local_auc(state)
    train_loop._global_auc(state)
    return steps


def run(timed: bool, batches: list[dict[str, Any]], model: CTR, opt: Any) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per step of one pass (CPU: this thread's clock, which a
    loaded machine does not stretch the way it stretches wall time)."""
    loss_fn = torch.nn.BCEWithLogitsLoss()
    c0, t0 = time.thread_time(), time.perf_counter()
    if timed:
        stats = fleet.train_from_dataset(
            model, opt, batches, loss_fn, label="click", print_period=50, out=_Sink()
        )
        n = stats.steps
    else:
        n = untimed_loop(model, opt, batches, loss_fn, "click", 50)
    return (time.thread_time() - c0) / n, (time.perf_counter() - t0) / n


class _Sink:
    """Progress lines go nowhere (the untimed loop prints nothing either)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def timing_cost_per_step(n: int = 20000) -> float:
    """Seconds per step of the timing code alone: train_from_dataset's clock reads and
    snapshots, one PhaseTimer.add, the pull-wait wrapper's clock reads (SLOTS pulls) and the
    lookahead's data hook, in a tight loop."""
    clock = time.perf_counter
    timer = telemetry.PhaseTimer()
    wrapped = SLOTS * 2 + 2  # pull-wait wrapper: 2 reads per pull; data hook: 2 reads
    with timer:
        t0 = clock()
        for _ in range(n):
            t_step = clock()
            pulled = telemetry.pull_wait_seconds()
            ended = telemetry.steps_ended()
            t_forward = clock()
            pull_wait = telemetry.pull_wait_seconds() - pulled
            t_backward = clock()
            t_optimizer = clock()
            _ = telemetry.steps_ended() == ended
            for _ in range(wrapped):
                clock()
            t_end = clock()
            timer.add(
                t_step - t_step,
                pull_wait,
                t_forward - t_step,
                t_backward - t_forward,
                t_optimizer - t_backward,
                t_end - t_optimizer,
            )
        return (clock() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--cost_reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    comm = Communicator(LocalTable(), 1, lambda: None)
    model = CTR(comm)
    opt = torch.optim.Adam(model.parameters(), lr=0.001)
    batches = make_batches(args.steps, args.batch)
    for timed in (False, True):  # warm-up
        run(timed, batches[:20], model, opt)
    # (clock, metrics on, timed) -> seconds per step, one value per round
    times: dict[tuple[str, bool, bool], list[float]] = {
        (c, m, t): [] for c in CLOCKS for m in (False, True) for t in (False, True)
    }
    for r in range(args.rounds):
        for metrics_on in (False, True):
            if metrics_on:
                telemetry.start(0)
            try:
                for timed in (False, True) if r % 2 == 0 else (True, False):
                    for clock, v in zip(CLOCKS, run(timed, batches, model, opt)):
                        times[(clock, metrics_on, timed)].append(v)
            finally:
                if metrics_on:
                    telemetry.stop()
        print(
            f"round {r}: "
            + ", ".join(
                f"metrics {'on' if m else 'off'} timed/untimed "
                f"{times[('cpu', m, True)][-1] * 1e3:.3f}/{times[('cpu', m, False)][-1] * 1e3:.3f}"
                f" ms cpu"
                for m in (False, True)
            ),
            flush=True,
        )
    costs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.cost_reps):
        costs[False].append(timing_cost_per_step())
        telemetry.start(0)  # with metrics on, PhaseTimer.add observes six histograms
        try:
            costs[True].append(timing_cost_per_step())
        finally:
            telemetry.stop()
    cost = {m: statistics.median(costs[m]) for m in (False, True)}
    step = statistics.median(times[("cpu", False, False)])

    def paired(clock: str, m: bool) -> float:
        a, b = times[(clock, m, True)], times[(clock, m, False)]
        return statistics.median(x / y for x, y in zip(a, b))

    extra = {
        "paired_ratio_median": {
            f"{c}, metrics {'on' if m else 'off'}": paired(c, m) for c in CLOCKS for m in (0, 1)
        },
        "timing_code_seconds_per_step": {str(m): cost[m] for m in (False, True)},
        "timing_code_share_of_cpu_step": {str(m): cost[m] / step for m in (False, True)},
    }
    rows = [
        (
            f"step time ({c}), train_from_dataset (phases timed) vs the same loop untimed, "
            f"metrics {'on' if m else 'off'} ({args.steps} steps x {args.rounds} rounds, "
            f"batch {args.batch})",
            Stats.of(times[(c, m, True)]),
            Stats.of(times[(c, m, False)]),
            "timed/untimed",
        )
        for c in CLOCKS
        for m in (False, True)
    ] + [
        (
            f"timing code per step vs the untimed step (cpu), metrics {'on' if m else 'off'}",
            Stats.of(costs[m]),
            Stats.of(times[("cpu", False, False)]),
            "share of the step",
        )
        for m in (False, True)
    ]
    report("Step-time breakdown overhead", rows, "<= 1 % of the step", extra, json_path=args.json)
    for c in CLOCKS:
        for m in (False, True):
            print(
                f"{c}, metrics {'on' if m else 'off'}: paired median of per-round ratios "
                f"{paired(c, m):.4f}"
            )
    for m in (False, True):
        print(
            f"timing code alone, metrics {'on' if m else 'off'}: {cost[m] * 1e6:.2f} us/step = "
            f"{100 * cost[m] / step:.3f} % of a {step * 1e3:.2f} ms (cpu) step"
        )


if __name__ == "__main__":
    main()
