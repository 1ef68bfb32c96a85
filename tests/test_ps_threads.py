"""Training threads (``fleet.train_from_dataset(thread_num=...)``, the dataset's ``thread_num`` by
default): real fleetrun jobs, 1 server + 1 trainer, over slot files with a unique id per line.
Every example is trained exactly once per epoch (counted by the forwards and by the servers'
``count`` rows), two threads converge like one, and no push is lost."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SCRIPTS, run_fleetrun

SCRIPT = str(SCRIPTS / "ps_threads_train.py")
LINES = 2 * 600  # 2 files, batches of 32


def write_files(root: Path) -> Path:
    """Two MultiSlot files: click, two sparse slots, a unique ``uid`` per line, 2 floats."""
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 1.5, 40)  # a hidden weight per id: the click is learnable
    uid = 1000
    for f in range(2):
        lines = []
        for _ in range(LINES // 2):
            a, b = rng.integers(0, 40, 2)
            x = rng.normal(0, 1, 2)
            click = int(rng.random() < 1 / (1 + np.exp(-(weight[a] + weight[b] + x[0]))))
            uid += 1
            lines.append(f"1 {click} 1 {a} 1 {b} 1 {uid} 2 {x[0]:.4f} {x[1]:.4f}")
        (data / f"part-{f:05d}").write_text("\n".join(lines) + "\n")
    return data


def run_job(
    tmp_path: Path, name: str, data: Path, *args: str, ok: bool = True, launch: tuple = ()
) -> dict:
    """Run the script (``args`` after --data, ``launch``: more fleetrun flags); its JSON, or the
    process result when not ``ok``."""
    out = tmp_path / f"{name}.json"
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--log_dir",
        str(tmp_path / f"log_{name}"),
        *launch,
        SCRIPT,
        "--out",
        str(out),
        "--data",
        str(data),
        *args,
        timeout=120,
    )
    if not ok:
        return {"returncode": r.returncode, "log": logs(tmp_path / f"log_{name}") + r.stderr}
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def logs(folder: Path) -> str:
    """Every file of a job's log folder, concatenated."""
    return "".join(p.read_text(errors="replace") for p in sorted(folder.rglob("*")) if p.is_file())


@pytest.mark.timeout(300)
def test_two_threads_train_every_example_once_and_converge_like_one(tmp_path: Path) -> None:
    data = write_files(tmp_path)
    two = run_job(tmp_path, "two", data, "--mode", "async", "--threads", "2")
    one = run_job(tmp_path, "one", data, "--mode", "async", "--threads", "2", "--thread-num", "1")
    batches = -(-LINES // 32)
    for run, threads in ((two, 2), (one, 1)):
        for epoch in run["epochs"]:
            assert epoch["steps"] == batches and epoch["examples"] == LINES, epoch
            assert len(epoch["threads"]) == threads, epoch
            # the phases of every thread's steps add up: about threads x the pass's wall time
            assert sum(epoch["phase_seconds"].values()) <= threads * epoch["seconds"] * 1.05
        # every uid seen by exactly two forwards (two epochs) and pushed exactly twice
        assert run["uids"] == LINES and run["seen"] == [[2, LINES]], run["seen"]
        assert run["count_rows"] == [[2.0, LINES]], run["count_rows"]
    a, b = two["epochs"][-1], one["epochs"][-1]
    assert abs(a["auc"] - b["auc"]) < 0.03 and abs(a["loss"] - b["loss"]) < 0.03, (a, b)
    assert min(a["auc"], b["auc"]) > 0.6, (a, b)  # both learn
