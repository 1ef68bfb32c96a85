"""Resuming at another world size (fleet.elastic), on real gloo processes.

A job trains through ``Checkpointer`` + ``ElasticSampler`` (the loop of docs/elastic/resume.md),
is cut off after its last save (the steps after it are lost), and the next job resumes at another
world size:
plain DP 2 -> 1 -> 4 ranks; sharding stage 1 at 2 ranks -> stage 2 at 3 ranks (the partitioned
Adam state resharded over new owners) -> one unsharded rank. The final parameters equal an
uninterrupted single-process run on the same global batches. On disk: only rank 0 writes a DP
checkpoint, the newest ``keep`` survive, a crashed save's temporary directory is removed and
never read. Bad arguments are ConfigErrors naming the argument.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_all_ok, run_workers

from collective.errors import ConfigError

SCRIPT = SCRIPTS / "elastic_resume_train.py"
TOL = 1e-5
STEPS = 30  # 8 global batches of 24 per epoch: the run crosses epochs 0 -> 3


def _reference(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The uninterrupted run, in this process (one rank, no process group)."""
    spec = importlib.util.spec_from_file_location("elastic_resume_train", SCRIPT)
    fixture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixture)
    out = tmp_path / "out"
    out.mkdir()
    fixture.reference(argparse.Namespace(out=str(out), steps=STEPS))
    return {kind: torch.load(out / f"ref_{kind}.pt") for kind in ("sgd", "adam")}


def _job(tmp_path: Path, world: int, mode: str, tag: str, stop_at: int | None = None) -> dict:
    args = [
        "--mode",
        mode,
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / "out"),
        "--tag",
        tag,
        "--steps",
        str(STEPS),
        "--every",
        "4",
    ]
    if stop_at is not None:
        args += ["--stop_at", str(stop_at)]
    assert_all_ok(run_workers(SCRIPT, world, args, timeout=150, tmp_path=tmp_path))
    recs = [
        json.loads((tmp_path / "out" / f"{tag}_rank{r}.json").read_text()) for r in range(world)
    ]
    assert all(rec["world"] == world for rec in recs)
    assert all(rec["resumed"] == recs[0]["resumed"] for rec in recs)
    return recs[0]


def _ckpt_dirs(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ckpt").iterdir())


@pytest.mark.timeout(400)
def test_dp_saved_at_2_resumes_at_1_then_at_4_as_if_never_stopped(tmp_path: Path) -> None:
    ref = _reference(tmp_path)["sgd"]
    first = _job(tmp_path, 2, "dp", "a", stop_at=11)  # saved at 4 and 8; 9..11 lost
    assert first["resumed"] == [0, 0, 0] and first["saved_world_size"] is None
    assert first["trained"][-1][0] == 11
    assert _ckpt_dirs(tmp_path) == ["step_00000004", "step_00000008"]  # keep=2
    files = {p.name: p.stat().st_size for p in (tmp_path / "ckpt" / "step_00000008").iterdir()}
    assert files["__0_0.distcp"] > 0 and files.get("__1_0.distcp", 0) == 0  # rank 0 writes DP
    # What a save cut off by a crash leaves (a temporary directory), and a directory that was
    # never committed: neither is read.
    (tmp_path / "ckpt" / ".tmp-step_00000012").mkdir()
    (tmp_path / "ckpt" / ".tmp-step_00000012" / "__0_0.distcp").write_bytes(b"torn")
    (tmp_path / "ckpt" / "step_00000099").mkdir()

    second = _job(tmp_path, 1, "dp", "b", stop_at=21)
    # step 8 = the last full global batch of epoch 0 (8 batches of 24 of its 200 samples)
    assert second["resumed"] == [8, 0, 192] and second["saved_world_size"] == 2
    assert second["extra"] == {"note": "from the fixture"}
    assert [t[0] for t in second["trained"]] == list(range(9, 22))  # continuous from the save
    assert _ckpt_dirs(tmp_path) == ["step_00000016", "step_00000020", "step_00000099"]

    third = _job(tmp_path, 4, "dp", "c")
    assert third["resumed"] == [20, 2, 96] and third["saved_world_size"] == 1
    assert third["trained"][-1][0] == STEPS
    final = torch.load(tmp_path / "out" / "final_dp.pt")
    assert float((final - ref).abs().max()) < TOL


@pytest.mark.timeout(400)
def test_sharding_stage1_at_2_resumes_as_stage2_at_3_then_unsharded(tmp_path: Path) -> None:
    ref = _reference(tmp_path)["adam"]
    _job(tmp_path, 2, "s1", "a", stop_at=10)  # saved at 4 and 8
    files = {p.name: p.stat().st_size for p in (tmp_path / "ckpt" / "step_00000008").iterdir()}
    assert files["__1_0.distcp"] > 0  # rank 1 owns (and writes) part of the Adam state
    manifest = json.loads((tmp_path / "ckpt" / "step_00000008" / "fleet_manifest.json").read_text())
    assert manifest["optimizer"]["sharding_stage"] == 1
    assert sorted(set(manifest["optimizer"]["owners"].values())) == [0, 1]

    second = _job(tmp_path, 3, "s2", "b", stop_at=19)  # 3 new owners of the state
    assert second["resumed"] == [8, 0, 192] and second["saved_world_size"] == 2
    manifest = json.loads((tmp_path / "ckpt" / "step_00000016" / "fleet_manifest.json").read_text())
    assert manifest["optimizer"]["sharding_stage"] == 2
    assert sorted(set(manifest["optimizer"]["owners"].values())) == [0, 1, 2]

    third = _job(tmp_path, 1, "s1", "c")  # one rank: no sharding, the whole state
    assert third["resumed"] == [16, 1, 192] and third["saved_world_size"] == 3
    assert third["state_params"] == len(manifest["params"])
    final = torch.load(tmp_path / "out" / "final_s1.pt")
    assert float((final - ref).abs().max()) < TOL


@pytest.mark.timeout(60)
def test_elastic_sampler_gives_the_same_global_batches_at_any_world_size() -> None:
    from fleet.elastic import ElasticSampler

    data = list(range(50))
    global_batch = 12

    def batches(world: int, offset: int) -> list[list[int]]:
        per_rank = []
        for rank in range(world):
            s = ElasticSampler(data, num_replicas=world, rank=rank, seed=5, drop_last=True)
            s.set_epoch(3, offset)
            idx = list(s)
            per = global_batch // world
            per_rank.append([idx[i : i + per] for i in range(0, len(idx) - per + 1, per)])
        n = min(len(b) for b in per_rank)
        return [sorted(sum((b[k] for b in per_rank), [])) for k in range(n)]

    for offset in (0, 12, 36):
        seen = batches(1, offset)
        assert len(seen) == (50 - offset) // global_batch
        for world in (2, 3, 4):
            assert batches(world, offset) == seen
    padded = ElasticSampler(data, num_replicas=4, rank=3, seed=5)  # pads like DistributedSampler
    padded.set_epoch(0, 36)
    assert len(list(padded)) == len(padded) == 4


@pytest.mark.timeout(60)
def test_bad_arguments_name_the_argument(tmp_path: Path) -> None:
    from fleet.elastic import Checkpointer, ElasticSampler

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, key in (
        ({"every_steps": 0}, "every_steps"),
        ({"every_steps": 2, "keep": 0}, "keep"),
    ):
        with pytest.raises(ConfigError, match=f"^{key}: "):
            Checkpointer(model, opt, tmp_path, **kwargs)
    with pytest.raises(ConfigError, match="^offset: must be between 0 and the dataset's 10"):
        ElasticSampler(list(range(10)), num_replicas=1, rank=0).set_epoch(0, 11)
    ckpt = Checkpointer(model, opt, tmp_path / "none", every_steps=2)
    assert ckpt.restore().step == 0 and ckpt.latest() is None  # a fresh start
    foreign = tmp_path / "foreign" / "step_00000002"
    foreign.mkdir(parents=True)
    (foreign / "elastic.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ConfigError, match="is not a fleet-elastic-checkpoint"):
        Checkpointer(model, opt, tmp_path / "foreign", every_steps=2).restore()
    with pytest.raises(ConfigError, match="^extra: must be JSON"):
        ckpt.save(2, extra={"x": object()})
