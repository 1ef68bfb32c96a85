"""The CTR example as a heterogeneous PS job under fleetrun (configs/ctr_heter.yaml's shape:
2 servers, 2 CPU trainers, 1 heter worker), on a small generated data set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_fleetrun


def test_ctr_heter_config_shape() -> None:
    job = yaml.safe_load((REPO / "configs" / "ctr_heter.yaml").read_text())
    assert job["entrypoint"]["script"] == "examples/ctr/train_heter.py"
    assert job["sizes"] == {"server_num": 2, "worker_num": 2, "heter_worker_num": 1}


def _run_example(tmp_path: Path, *flags: str, args: tuple[str, ...] = ()) -> tuple[dict, str]:
    """Run configs/ctr_heter.yaml's job on 8000 examples (fleetrun ``flags``, example ``args``);
    the example's JSON result and heter worker 0's log."""
    out = tmp_path / "result.json"
    r = run_fleetrun(
        "-c",
        str(REPO / "configs" / "ctr_heter.yaml"),
        *flags,
        "--log_dir",
        str(tmp_path / "log"),
        "examples/ctr/train_heter.py",  # the job file's script, smaller data
        *args,
        "--train",
        "8000",
        "--test",
        "4000",
        "--batch_size",
        "256",
        "--json",
        str(out),
        timeout=540,
        cwd=REPO,
    )
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "log").glob("*log.*")))
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{logs}"
    return json.loads(out.read_text()), (tmp_path / "log" / "heterlog.0").read_text()


@pytest.mark.timeout(600)
def test_ctr_heter_example_under_fleetrun(tmp_path: Path) -> None:
    result, heter = _run_example(tmp_path)
    assert result["trainers"] == 2 and result["heter_workers"] == 1
    assert result["examples"] == 2 * (8000 // 2 // 128) * 128
    assert result["test_auc"] > 0.6, result
    assert "trainer 0 stopped" in heter and "trainer 1 stopped" in heter
    assert "62 micro-batches" in heter
    assert "heter worker 0 on cpu, sync, serving on" in heter


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_ctr_heter_example_with_the_dense_half_on_a_gpu(tmp_path: Path) -> None:
    result, heter = _run_example(tmp_path, "--heter_devices", "cuda", args=("--mode", "async"))
    assert result["heter_workers"] == 1 and result["test_auc"] > 0.6, result
    assert "heter worker 0 on cuda" in heter, heter[-2000:]
