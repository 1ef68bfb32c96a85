"""The CTR example trained from slot files: 2 servers + 2 trainers, each
trainer reading its ``fleet.util.get_file_shard`` of the files through ``fleet.data``. The files
hold exactly the examples the in-memory run generates, so the sync run from files reaches the
in-memory run's AUC; a QueueDataset fed PaddleRec lines through the MultiSlotDataGenerator reader
(``pipe_command``) trains too."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from conftest import REPO, gen_slot_files, run_fleetrun

FILES, LINES = 4, 5000  # 20000 training examples
TEST = "5000"


def _gen(out: Path, fmt: str) -> None:
    gen_slot_files(out, FILES, LINES, "--format", fmt)


def _train(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    r = run_fleetrun(
        "--server_num",
        "2",
        "--worker_num",
        "2",
        "--log_dir",
        str(tmp_path / name),
        "examples/ctr/train_ps.py",
        "--test",
        TEST,
        "--json",
        str(out),
        *args,
        cwd=REPO,
        timeout=250,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_sync_from_files_equals_in_memory_auc(tmp_path: Path) -> None:
    _gen(tmp_path / "slots", "multislot")
    files = _train(
        tmp_path,
        "files",
        "--data_dir",
        str(tmp_path / "slots"),
        "--dataset",
        "inmemory",
        "--mode",
        "sync",
    )
    tensors = _train(tmp_path, "tensors", "--train", str(FILES * LINES), "--mode", "sync")
    # sync steps whole global batches: both runs drop the same partial last batch
    assert files["examples"] == tensors["examples"] >= 0.98 * FILES * LINES, (files, tensors)
    assert abs(files["test_auc"] - tensors["test_auc"]) < 0.01, (files, tensors)


@pytest.mark.timeout(300)
def test_queue_dataset_through_the_paddlerec_reader(tmp_path: Path) -> None:
    _gen(tmp_path / "rec", "paddlerec")
    reader = " ".join(
        shlex.quote(p) for p in (sys.executable, str(REPO / "examples/ctr/reader.py"))
    )
    res = _train(
        tmp_path,
        "queue",
        "--data_dir",
        str(tmp_path / "rec"),
        "--dataset",
        "queue",
        "--pipe_command",
        reader,
        "--mode",
        "async",
    )
    assert res["examples"] >= 0.98 * FILES * LINES, res
    assert res["test_auc"] > 0.6, res
