"""Parameter-server training end to end: fleetrun starts real gRPC servers and trainers.

Sync mode: W trainers with batch b equal one trainer with batch W*b (SGD) within 1e-5.
GEO with K=1 and one trainer equals sync. Async and half-async train and save.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SCRIPTS, run_fleetrun

SCRIPT = str(SCRIPTS / "fleet_ps_train.py")


def _train(tmp_path: Path, name: str, servers: int, trainers: int, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    r = run_fleetrun(
        "--server_num",
        str(servers),
        "--worker_num",
        str(trainers),
        "--log_dir",
        str(tmp_path / f"log_{name}"),
        SCRIPT,
        "--out",
        str(out),
        *args,
        timeout=150,
        env={"FLEET_PS_CHECKPOINT_ROOT": str(tmp_path)},
    )  # saves there
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


def _max_diff(a: dict, b: dict) -> float:
    assert a["keys"] == b["keys"]
    rows = np.abs(np.array(a["rows"]) - np.array(b["rows"])).max()
    dense = max(np.abs(np.array(x) - np.array(y)).max() for x, y in zip(a["fc"], b["fc"]))
    return float(max(rows, dense))


@pytest.mark.timeout(300)
def test_sync_two_trainers_equal_one_trainer_with_the_whole_batch(tmp_path: Path) -> None:
    two = _train(tmp_path, "two", 2, 2, "--save", str(tmp_path / "ckpt"))
    one = _train(tmp_path, "one", 1, 1)
    assert _max_diff(two, one) < 1e-5
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "__dense__",
        "emb",
        "manifest.server-0.json",
        "manifest.server-1.json",
    ]
    geo = _train(tmp_path, "geo", 1, 1, "--mode", "geo", "--geo_k", "1")
    assert _max_diff(geo, one) < 1e-5  # local SGD + summed deltas == server-side SGD
    # 3 servers start from the checkpoint 2 servers saved (resharding); no training steps
    restored = _train(
        tmp_path,
        "restored",
        3,
        1,
        "--steps",
        "0",
        "--key_steps",
        "6",
        "--load",
        str(tmp_path / "ckpt"),
    )
    assert _max_diff(restored, two) < 1e-6


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["async", "half_async", "geo"])
def test_async_modes_train(tmp_path: Path, mode: str) -> None:
    res = _train(tmp_path, mode, 2, 2, "--mode", mode, "--steps", "8")
    rows = np.array(res["rows"])
    assert np.isfinite(rows).all() and rows.shape[1] == 4
    from ps_server import SGD, SparseTableConfig, Uniform, make_table

    table = make_table(
        SparseTableConfig("emb", dim=4, optimizer=SGD(0.1), initializer=Uniform(-0.5, 0.5))
    )
    init = table.initial_values(np.array(res["keys"], dtype=np.int64))
    assert np.abs(rows - init).max() > 1e-3  # the rows moved


@pytest.mark.timeout(120)
def test_embedding_input_forms_and_gradients(tmp_path: Path) -> None:
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--log_dir",
        str(tmp_path),
        "--tee",
        "all",
        str(SCRIPTS / "fleet_ps_bags.py"),
        timeout=100,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "BAGS_OK" in r.stdout
