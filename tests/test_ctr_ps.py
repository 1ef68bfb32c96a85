"""The CTR example on the parameter server: sync reaches the single-process baseline's AUC on
the same examples (within 0.01); async and GEO converge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, base_env, run_fleetrun

TRAIN, TEST = "30000", "10000"


def _ps(tmp_path: Path, mode: str, trainers: int = 2) -> dict:
    out = tmp_path / f"{mode}.json"
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        str(trainers),
        "--log_dir",
        str(tmp_path / mode),
        "examples/ctr/train_ps.py",
        "--train",
        TRAIN,
        "--test",
        TEST,
        "--mode",
        mode,
        "--geo_k",
        "5",
        "--json",
        str(out),
        cwd=REPO,
        timeout=250,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_sync_ps_auc_matches_single_process_baseline(tmp_path: Path) -> None:
    ps = _ps(tmp_path, "sync")
    base = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.ctr.baseline",
            "--train",
            TRAIN,
            "--test",
            TEST,
            "--threads",
            "1",
            "--json",
        ],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=250,
        check=False,
    )
    assert base.returncode == 0, base.stderr[-3000:]
    baseline = json.loads(next(ln for ln in base.stdout.splitlines() if ln.startswith("{")))
    assert ps["examples"] >= 0.98 * int(TRAIN)
    assert abs(ps["test_auc"] - baseline["test_auc"]) < 0.01, (ps, baseline["test_auc"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["async", "geo"])
def test_async_and_geo_converge(tmp_path: Path, mode: str) -> None:
    ps = _ps(tmp_path, mode)
    assert ps["test_auc"] > 0.68, ps
