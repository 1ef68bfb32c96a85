"""fleet.train_from_dataset over batches shaped like fleet.data's (slot name -> dense tensor or
jagged sparse slot), single process: it trains, prints progress lines, and names a missing
label slot."""

from __future__ import annotations

import io
import time
import urllib.request
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import fleet
from collective.errors import ConfigError


class _Sized(list):
    """A dataset that knows its size, as InMemoryDataset does (progress bar)."""

    def get_memory_data_size(self) -> int:
        return sum(int(b["click"].shape[0]) for b in self)


def _batches(n: int, size: int = 32, seed: int = 0) -> _Sized:
    gen = torch.Generator().manual_seed(seed)
    out = _Sized()
    for _ in range(n):
        dense = torch.randn(size, 4, generator=gen)
        lengths = torch.randint(0, 3, (size,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        values = torch.randint(0, 50, (int(offsets[-1]),), generator=gen)
        click = (dense[:, :1] > 0).float()  # learnable from the dense slot
        out.append(
            {"dense": dense, "ids": SimpleNamespace(values=values, offsets=offsets), "click": click}
        )
    return out


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(50, 4, mode="sum")
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, batch: dict) -> torch.Tensor:
        ids = batch["ids"]
        pooled = self.bag(ids.values, ids.offsets[:-1])
        return self.fc(torch.cat([batch["dense"], pooled], dim=1))


@pytest.mark.timeout(60)
def test_trains_and_prints_progress() -> None:
    torch.manual_seed(0)
    model = _Model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    data = _batches(40)
    out = io.StringIO()
    stats = fleet.train_from_dataset(
        model, opt, data, torch.nn.BCEWithLogitsLoss(), label="click", print_period=10, out=out
    )
    assert stats.steps == 40 and stats.examples == 40 * 32
    assert stats.auc > 0.75 and stats.local_auc == stats.auc  # single process: local = global
    lines = out.getvalue().splitlines()
    # per period: the progress line, then the step-time line; at the end: done, whole pass
    assert len(lines) == 10 and lines[-2].startswith("[train] done: 40 batches")
    assert lines[-1].startswith("[train] step-time (whole pass): data ")
    progress, shares = lines[0:8:2], lines[1:8:2]
    assert all(s.startswith("[train] step-time: data ") and "ms/step)" in s for s in shares)
    assert "[####################] 100.0%" in progress[3] and "ex/s" in progress[0]
    first = float(progress[0].split("loss ")[1].split()[0])
    last = float(progress[3].split("loss ")[1].split()[0])
    assert last < first
    assert set(stats.phase_seconds) == {
        "data",
        "pull_wait",
        "forward",
        "backward",
        "push_optimizer",
        "other",
    }


@pytest.mark.timeout(60)
def test_fetch_max_steps_and_bad_arguments() -> None:
    model = _Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = io.StringIO()
    stats = fleet.train_from_dataset(
        model,
        opt,
        _batches(10),
        torch.nn.BCEWithLogitsLoss(),
        label="click",
        print_period=2,
        max_steps=4,
        out=out,
        fetch={"mean_out": lambda o, b, loss: f"{float(o.detach().mean()):.3f}"},
    )
    assert stats.steps == 4
    assert out.getvalue().count("mean_out ") == 2
    with pytest.raises(ConfigError, match="no slot 'label'.*'click'"):
        fleet.train_from_dataset(model, opt, _batches(1), torch.nn.BCEWithLogitsLoss(), out=out)
    with pytest.raises(ConfigError, match="print_period"):
        fleet.train_from_dataset(
            model, opt, _batches(1), torch.nn.BCEWithLogitsLoss(), label="click", print_period=0
        )


@pytest.mark.timeout(120)
def test_only_trainer_0_prints_without_a_process_group() -> None:
    """Async PS trainers meeting through fleetrun's coordinator (a real one, two real trainer
    processes) form no torch.distributed group: the rank that decides who prints is fleet's
    worker index, so trainer 1 prints no progress lines."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import REPO, base_env

    from launcher.recovery.coordinator import Coordinator

    tests = Path(__file__).parent
    coord = Coordinator("secret", world=2, interval_s=3600.0)
    procs = []
    try:
        for rank in (0, 1):
            env = {
                **base_env(),
                "TRAINING_ROLE": "TRAINER",
                "PADDLE_TRAINER_ID": str(rank),
                "PADDLE_TRAINERS_NUM": "2",
                "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:1",
                "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:2,127.0.0.1:3",
                "FLEET_PS_COORDINATOR": coord.endpoint,
                "FLEET_PS_TOKEN": "secret",
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(tests / "scripts" / "train_loop_trainer.py"), str(tests)],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, 9)
                p.wait()
        coord.close()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"trainer {rank} done" in out, err[-3000:]
    assert "[train] done: 10 batches" in outs[0][1], outs[0][1][-3000:]
    assert "[train]" not in outs[1][1], outs[1][1][-3000:]


class _TwoClass(_Model):
    """The same model with two class logits (softmax cross-entropy, as Paddle's CTR nets)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 2)


@pytest.mark.timeout(60)
def test_an_int64_label_slot_feeds_bce_and_cross_entropy_and_clashes_are_named() -> None:
    """A dense label slot is int64 [B, 1] by default (``Slot("click", dense=True)``): BCE-style
    losses get it as float shaped like the output, cross-entropy as int64 [B]; the AUC takes
    one logit or two class logits; a custom loss that cannot take the dtype names the slot."""
    data = _batches(30)
    for b in data:
        b["click"] = b["click"].to(torch.int64)
    torch.manual_seed(0)
    model = _Model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    out = io.StringIO()
    stats = fleet.train_from_dataset(
        model, opt, data, torch.nn.BCEWithLogitsLoss(), label="click", out=out
    )
    assert stats.steps == 30 and stats.auc > 0.75
    torch.manual_seed(0)
    two = _TwoClass()
    opt = torch.optim.Adam(two.parameters(), lr=0.05)
    stats = fleet.train_from_dataset(
        two, opt, data, torch.nn.CrossEntropyLoss(), label="click", out=out
    )
    assert stats.steps == 30 and stats.auc > 0.75  # softmax of the second class

    def custom(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.binary_cross_entropy_with_logits(output, target)

    with pytest.raises(ConfigError, match=r"label slot 'click' \(torch.int64\).*dtype="):
        fleet.train_from_dataset(model, opt, data, custom, label="click", out=out)
    fractional = [{**b, "click": b["click"].float() * 0.5} for b in data[:1]]
    with pytest.raises(ConfigError, match="not whole numbers"):
        fleet.train_from_dataset(
            two, opt, fractional, torch.nn.CrossEntropyLoss(), label="click", out=out
        )


# -- the step-time breakdown on a scripted step ---------------------------------------------------
# Test doubles of the user's code (and of a PS server), each sleeping a known time; fleet's own
# loop, communicator and telemetry run for real.
DATA_S, PULL_S, FWD_S, BWD_S, OPT_S, OTHER_S = 0.010, 0.006, 0.008, 0.012, 0.006, 0.004


class _SlowData:
    """A dataset whose iterator takes DATA_S per batch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        for _ in range(self.n):
            time.sleep(DATA_S)
            yield {"x": torch.ones(4, 2), "click": torch.ones(4, 1)}


class _SlowClient:
    """A PS client whose pulls take PULL_S."""

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        time.sleep(PULL_S)
        return np.zeros((len(keys), 2), np.float32)


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BWD_S)
        return grad


class _SlowModel(torch.nn.Module):
    """Forward: one PS pull through a real communicator, then FWD_S of its own work."""

    def __init__(self, comm: Any) -> None:
        super().__init__()
        self.comm = comm
        self.w = torch.nn.Parameter(torch.ones(2, 1))

    def forward(self, batch: dict) -> torch.Tensor:
        self.comm.pull_sparse("emb", np.arange(3, dtype=np.int64))
        time.sleep(FWD_S)
        return _SlowBackward.apply(batch["x"] @ self.w)


class _SlowSGD(torch.optim.SGD):
    """step() takes OPT_S; records when each step began (the test's own step clock)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.01)
        self.began: list[float] = []

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.began.append(time.perf_counter())
        time.sleep(OPT_S)
        return super().step(closure)


@pytest.mark.timeout(60)
def test_step_time_breakdown_adds_up_on_a_scripted_step() -> None:
    """Each phase is near its scripted time, the phases add up to the step time measured by the
    test's own clock within 5 %, and a real /metrics endpoint shows one histogram per phase."""
    from fleet import telemetry
    from fleet.ps.communicator import Communicator

    steps = 12
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's thread pool spins for ms on a loaded machine: not a phase
    port = telemetry.start(0)
    try:
        before = telemetry.STEPS._value.get()
        page0 = _scrape(port)  # the histograms are the process's: earlier tests may have observed
        comm = Communicator(_SlowClient(), 1, lambda: None)
        model, opt, out = _SlowModel(comm), None, io.StringIO()
        opt = _SlowSGD(model.parameters())
        stats = fleet.train_from_dataset(
            model,
            opt,
            _SlowData(steps),
            torch.nn.BCEWithLogitsLoss(),
            label="click",
            print_period=1,
            fetch={"slow": lambda o, b, loss: time.sleep(OTHER_S)},
            out=out,
        )
        page = _scrape(port)
        steps_total = telemetry.STEPS._value.get() - before
    finally:
        telemetry.stop()
        torch.set_num_threads(threads)
    assert stats.steps == steps and steps_total == steps  # one step end per step
    per_step = {k: v / steps for k, v in stats.phase_seconds.items()}
    scripted = {
        "data": DATA_S,
        "pull_wait": PULL_S,
        "forward": FWD_S,
        "backward": BWD_S,
        "push_optimizer": OPT_S,
        "other": OTHER_S,
    }
    for phase, want in scripted.items():  # sleeps overshoot on a loaded machine, never undershoot
        assert want * 0.95 <= per_step[phase] <= want * 1.6 + 0.004, (phase, per_step)
    measured = (opt.began[-1] - opt.began[0]) / (steps - 1)
    assert sum(per_step.values()) == pytest.approx(measured, rel=0.05), (per_step, measured)
    shares = [line for line in out.getvalue().splitlines() if "step-time:" in line]
    assert len(shares) == steps
    assert shares[-1].startswith("[train] step-time: data ")
    for name in ("pull", "fwd", "bwd", "push/opt", "other"):
        assert f" {name} " in shares[-1]

    # the same phases on the trainer's /metrics, one observation per step each
    def grew(name: str, phase: str) -> float:
        return page[(name, phase)] - page0.get((name, phase), 0.0)

    for phase in scripted:
        assert grew("fleet_trainer_phase_seconds_count", phase) == steps, phase
    phase_sum = sum(grew("fleet_trainer_phase_seconds_sum", p) for p in scripted)
    # (the last progress line's time is in the pass's "other", after the last observation)
    assert phase_sum == pytest.approx(sum(stats.phase_seconds.values()), rel=0.05)


def _scrape(port: int) -> dict[tuple[str, str], float]:
    """(sample name, phase label) -> value of this process's /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, s.labels.get("phase", "")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
