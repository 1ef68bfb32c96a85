"""A dead half-async trainer is restarted alone while the other trainer goes on.

Half-async trainers meet every ``barrier_interval`` steps; under fleetrun's coordinator those
barriers are rounds numbered by the trainer's global step (``fleet.base.coordination``), so a
trainer resumed at its data position meets the others at the same barriers:

- the coordinator over real sockets: a restarted trainer's barrier that completed before answers
  at once from the record, the next one waits for every trainer; a restart of every process
  keeps the completed barriers and forgets every other round;
- a real fleetrun job (2 servers, 2 trainers, half-async CTR from slot files, a barrier every 20
  steps): trainer 1 SIGKILLed mid-pass is restarted alone from its data position; trainer 0 keeps
  its pid and its step count never goes back; both end with every step of their file trained;
  a row for every id; no process outlives the job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import wait_for
from test_ps_recovery import GLOBAL_BATCH, LINES, TEST, Job, ids_in, saved_rows, slot_dir  # noqa: F401
from test_ps_trainer_rejoin import _in_thread, _trainer_pids, coordinated_pair

from fleet.base.coordination import CoordinationClient


@pytest.mark.timeout(60)
def test_interval_barriers_replay_by_step_and_outlive_a_restart_of_every_process() -> None:
    with coordinated_pair() as (coord, clients):
        a, b = clients
        t, got = _in_thread(lambda: a.gather(1, "fleet.metrics SUM"))  # a MAIN round, completed
        assert b.gather(2, "fleet.metrics SUM") == [1, 2]
        t.join(10)
        for index in (0, 1):  # both trainers pass barriers 0 and 1 (steps N and 2N)
            t, got = _in_thread(lambda i=index: a.interval_barrier(i))
            b.interval_barrier(index)
            t.join(10)
            assert not t.is_alive() and "error" not in got, got
        # trainer 1 restarted alone at a position before step 2N: its barrier 1 replays at once,
        # in the process's order or not (its first barrier call here is index 1)
        b.close()
        b2 = CoordinationClient(coord.endpoint, "secret", 1, 2, 0)
        clients.append(b2)
        b2.interval_barrier(1)
        assert b2.replayed == 1
        # barrier 2 is live: it waits for trainer 0
        t, got = _in_thread(lambda: b2.interval_barrier(2))
        t.join(0.5)
        assert t.is_alive()
        a.interval_barrier(2)
        t.join(10)
        assert not t.is_alive() and "error" not in got and b2.replayed == 1, got
        # a restart of every process (attempt 1): completed barriers stay, other rounds go
        coord.reset(1)
        assert {k for k in coord.rounds} == {
            ("half-async", 0),
            ("half-async", 1),
            ("half-async", 2),
        }
        c1 = CoordinationClient(coord.endpoint, "secret", 1, 2, 1)
        clients.append(c1)
        c1.interval_barrier(2)  # resumed behind trainer 0's position: passes it from the record
        assert c1.replayed == 1
        t, got = _in_thread(lambda: c1.gather(5, "fleet.metrics SUM"))  # MAIN round 0: live again
        t.join(0.5)
        assert t.is_alive()
        c0 = CoordinationClient(coord.endpoint, "secret", 0, 2, 1)
        clients.append(c0)
        assert c0.gather(4, "fleet.metrics SUM") == [4, 5]
        t.join(10)
        assert got["value"] == [4, 5] and c0.replayed == 0


@pytest.mark.timeout(200)
def test_half_async_trainer_killed_mid_pass_is_restarted_alone(
    tmp_path: Path,
    slot_dir: Path,  # noqa: F811  (the fixture imported from test_ps_recovery)
) -> None:
    final = tmp_path / "log" / "final"
    job = Job(
        tmp_path, slot_dir, "half_async", max_restarts=1, interval=0.5, extra=("--save", str(final))
    )
    steps0: list[int] = []
    try:
        wait_for(
            lambda: job.checkpointed(0) and job.progress(1)["step"] >= 30,
            120,
            "a checkpoint and 30 steps of trainer 1",
        )
        before = _trainer_pids(job)
        job.kill("trainer", 1, 0)
        pids: dict[int, set[int]] = {0: set(), 1: set()}

        def ended() -> bool:  # sample trainer 0's step and the trainers' pids as the job runs
            steps0.append(job.progress(0)["step"])
            for rank, got in _trainer_pids(job).items():
                pids[rank] |= got
            return job.proc.poll() is not None

        wait_for(ended, 150, "the job's end")
        rc, err = job.wait(150)
    finally:
        job.close()
    assert rc == 0, err[-4000:]
    assert pids[0] == before[0] and len(before[0]) == 1, (before, pids)  # trainer 0 never restarted
    assert len(pids[1] - before[1]) == 1, (before, pids)  # trainer 1 restarted once
    assert steps0 == sorted(steps0), steps0  # trainer 0's steps never went back
    assert "recovery 1 (attempt 0, in place): rank 1 signal SIGKILL" in err, err[-3000:]
    assert "restarted: trainer 1 only, resumed at its data position" in err
    p0, p1 = job.progress(0), job.progress(1)
    steps = LINES // (GLOBAL_BATCH // 2)
    assert p0["mode"] == p1["mode"] == "half-async", (p0, p1)
    assert p0["attempt"] == p1["attempt"] == 0 and p0["resumed"] == {} and p0["step"] == steps, p0
    assert p1["resumed"]["alone"] and p1["step"] == steps, p1  # trained the rest of its pass
    assert "restarted alone: resumes at pass 0" in (job.log / "workerlog.1").read_text()
    state = json.loads((job.log / "job_state.json").read_text())
    assert state["state"] == "succeeded" and len(state["recoveries"]) == 1
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["test_auc"] > 0.6, result  # undisturbed runs of this data: ~0.69-0.73
    from examples.ctr.data import CTRDataConfig, generate

    seen = ids_in(slot_dir) | set(
        generate(CTRDataConfig(seed=0), TEST, 2 * LINES).sparse_ids.ravel().tolist()
    )
    rows = saved_rows(final)
    assert rows["ctr_dim1"] == rows["ctr_dim8"] == len(seen), (rows, len(seen))
