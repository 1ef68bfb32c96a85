"""fleet.train_from_dataset over batches shaped like fleet.data's (slot name -> dense tensor or
jagged sparse slot), single process: it trains, prints progress lines, and names a missing
label slot."""

from __future__ import annotations

import io
from types import SimpleNamespace

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
    assert len(lines) == 5 and lines[-1].startswith("[train] done: 40 batches")
    assert "[####################] 100.0%" in lines[3] and "ex/s" in lines[0]
    first = float(lines[0].split("loss ")[1].split()[0])
    last = float(lines[3].split("loss ")[1].split()[0])
    assert last < first


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
