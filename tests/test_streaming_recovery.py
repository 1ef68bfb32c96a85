"""``fleet.train_days`` under fleetrun's automatic checkpoints: the online CTR example
(``examples/ctr/online.py``, unchanged) over 2 days x 2 passes, 1 server + 2 trainers, async,
``--ps_checkpoint_dir``; a process is SIGKILLed mid-stream once the first pass is recorded.

- undisturbed: every save once in the donefile, the last cut's trainer state carries the stream
  position (phase ``day``, 6 records), the AUC of reference;
- trainer 0 killed: fleetrun restarts every process (train_days keeps trainer 0 from being
  restarted alone: its replay would redo its saves), the stream continues after the last cut's
  record (the pass in progress trained again);
- the server killed: async, so fleetrun restarts it alone from the last cut while the trainers
  go on (or, when the kill lands on a save or a cut, the trainer that meets it fails and the job
  is recovered as a whole: both paths must end the same way).

Each: exit 0, the donefile lists every pass once and one base per day, the final progressive AUC
close to the undisturbed run's (loose), the recovery in job_state.json and the summary, no
process of the job left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, base_env, fleetrun_cmd, gen_slot_files, wait_for, wait_gone

DAYS = ("20261120", "20261121")
ONLINE = str(REPO / "examples" / "ctr" / "online.py")
EXPECTED = [
    (DAYS[0], "00", "delta"),
    (DAYS[0], "01", "delta"),
    (DAYS[0], "-1", "base"),
    (DAYS[1], "00", "delta"),
    (DAYS[1], "01", "delta"),
    (DAYS[1], "-1", "base"),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream") / "data"
    gen_slot_files(root, 2, 2500, "--days", ",".join(DAYS), "--passes", "2")
    return root


class Job:
    """One fleetrun of the online example with automatic checkpoints, output in files."""

    def __init__(self, tmp: Path, data: Path, mode: str) -> None:
        self.tmp, self.log, self.ckpt = tmp, tmp / "log", tmp / "ckpt"
        self.err = tmp / "stderr.txt"
        self.pids: set[int] = set()
        args = [
            "--server_num",
            "1",
            "--worker_num",
            "2",
            "--log_dir",
            str(self.log),
            "--ps_checkpoint_dir",
            str(self.ckpt),
            "--ps_checkpoint_keep",
            "2",
            "--max_restarts",
            "3",
            "--tee",
            "none",
            "--grace_period",
            "2",
            ONLINE,
            "--data_root",
            str(data),
            "--output_dir",
            "model",
            "--batch_size",
            "64",
            "--shrink_unseen_days",
            "0",
            "--mode",
            mode,
            "--json",
            str(tmp / "passes.jsonl"),
        ]
        with open(tmp / "stdout.txt", "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen(
                fleetrun_cmd(*args),
                cwd=str(tmp),
                env=base_env(),
                stdout=o,
                stderr=e,
                start_new_session=True,
            )

    def state(self) -> dict[str, Any]:
        data = json.loads((self.log / "job_state.json").read_text())
        self.pids.update(p["pid"] for p in data["processes"] if p.get("pid"))
        return data

    def records(self) -> list[tuple[str, str, str]]:
        path = self.tmp / "model" / "donefile.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        return [(d, p, k) for d, p, _, k in (line.split("\t") for line in lines)]

    def kill_after_first_pass(self, role: str, rank: int) -> None:
        """SIGKILL ``role`` ``rank`` of attempt 0 once the first pass is recorded."""
        wait_for(lambda: self.records(), 120, "the first donefile record")

        def pid() -> int | None:
            data = self.state()
            return next(
                (
                    int(p["pid"])
                    for p in data["processes"]
                    if data["attempt"] == 0
                    and p["role"] == role
                    and p["rank"] == rank
                    and p["state"] == "up"
                ),
                None,
            )

        os.kill(wait_for(pid, 30, f"{role} {rank}"), signal.SIGKILL)

    def wait(self) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"fleetrun timed out:\n{self.err.read_text()[-4000:]}") from None
        return rc, self.err.read_text()

    def close(self) -> None:
        """Kill what is left (a failed test), then check nothing of the job outlived it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        try:
            self.state()
        except (OSError, ValueError):
            pass
        assert not wait_gone(sorted(self.pids), 15), "processes of the job outlived it"
        import psutil

        mine = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if str(self.log) in " ".join(p.info["cmdline"] or [])
        ]
        assert not mine, f"orphans: {mine}"

    def final_auc(self) -> float:
        """Progressive AUC of the last pass (the last line written for it)."""
        lines = [json.loads(x) for x in (self.tmp / "passes.jsonl").read_text().splitlines()]
        return [r for r in lines if (r["day"], r["pass"]) == (DAYS[1], "01")][-1]["progressive_auc"]


def run(
    tmp: Path, data: Path, mode: str = "async", kill: tuple[str, int] | None = None
) -> tuple[Job, str]:
    job = Job(tmp, data, mode)
    try:
        if kill is not None:
            job.kill_after_first_pass(*kill)
        rc, err = job.wait()
    finally:
        job.close()
    assert rc == 0, err[-4000:]
    assert job.records() == EXPECTED, (job.records(), err[-3000:])
    return job, err


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> float:
    """The undisturbed run's final progressive AUC (its own checks on the way)."""
    job, _ = run(tmp_path_factory.mktemp("undisturbed"), data)
    state = job.state()
    assert state["state"] == "succeeded" and not state.get("recoveries"), state
    from ps_server.checkpoint import latest_good

    chosen = latest_good(job.ckpt).chosen
    assert chosen is not None
    stream = (chosen.trainer_states.get(0) or chosen.trainer_states["0"])["stream"]
    assert (stream["phase"], stream["records"], stream["record"][:2]) == ("day", 6, [DAYS[1], "-1"])
    assert_chain_exact(job.tmp / "model")
    return job.final_auc()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("role", ["trainer", "server"])
def test_stream_recovers_from_a_kill(
    role: str, data: Path, reference: float, tmp_path: Path
) -> None:
    job, err = run(tmp_path, data, "async", kill=(role, 0))
    state = job.state()
    assert state["state"] == "succeeded" and state["recoveries"], state
    died = "rank 0 signal SIGKILL" if role == "trainer" else "server 0 signal SIGKILL"
    assert "recovery 1 (attempt 0" in err and died in err, err[-3000:]
    if role == "trainer":  # every process restarted: the stream continued after the cut's record
        assert "recovery 1 (attempt 0 -> 1)" in err, err[-3000:]
        log = (job.log / "workerlog.0").read_text()
        assert "[online] resumed after day" in log and "from the job's checkpoint" in log, log[
            -3000:
        ]
    assert "PS recoveries:" in err, err[-3000:]
    # the model kept what it learnt: the last pass meets a model about as good as undisturbed
    assert abs(job.final_auc() - reference) < 0.05, (job.final_auc(), reference)
    assert_chain_exact(job.tmp / "model")


def _state(tables: dict) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, t in tables.items():
        parts = list(t.export_shards(False).values())
        if t.KIND == "dense":
            out.update(
                {
                    f"{name}.{b.name}.{f}": getattr(b, f)
                    for p in parts
                    for b in p.blocks
                    for f in ("values", "state")
                }
            )
            continue
        keys = np.concatenate([p.keys for p in parts])
        order = np.argsort(keys)
        out[f"{name}.keys"] = keys[order]
        out.update(
            {
                f"{name}.{f}": np.concatenate([getattr(p, f) for p in parts])[order]
                for f in ("values", "state", "count", "unseen_days")
            }
        )
    return out


def assert_chain_exact(model: Path) -> None:
    """Each day's base equals the previous base (day 0: empty tables) + that day's deltas +
    end_day + shrink(0), row for row: the servers restored from a cut continued the delta chain
    exactly, and each day ended once (the kills land before day 0's end)."""
    from ps_server.checkpoint import create_tables, load

    for i, day in enumerate(DAYS):
        tables = create_tables(model / day / "base")  # the configs; empty
        if i:
            load(model / DAYS[i - 1] / "base", tables)
        for p in ("00", "01"):
            load(model / day / f"delta-{p}", tables)
        for t in tables.values():
            if t.KIND == "sparse":
                t.end_day()
                t.shrink(0)
        expect = create_tables(model / day / "base")
        load(model / day / "base", expect)
        got, want = _state(tables), _state(expect)
        assert sorted(got) == sorted(want), day
        for key, w in want.items():
            np.testing.assert_array_equal(got[key], w, err_msg=f"{day} {key}")


@pytest.mark.timeout(30)
def test_donefile_reconciled_with_the_cut(tmp_path: Path) -> None:
    """The donefile after a restart agrees with the checkpoint resumed from: a record the cut
    holds but the file lacks is appended, records after the cut are dropped, a donefile of
    another stream is refused naming the file."""
    from collective.errors import FleetError
    from fleet.streaming.donefile import DoneRecord, read_donefile, reconcile_donefile

    recs = [
        DoneRecord(DAYS[0], p, f"model/{DAYS[0]}/delta-{p}", "delta") for p in ("00", "01", "02")
    ]
    (tmp_path / "donefile.txt").write_text(recs[0].line())
    assert reconcile_donefile(str(tmp_path), 2, list(recs[1].__dict__.values())) == recs[:2]
    assert read_donefile(str(tmp_path)) == recs[:2]  # appended once
    (tmp_path / "donefile.txt").write_text("".join(r.line() for r in recs))
    assert reconcile_donefile(str(tmp_path), 1, list(recs[0].__dict__.values())) == recs[:1]
    assert read_donefile(str(tmp_path)) == recs[:1]  # the records after the cut are dropped
    assert reconcile_donefile(str(tmp_path), 0, None) == []
    (tmp_path / "donefile.txt").write_text(recs[2].line())
    with pytest.raises(FleetError, match="donefile.txt does not match the job's checkpoint"):
        reconcile_donefile(str(tmp_path), 1, list(recs[0].__dict__.values()))
