"""Heterogeneous PS jobs of real processes (servers, CPU trainers, heter workers; real gRPC):
sync mode equals one process, two heter workers share the dense table, async converges, a
killed heter worker is restarted on its endpoint and the trainer carries on."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from heter_job import HeterJob
from heter_train import auc, batches, reference


def _result(job: HeterJob, name: str) -> dict:
    lines = [ln for ln in job.log(name).splitlines() if ln.startswith('{"rank"')]
    assert lines, job.logs()
    return json.loads(lines[-1])


def _check_equal(tmp_path: Path, trainers: int, steps: int) -> None:
    got = [np.load(tmp_path / f"trainer{r}.npz") for r in range(trainers)]
    ref = reference(0, trainers, steps, 32, got[0]["initial"], lr=0.1, sparse_lr=0.5)
    for r in range(trainers):
        np.testing.assert_allclose(got[r]["rows"], ref["rows"], atol=1e-5)
        np.testing.assert_allclose(got[r]["lin"], ref["lin"], atol=1e-5)
        np.testing.assert_allclose(got[r]["heter"], ref["heter"], atol=1e-5)


@pytest.mark.timeout(420)
def test_sync_one_trainer_one_heter_worker_equals_one_process(tmp_path: Path) -> None:
    """Trained by fleet.train_from_dataset (which calls model.train_step)."""
    ck = tmp_path / "ck"
    job = HeterJob(
        tmp_path,
        ["--steps", "100", "--out", str(tmp_path), "--loop", "dataset", "--save", str(ck)],
        env={"FLEET_PS_CHECKPOINT_ROOT": str(tmp_path)},
    )
    try:
        codes = job.start().wait(timeout_s=360)
        assert set(codes.values()) == {0}, job.logs()
        _check_equal(tmp_path, trainers=1, steps=100)
        assert "heter worker 0: 100 micro-batches" in job.log("heter.0")
        assert "trainer 0 trained 100 steps" in job.log("trainer.0")
        # the heter workers' dense table is in the job's checkpoint, as every table
        saved = " ".join(p.read_text(errors="replace") for p in ck.glob("manifest.*.json"))
        assert "__heter_dense__" in saved, sorted(p.name for p in ck.iterdir())
    finally:
        job.kill()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_heter_workers_share_the_dense_table(tmp_path: Path) -> None:
    """2 trainers, 2 heter workers, 2 servers, sync: still the one-process model (mean loss)."""
    job = HeterJob(
        tmp_path, ["--steps", "30", "--out", str(tmp_path)], servers=2, trainers=2, heters=2
    )
    try:
        codes = job.start().wait(timeout_s=360)
        assert set(codes.values()) == {0}, job.logs()
        _check_equal(tmp_path, trainers=2, steps=30)
        for i in range(2):
            assert f"heter worker {i}: 30 micro-batches" in job.log(f"heter.{i}")
    finally:
        job.kill()


@pytest.mark.timeout(420)
def test_async_converges(tmp_path: Path) -> None:
    """2 CPU trainers, 1 heter worker, up to 2 micro-batches in flight each."""
    job = HeterJob(
        tmp_path,
        ["--steps", "100", "--mode", "async", "--k", "2", "--out", str(tmp_path)],
        trainers=2,
    )
    try:
        codes = job.start().wait(timeout_s=360)
        assert set(codes.values()) == {0}, job.logs()
        losses = np.load(tmp_path / "trainer0.npz")["losses"]
        assert len(losses) == 99  # the first 2 calls return None; flush gives the last
        assert losses[-20:].mean() < losses[:20].mean() - 0.1
        ref = reference(0, 2, 100, 32, np.load(tmp_path / "trainer0.npz")["initial"], 0.1, 0.5)
        got = np.mean([_result(job, f"trainer.{r}")["auc"] for r in range(2)])
        assert got > float(ref["auc"]) - 0.05, (got, float(ref["auc"]), job.logs())
    finally:
        job.kill()


@pytest.mark.timeout(420)
def test_killed_heter_worker_restarted_on_its_endpoint(tmp_path: Path) -> None:
    job = HeterJob(
        tmp_path,
        ["--steps", "120", "--mode", "async", "--k", "1", "--step_sleep", "0.03"],
    )
    try:
        job.start()
        job.wait_for_line("trainer.0", "trainer 0 step 30")
        job.procs["heter.0"].send_signal(signal.SIGKILL)
        job.procs["heter.0"].wait()
        job.wait_for_line("trainer.0", "unavailable")
        job.start_heter(0)  # on its endpoint, as fleetrun restarts it
        codes = job.wait(timeout_s=360)
        assert set(codes.values()) == {0}, job.logs()
        log = job.log("trainer.0")
        assert "trainer 0 step 110" in log
        assert _result(job, "trainer.0")["auc"] > 0.75
        served = re.findall(r"heter worker 0: (\d+) micro-batches", job.log("heter.0"))
        assert served and 0 < int(served[-1]) < 120  # the restarted worker served the rest
    finally:
        job.kill()


def test_train_from_dataset_runs_both_halves_in_one_process() -> None:
    """Outside a heterogeneous job a HeterModel is the one-process model."""
    import io

    import torch
    from torch import nn

    import fleet

    class Cpu(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 4)

        def forward(self, batch: dict) -> torch.Tensor:
            return self.emb(batch["ids"]).flatten(1)

    torch.manual_seed(0)
    device = nn.Sequential(nn.Linear(8, 1), nn.Flatten(0))
    model = fleet.heter.HeterModel(Cpu(), device, nn.BCEWithLogitsLoss())
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(40):
        ids = torch.randint(0, 20, (16, 2), generator=g)
        data.append({"ids": ids, "click": (ids[:, :1] < 10).to(torch.int64)})  # int64 [B, 1]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = fleet.train_from_dataset(
        model, opt, data, nn.BCEWithLogitsLoss(), label="click", out=io.StringIO()
    )
    assert stats.steps == 40 and stats.examples == 640
    assert stats.auc > 0.85 and model.last_loss is not None and float(model.last_loss) < 0.4


def test_reference_learns() -> None:
    """The data has something to learn (guards the AUC thresholds above)."""
    rows = np.random.default_rng(0).uniform(-0.1, 0.1, (50, 4)).astype(np.float32)
    assert reference(0, 1, 5, 32, rows, 0.1, 0.5)["heter"].shape == (8 * 16 + 8 + 8 + 1,)
    ids, _, label = batches(0, 0, 1, 64)[0]
    assert ids.shape == (64, 3) and 0 < float(label.mean()) < 1
    assert auc(np.array([0.1, 0.9]), np.array([0.0, 1.0])) == 1.0


@pytest.mark.timeout(60)
def test_merged_micro_batches_equal_separate_steps() -> None:
    """Micro-batches merged into one forward/backward: each trainer's activation gradients and
    loss are a separate step's, the dense gradient is the separate steps' sum (mean: divided by
    their number)."""
    import torch

    from fleet.heter.worker import PHASES, HeterWorker

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    w = HeterWorker.__new__(HeterWorker)  # the compute needs no servers
    w.net, w.loss_fn, w.device = net, torch.nn.BCEWithLogitsLoss(), torch.device("cpu")
    w.params = list(net.parameters())
    w.phases = dict.fromkeys(PHASES, 0.0)
    w.first_t, w.last_t, w.busy_s, w.micro_batches, w.merges = None, 0.0, 0.0, 0, 0
    rng = np.random.default_rng(0)

    def item(n: int) -> dict:
        act = torch.from_numpy(rng.normal(size=(n, 6)).astype(np.float32)).requires_grad_()
        return {"acts": [act], "label": (rng.random(n) < 0.5).astype(np.float32)}

    items = [item(5), item(3)]
    alone = [w._compute([dict(it, acts=[it["acts"][0].detach().requires_grad_()])]) for it in items]
    replies, summed = w._compute(items, mean=False)
    _, mean = w._compute(
        [dict(it, acts=[it["acts"][0].detach().requires_grad_()]) for it in items], mean=True
    )
    np.testing.assert_allclose(summed, alone[0][1] + alone[1][1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mean, summed / 2, rtol=1e-5, atol=1e-6)
    for (head, arrays), ((head1, arrays1),) in zip(replies, (a[0] for a in alone)):
        assert abs(head["loss"] - head1["loss"]) < 1e-6
        np.testing.assert_allclose(arrays["grad0"], arrays1["grad0"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(arrays["out"], arrays1["out"], rtol=1e-5, atol=1e-6)
