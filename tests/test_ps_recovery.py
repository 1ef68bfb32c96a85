"""PS jobs recover from dead processes through their automatic checkpoints (fleetrun
--ps_checkpoint_dir): real fleetrun jobs of the CTR example from slot files, processes killed
with SIGKILL while they train.

- sync: a server is killed mid-pass, with a partial newest checkpoint on disk (what a kill
  during a checkpoint write leaves); the job resumes from the previous good one; later a trainer
  is killed; the job finishes every step once, with a row for every id it saw;
- async: a trainer is killed and restarted alone; then a server is killed with the budget spent:
  the job fails naming the server as the root cause, every recovery listed;
- no checkpoint yet: the same path as a spent budget (``PSRecovery.recover`` says why; unit test in
  test_ps_recovery_units.py);
- no process of a job outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, base_env, fleetrun_cmd, gen_slot_files, wait_for, wait_gone

LINES = 4000
"""Examples per slot file; 2 files, one per trainer."""
GLOBAL_BATCH = 32
TEST = 1000


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ctr_slots")
    gen_slot_files(out, 2, LINES)
    return out


class Job:
    """One fleetrun of the CTR example, its output in files (a pipe could fill and block it)."""

    def __init__(
        self,
        tmp: Path,
        data: Path | None,
        mode: str,
        max_restarts: int,
        interval: float,
        extra: tuple[str, ...] = (),
        keep: int = 2,
        flags: tuple[str, ...] = (),
    ) -> None:
        """``data``: the slot files' folder; None: the same examples generated in memory;
        ``extra``: the script's arguments; ``flags``: more of fleetrun's."""
        self.log, self.ckpt = tmp / "log", tmp / "ckpt"
        self.out, self.err = tmp / "stdout.txt", tmp / "stderr.txt"
        self.pids: set[int] = set()
        args = [
            "--server_num",
            "2",
            "--worker_num",
            "2",
            "--log_dir",
            str(self.log),
            "--ps_checkpoint_dir",
            str(self.ckpt),
            "--ps_checkpoint_interval",
            str(interval),
            "--ps_checkpoint_keep",
            str(keep),
            "--max_restarts",
            str(max_restarts),
            "--tee",
            "none",
            "--grace_period",
            "2",
            *flags,
            "examples/ctr/train_ps.py",
            *(["--data_dir", str(data)] if data else ["--train", str(2 * LINES)]),
            "--test",
            str(TEST),
            "--batch_size",
            str(GLOBAL_BATCH),
            "--embedding_dim",
            "8",
            "--mode",
            mode,
            "--json",
            str(tmp / "result.json"),
            *extra,
        ]
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen(
                fleetrun_cmd(*args),
                cwd=str(REPO),
                env=base_env(),
                stdout=o,
                stderr=e,
                start_new_session=True,
            )

    def state(self) -> dict[str, Any]:
        data = json.loads((self.log / "job_state.json").read_text())
        self.pids.update(p["pid"] for p in data["processes"] if p.get("pid"))
        return data

    def pid(self, role: str, rank: int, attempt: int) -> int | None:
        data = self.state()
        if data["attempt"] != attempt:
            return None
        for p in data["processes"]:
            if p["role"] == role and p["rank"] == rank and p["state"] == "up":
                return int(p["pid"])
        return None

    def progress(self, rank: int) -> dict[str, Any]:
        return json.loads((self.log / f"ps_progress.{rank}.json").read_text())

    def checkpointed(self, attempt: int) -> bool:
        """A checkpoint taken by ``attempt`` is committed (and the attempt's processes are
        known)."""
        from launcher.recovery.ps_policy import latest_committed

        self.state()
        p = self.progress(0)
        latest = latest_committed(str(self.ckpt))
        resumed = (p.get("resumed") or {}).get("step", -1)
        return p["attempt"] == attempt and latest is not None and latest[1] > resumed

    def kill(self, role: str, rank: int, attempt: int) -> None:
        pid = wait_for(
            lambda: self.pid(role, rank, attempt), 60, f"{role} {rank} of attempt {attempt}"
        )
        os.kill(pid, signal.SIGKILL)

    def wait(self, timeout: float) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=timeout)
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


def ids_in(data: Path) -> set[int]:
    """Every sparse id of the slot files (MultiSlot: ``1 label`` then ``1 id`` per slot)."""
    out: set[int] = set()
    for path in sorted(data.glob("part-*")):
        for line in path.read_text().splitlines():
            out.update(int(t) for t in line.split()[3:55:2])
    return out


def saved_rows(directory: Path) -> dict[str, int]:
    from ps_server.checkpoint.save_load import create_tables, load

    tables = create_tables(directory, 0, 1)
    load(directory, tables)
    return {name: t.num_rows for name, t in tables.items()}


@pytest.mark.timeout(240)
def test_sync_server_kill_mid_pass_then_trainer_kill(tmp_path: Path, slot_dir: Path) -> None:
    final = tmp_path / "log" / "final"
    job = Job(
        tmp_path, slot_dir, "sync", max_restarts=2, interval=0.5, extra=("--save", str(final))
    )
    try:
        wait_for(lambda: job.checkpointed(0), 120, "a checkpoint of attempt 0")
        from launcher.recovery.ps_policy import latest_committed

        _, step = latest_committed(str(job.ckpt)) or ("", 0)
        partial = job.ckpt / f"ckpt-{step + 10**6:06d}"  # as a kill during its write leaves it:
        partial.mkdir()  # some files, no checkpoint.json (committed last)
        (partial / "manifest.server-0.json").write_text('{"files": {"ctr_dim1/shard-0000')
        job.kill("server", 1, 0)
        wait_for(lambda: job.checkpointed(1), 120, "a checkpoint after the server's recovery")
        resumed = job.progress(0)["resumed"]
        job.kill("trainer", 1, 1)
        rc, err = job.wait(180)
    finally:
        job.close()
    assert rc == 0, err[-4000:]
    assert resumed["checkpoint"] != partial.name and partial.name in [
        s[0] for s in resumed["skipped"]
    ]
    assert "recovery 1 (attempt 0 -> 1): server 1 signal SIGKILL" in err, err[-3000:]
    assert "recovery 2 (attempt 1 -> 2): rank 1 signal SIGKILL" in err, err[-3000:]
    steps = LINES // (GLOBAL_BATCH // 2)
    for rank in (0, 1):  # the last attempt resumed and finished the pass: every step once
        p = job.progress(rank)
        assert p["attempt"] == 2 and p["resumed"] and p["step"] == steps, p
    state = json.loads((job.log / "job_state.json").read_text())
    assert len(state["recoveries"]) == 2 and state["state"] == "succeeded"
    from examples.ctr.data import CTRDataConfig, generate

    seen = ids_in(slot_dir) | set(
        generate(CTRDataConfig(seed=0), TEST, 2 * LINES).sparse_ids.ravel().tolist()
    )
    rows = saved_rows(final)
    assert rows["ctr_dim1"] == rows["ctr_dim8"] == len(seen), (rows, len(seen))


@pytest.mark.timeout(200)
def test_async_trainer_kill_recovers_then_spent_budget_fails(
    tmp_path: Path, slot_dir: Path
) -> None:
    job = Job(tmp_path, slot_dir, "async", max_restarts=1, interval=0.5)
    try:
        wait_for(lambda: job.checkpointed(0), 120, "a checkpoint of attempt 0")
        job.kill("trainer", 0, 0)  # async: restarted alone (test_ps_trainer_rejoin.py)
        wait_for(
            lambda: job.progress(0)["resumed"].get("alone") and job.checkpointed(0),
            120,
            "a checkpoint after the trainer's recovery",
        )
        job.kill("server", 0, 0)
        rc, err = job.wait(120)
    finally:
        job.close()
    assert rc == 1, err[-4000:]
    assert "recovery 1 (attempt 0, in place): rank 0 signal SIGKILL" in err
    summary = err[err.index("FAILED") :]
    root = summary[summary.index("Root cause (first observed failure):") :].splitlines()[:5]
    assert any(ln.split() == ["server", ":", "index", "0", "(node", "0)"] for ln in root), root
    assert any("exit" in ln and "SIGKILL" in ln for ln in root), root
    tail = summary[summary.index("Root cause") :]
    assert "no PS recovery: the restart budget" in tail and "PS recoveries:" in tail
