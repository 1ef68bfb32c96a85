"""The README's demo job: 2-rank DP under fleetrun from the job file, loss falls; the strategy
reaches the workers through FLEET_STRATEGY."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO, run_fleetrun


@pytest.mark.timeout(180)
def test_demo_job_file_runs_and_loss_falls(tmp_path: Path) -> None:
    r = run_fleetrun(
        "-c", "configs/dp_local.yaml", "--log_dir", str(tmp_path), cwd=REPO, timeout=170
    )
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+ .*loss ([0-9.]+)", r.stdout, re.MULTILINE)]
    assert len(losses) >= 2, r.stdout
    assert losses[-1] < losses[0], losses
    assert (tmp_path / "strategy.yaml").exists()
    assert (tmp_path / "workerlog.1").exists()
