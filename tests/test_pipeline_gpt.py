"""The GPT example end to end: ``fleetrun -c configs/gpt_hybrid.yaml`` trains the tiny GPT
(tensor-parallel layers, tied embedding, described as a PipelineLayer) at mp2 x pp2 on 4 CPU
processes, and the loss falls."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, run_fleetrun


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_hybrid_config_trains_at_mp2_pp2(tmp_path) -> None:
    r = run_fleetrun(
        "-c",
        str(REPO / "configs" / "gpt_hybrid.yaml"),
        "--log_dir",
        str(tmp_path / "log"),
        timeout=280,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    summary = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith('{"first_loss"')))
    assert (summary["dp"], summary["mp"], summary["pp"]) == (1, 2, 2)
    assert summary["last_loss"] < summary["first_loss"] - 0.2, summary
