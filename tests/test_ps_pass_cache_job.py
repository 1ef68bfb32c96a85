"""The pass cache in a real fleetrun job: 1 server + 2 trainers, ``cache="pass"``,
``fleet.train_from_dataset`` opening and closing the pass. Each trainer makes one pull and one
push of its table in the pass, and the rows after the pass are the rows before plus both
trainers' deltas (the GEO merge on the server), over keys only one trainer saw and keys both
saw."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SCRIPTS, run_fleetrun

SCRIPT = str(SCRIPTS / "ps_pass_cache_train.py")


def _write_files(root: Path) -> Path:
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for f in range(2):  # trainer f reads part-f: keys 0..49 / 50..99 in slot a, 100..119 shared
        lines = []
        for _ in range(320):
            a = rng.integers(50 * f, 50 * f + 50, 2)
            b = rng.integers(100, 120, 1)
            click = int(rng.random() < 0.5)
            lines.append(f"1 {click} 2 {a[0]} {a[1]} 1 {b[0]}")
        (data / f"part-{f:05d}").write_text("\n".join(lines) + "\n")
    return data


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "threads"), [("sync", 1), ("async", 2), ("geo", 1)])
def test_two_trainers_pass_cache_job(tmp_path: Path, mode: str, threads: int) -> None:
    """SYNC, async with two training threads per trainer (the steps the async sender still
    holds at the pass's end are sent before the table goes back to it), and GEO (the dense
    layer trained locally and exchanged every k_steps; the pass's table never goes through
    GEO's local copies)."""
    data = _write_files(tmp_path)
    out = tmp_path / "out"
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "2",
        "--log_dir",
        str(tmp_path / "log"),
        SCRIPT,
        "--out",
        str(out),
        "--data",
        str(data),
        "--mode",
        mode,
        "--threads",
        str(threads),
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # the pass train_from_dataset opens itself is trained by every thread asked for
    done = (tmp_path / "log" / "workerlog.0").read_text()
    assert ("on 2 threads" in done) == (threads == 2), done
    res = [json.loads(Path(f"{out}-{rank}.json").read_text()) for rank in range(2)]
    before = np.array(res[0]["before"])
    merged = before.copy()
    for rank, got in enumerate(res):
        assert got["steps"] == 10 and not got["in_pass"]
        assert got["calls"] == [["pull", "emb"], ["push", "emb"]], got["calls"]
        keys, delta = got["delta"]
        keys = np.array(keys)
        own = set(range(50 * rank, 50 * rank + 50)) | set(range(100, 120))
        assert set(keys.tolist()) <= own and len(keys) > 40
        merged[keys] += np.array(delta)
    after = np.array(res[0]["after"])
    np.testing.assert_allclose(np.array(res[1]["after"]), after)
    np.testing.assert_allclose(after, merged, rtol=1e-5, atol=1e-6)
    for lo, hi in ((0, 50), (50, 100), (100, 120)):  # each trainer's keys and the shared ones
        assert np.abs(after[lo:hi] - before[lo:hi]).max() > 1e-4
