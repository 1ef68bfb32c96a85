"""PS checkpoints and serving from the trainers, end to end under fleetrun: ``fleet.ps.checkpoint``
every 2 steps (keep 2) in a 2-server, 2-trainer sync job; ``fleet.ps.export_serving`` and
``fleet.ps.ServingModel.predict`` equal to the training model on a held-out batch; a fresh job
on 1 server resumes from the newest good checkpoint with ``fleet.ps.load_latest`` — the newest
corrupted, so the previous one, named — with every trainer's state and the exact rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SCRIPTS, run_fleetrun

SCRIPT = str(SCRIPTS / "fleet_ps_recovery.py")


def _job(tmp_path: Path, name: str, servers: int, *args: str) -> list[dict]:
    out = tmp_path / name
    r = run_fleetrun(
        "--server_num",
        str(servers),
        "--worker_num",
        "2",
        "--log_dir",
        str(tmp_path / f"log_{name}"),
        SCRIPT,
        "--out",
        str(out),
        "--root",
        str(tmp_path / "ck"),
        *args,
        timeout=200,
        env={"FLEET_PS_CHECKPOINT_ROOT": str(tmp_path)},
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.timeout(420)
def test_checkpoint_resume_and_serve_a_ps_job(tmp_path: Path) -> None:
    trained = _job(tmp_path, "train", 2, "--phase", "train", "--export", str(tmp_path / "export"))
    t0 = trained[0]
    assert t0["max_diff"] <= 1e-6  # serving copy predicts as the trained model
    assert t0["unknown_max"] == 0.0  # unknown ids pull zeros
    assert t0["model_config"]["slots"] == ["ids"]
    assert t0["export_rows"]["emb"] == len(t0["keys"])
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["ckpt-000004", "ckpt-000006"]  # keep=2
    shard = next(iter(sorted((ck / "ckpt-000006" / "emb").glob("shard-*.bin"))))
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01
    shard.write_bytes(bytes(data))
    resumed = _job(tmp_path, "resume", 1, "--phase", "resume")  # 2 servers saved, 1 loads
    for rank, r in enumerate(resumed):
        assert r["chosen"] == "ckpt-000004" and r["step"] == 4
        assert r["state"] == {"file": f"part-{rank:05d}", "pass": 0, "offset": 4 * 8}
        assert [s[0] for s in r["skipped"]] == ["ckpt-000006"]
        assert shard.name in r["skipped"][0][1]
    np.testing.assert_array_equal(np.array(resumed[0]["rows"]), np.array(t0["at"]["4"]["rows"]))
    for got, want in zip(resumed[0]["fc"], t0["at"]["4"]["fc"]):
        np.testing.assert_array_equal(np.array(got), np.array(want))
