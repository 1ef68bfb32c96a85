"""Automatic prefetch (``fleet.ps.auto_prefetch`` through ``fleet.base.lookahead``): in async mode
iterating a dataset pulls the next batch's rows while the current one trains, with nothing in the
script; sync mode never looks ahead and trains exactly as without it; async with and without
prefetch converge alike. Real fleetrun jobs over slot files, 1 server + 1 trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SCRIPTS, run_fleetrun

from fleet.base import lookahead

SCRIPT = str(SCRIPTS / "ps_auto_prefetch_train.py")
BATCH = 64
LINES = 2 * 1000  # 2 files: 32 batches of 64 (the last one short)


def _write_files(root: Path) -> Path:
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 1.5, 40)  # a hidden weight per id: the click is learnable
    for f in range(2):
        lines = []
        for _ in range(LINES // 2):
            ids = rng.integers(0, 40, 3)
            x = rng.normal(0, 1, 2)
            p = 1 / (1 + np.exp(-(weight[ids].sum() + x[0])))
            click = int(rng.random() < p)
            sparse = " ".join(f"1 {i}" for i in ids)
            lines.append(f"1 {click} {sparse} 2 {x[0]:.4f} {x[1]:.4f}")
        (data / f"part-{f:05d}").write_text("\n".join(lines) + "\n")
    return data


def _run(tmp_path: Path, name: str, data: Path, mode: str, prefetch: int) -> dict:
    out = tmp_path / f"{name}.json"
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--log_dir",
        str(tmp_path / f"log_{name}"),
        SCRIPT,
        "--out",
        str(out),
        "--data",
        str(data),
        "--mode",
        mode,
        "--prefetch",
        str(prefetch),
        "--batch",
        str(BATCH),
        timeout=150,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(400)
def test_async_prefetches_by_itself_sync_never_looks_ahead(tmp_path: Path) -> None:
    data = _write_files(tmp_path)
    auto = _run(tmp_path, "auto", data, "async", 1)
    batches = -(-LINES // BATCH)
    for epoch in auto["epochs"]:
        assert epoch["batches"] == batches
        # two tables: only the first batch's forwards wait (they teach the plans); every later
        # batch of both tables was pulled by a prefetch during the step before
        assert epoch["train"] <= 2, epoch
        assert epoch["prefetch"] >= 2 * (batches - 1), epoch
    assert auto["prefetched"] >= 2 * 2 * (batches - 1)

    off = _run(tmp_path, "off", data, "async", 0)
    for epoch in off["epochs"]:
        assert epoch["prefetch"] == 0 and epoch["train"] == 2 * batches, epoch
    # async with and without the lookahead converge alike (same data, same model)
    a, b = auto["epochs"][1], off["epochs"][1]
    assert abs(a["loss"] - b["loss"]) < 0.03 and abs(a["auc"] - b["auc"]) < 0.03, (a, b)
    assert min(a["auc"], b["auc"]) > 0.6, (a, b)  # both learn

    sync = _run(tmp_path, "sync", data, "sync", 1)
    for epoch in sync["epochs"]:
        assert epoch["prefetch"] == 0 and epoch["train"] == 2 * batches, epoch
    assert sync["prefetched"] == 0
    sync_off = _run(tmp_path, "sync_off", data, "sync", 0)
    assert sync["losses"] == sync_off["losses"]
    assert sync["rows"] == sync_off["rows"] and sync["fc"] == sync_off["fc"]


class _Recorder:
    def __init__(self, on: bool) -> None:
        self.on = on
        self.calls: list[tuple] = []

    def active(self) -> bool:
        return self.on

    def on_batch(self, current, following) -> None:
        self.calls.append((current, following))


@pytest.mark.timeout(30)
def test_lookahead_hands_each_batch_with_the_next_and_ends_the_pass() -> None:
    rec = _Recorder(True)
    lookahead.register(rec)
    try:
        seen = []
        for b in lookahead.batches([{"i": 1}, {"i": 2}, {"i": 3}]):
            seen.append((b, rec.calls[-1]))
        assert [b["i"] for b, _ in seen] == [1, 2, 3]
        assert [(c["i"], f and f["i"]) for _, (c, f) in seen] == [(1, 2), (2, 3), (3, None)]
        assert rec.calls[-1] == (None, None)  # the pass ended: references dropped
        rec.on, rec.calls = False, []
        assert list(lookahead.batches(iter([{"i": 1}]))) == [{"i": 1}] and rec.calls == []
    finally:
        lookahead._PREFETCHERS.remove(rec)
