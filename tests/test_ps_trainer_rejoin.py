"""A dead async/GEO trainer is restarted alone while the other trainer goes on.

- the coordinator itself, over real sockets: a round replayed from the record to a restarted
  trainer (its own new contribution in place of its old one), a live round waiting for every
  trainer, a kind mismatch refused, a checkpoint epoch completing without a dead member;
- a real fleetrun job (2 servers, 2 trainers, async and GEO CTR from slot files): trainer 1 SIGKILLed
  mid-pass is restarted alone from its data position; trainer 0 keeps its pid and its step count
  never goes back; the restarted trainer replays its prologue's rounds; the job ends with a row
  for every id and a sane AUC; no process outlives it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from test_ps_recovery import GLOBAL_BATCH, LINES, TEST, Job, ids_in, saved_rows, slot_dir  # noqa: F401

from collective.errors import FleetError
from fleet.base.coordination import CoordinationClient
from launcher.recovery.coordinator import Coordinator


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@contextlib.contextmanager
def coordinated_pair() -> Iterator[tuple[Coordinator, list[CoordinationClient]]]:
    """A coordinator (world 2, an interval that never passes) and trainers 0 and 1 connected to
    it; a test appends the clients it adds to the list; everything is closed at the end."""
    coord = Coordinator("secret", world=2, interval_s=3600.0)
    clients: list[CoordinationClient] = []
    try:
        clients += [CoordinationClient(coord.endpoint, "secret", rank, 2, 0) for rank in (0, 1)]
        yield coord, clients
    finally:
        for c in clients:
            c.close()
        coord.close()


@pytest.mark.timeout(60)
def test_a_closed_coordinator_leaves_no_thread_on_its_sockets() -> None:
    """close() ends the accept thread and every connection's thread (each closes its own
    socket): a descriptor closed under a thread about to read it could be handed to the next
    socket of the process, and that thread would take its bytes."""
    before = {t for t in threading.enumerate() if t.name.startswith("ps-coordinator")}
    with coordinated_pair() as (coord, clients):
        poller = CoordinationClient(coord.endpoint, "secret", 0, 2, 0)
        clients.append(poller)
        waiting, _ = _in_thread(lambda: poller.poll_epoch(-1))  # a connection busy in a wait
        coord.close()  # while the clients are still connected
        waiting.join(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = {t for t in threading.enumerate() if t.name.startswith("ps-coordinator")}
            if not left - before:
                break
            time.sleep(0.05)
        assert not left - before, [t.name for t in left - before]


@pytest.mark.timeout(60)
def test_coordinator_replays_rounds_waits_live_and_cuts_without_the_dead() -> None:
    with coordinated_pair() as (coord, clients):
        a, b = clients
        with pytest.raises(FleetError, match="stale"):
            CoordinationClient(coord.endpoint, "secret", 1, 2, 5)
        t, got = _in_thread(lambda: a.gather(10, "fleet.metrics SUM"))
        assert b.gather(1, "fleet.metrics SUM") == [10, 1]
        t.join(10)
        assert got["value"] == [10, 1]
        t, got = _in_thread(lambda: a.barrier())
        b.barrier()
        t.join(10)
        # trainer 1 "restarted": a new process replays both rounds at once, alone, with its own
        # new value in place of the recorded one
        b.close()
        b2 = CoordinationClient(coord.endpoint, "secret", 1, 2, 0)
        clients.append(b2)
        assert b2.gather(7, "fleet.metrics SUM") == [10, 7] and b2.replayed == 1
        with pytest.raises(FleetError, match="replays round 1 .* as fleet.metrics MIN"):
            b2.gather(0, "fleet.metrics MIN")
        b3 = CoordinationClient(coord.endpoint, "secret", 1, 2, 0)
        clients.append(b3)
        b3.gather(7, "fleet.metrics SUM")
        b3.barrier()
        assert b3.replayed == 2 and coord.replayed >= 3 and not b3.replaying()
        b4 = CoordinationClient(coord.endpoint, "secret", 1, 2, 0)
        clients.append(b4)  # an agreement (trainer 0's outcome) replays as recorded; between two
        assert b4.gather(5, "fleet.metrics SUM", recorded=True) == [10, 1]  # replayed rounds,
        assert b4.replaying()  # trainer 0's side effects (a save, a snapshot) are skipped
        # a live round waits for every trainer: trainer 0 is not released by trainer 1 alone
        t, got = _in_thread(lambda: b3.gather("late", "gather"))
        t.join(0.5)
        assert t.is_alive()
        assert a.gather("early", "gather") == ["early", "late"]
        t.join(10)
        assert got["value"] == ["early", "late"]
        # checkpoint epochs: both trainers members; trainer 1 dies; the epoch's cut completes
        # with trainer 0 alone, trainer 1 represented by the position the agent read
        assert a.poll_epoch(0) == (0, False) and b3.poll_epoch(0) == (0, False)  # both members
        coord.interval_s = 0.0  # the interval has passed
        epoch, cut_now = a.poll_epoch(0)
        assert epoch == 1 and cut_now
        coord.trainer_died(1, {"pass": 0, "step_in_pass": 5, "step": 5})
        cut = a.cut(epoch, {"pass": 0, "step_in_pass": 9, "step": 9})
        assert cut["taken"] and cut["leader"] == 0
        assert cut["positions"] == {
            "0": {"pass": 0, "step_in_pass": 9, "step": 9},
            "1": {"pass": 0, "step_in_pass": 5, "step": 5},
        }
        a.report(epoch, ("ok", {"step": 9}))
        assert coord.last_step == 9
        a.leave()  # its training ended: no later epoch waits for it, even if its poller asks again
        assert a.poll_epoch(1) == (1, False) and not coord.joined


@pytest.mark.timeout(60)
def test_an_epoch_whose_members_all_entered_a_round_first_is_retried_at_once() -> None:
    """Half-async trainers meet at a barrier every N steps: when both enter one after an epoch
    opened and before they cut, the epoch closes with no cut; the next must open at once, not an
    interval later (seen: 2 of every 3 epochs lost, work redone after a kill 3 intervals)."""
    with coordinated_pair() as (coord, clients):
        a, b = clients
        assert a.poll_epoch(0) == (0, False) and b.poll_epoch(0) == (0, False)  # both joined
        coord.interval_s = 0.0  # the interval has passed
        assert a.poll_epoch(0) == (1, True) and b.poll_epoch(0) == (1, True)  # both members
        coord.interval_s = 3600.0  # from now on an interval never passes
        t, got = _in_thread(lambda: a.interval_barrier(0))  # both enter a round before cutting
        b.interval_barrier(0)
        t.join(10)
        assert "error" not in got  # epoch 1 closed without a cut:
        assert not a.cut(1, {"pass": 0, "step_in_pass": 4, "step": 4})["taken"]
        assert a.poll_epoch(1) == (2, True) and b.poll_epoch(1) == (2, True)  # retried at once
        t, got = _in_thread(lambda: b.cut(2, {"pass": 0, "step_in_pass": 5, "step": 5}))
        cut = a.cut(2, {"pass": 0, "step_in_pass": 5, "step": 5})
        assert cut["taken"] and cut["leader"] == 0
        a.report(2, ("ok", {"step": 5}))
        t.join(10)
        assert got["value"]["taken"] and coord.last_step == 5
        assert a.poll_epoch(2) == (2, False)  # then the interval counts again


def _trainer_pids(job: Job) -> dict[int, set[int]]:
    """Every pid each trainer rank had (from job_state.json, read as the job ran)."""
    out: dict[int, set[int]] = {0: set(), 1: set()}
    for p in job.state()["processes"]:
        if p["role"] == "trainer" and p.get("pid"):
            out[p["rank"]].add(int(p["pid"]))
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("mode", "warm"), [("async", "off"), ("geo", "off"), ("async", "on")])
def test_trainer_killed_mid_pass_is_restarted_alone(
    tmp_path: Path,
    slot_dir: Path,  # noqa: F811  (the fixture imported from test_ps_recovery)
    mode: str,
    warm: str,
) -> None:
    """(With ``warm`` on, every process and the restarted trainer are forked from the warm
    process: the same outcome.)"""
    final = tmp_path / "log" / "final"
    # the restarted trainer skips what it trained: async trains from the examples generated in
    # memory (the files' examples), GEO reads the files through a QueueDataset
    dataset = ("--dataset", "queue") if mode == "geo" else ()
    job = Job(
        tmp_path,
        slot_dir if mode == "geo" else None,
        mode,
        max_restarts=1,
        interval=0.5,
        extra=("--save", str(final), *dataset),
        flags=("--warm_start", warm),
    )
    steps0: list[int] = []
    try:
        wait_for(
            lambda: job.checkpointed(0) and job.progress(1)["step"] >= 20,
            120,
            "a checkpoint and 20 steps of trainer 1",
        )
        before = _trainer_pids(job)
        job.kill("trainer", 1, 0)
        dead = job.progress(1)["position"]

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
    assert "0 steps redone by the others" in err
    p0, p1 = job.progress(0), job.progress(1)
    steps = LINES // (GLOBAL_BATCH // 2)
    assert p0["attempt"] == p1["attempt"] == 0 and p0["resumed"] == {} and p0["step"] == steps, p0
    assert p1["resumed"]["alone"] and p1["resumed"]["position"]["step"] >= dead["step"] - 1, (
        p1,
        dead,
    )
    assert p1["step"] == steps, p1  # resumed at its position, trained the rest of its pass
    log1 = (job.log / "workerlog.1").read_text()
    assert "restarted alone: resumes at pass 0" in log1
    replays = [ln for ln in log1.splitlines() if "replayed from the record" in ln]
    assert any("barrier_worker" in ln for ln in replays), replays
    assert mode == "async" or any("fleet.metrics SUM" in ln for ln in replays), replays  # files
    state = json.loads((job.log / "job_state.json").read_text())
    assert state["state"] == "succeeded" and len(state["recoveries"]) == 1
    assert (job.log / "warmlog.0").exists() == (warm == "on")
    assert "warm start unavailable" not in err
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["test_auc"] > 0.6, result  # undisturbed runs of this data: ~0.69-0.73
    from examples.ctr.data import CTRDataConfig, generate

    seen = ids_in(slot_dir) | set(
        generate(CTRDataConfig(seed=0), TEST, 2 * LINES).sparse_ids.ravel().tolist()
    )
    rows = saved_rows(final)
    assert rows["ctr_dim1"] == rows["ctr_dim8"] == len(seen), (rows, len(seen))


@pytest.mark.timeout(30)
def test_only_async_and_geo_trainers_meet_through_the_coordinator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Async, GEO and half-async trainers meet through it (half-async: its barriers by step,
    tests/test_ps_trainer_rejoin_halfasync.py); sync trainers (a barrier every step) keep gloo
    and restart-all; servers never connect; without FLEET_PS_COORDINATOR nothing changes."""
    from collective.env import TrainingRole, WorkerEnv
    from fleet.base.coordination import wanted
    from fleet.strategy import DistributedStrategy

    def strategy(a_sync: bool, **configs: int) -> DistributedStrategy:
        s = DistributedStrategy()
        s.a_sync = a_sync
        if configs:
            s.a_sync_configs = configs
        return s

    trainer, server = WorkerEnv(), WorkerEnv(training_role=TrainingRole.PSERVER)
    monkeypatch.delenv("FLEET_PS_COORDINATOR", raising=False)
    assert not wanted(trainer, strategy(True))
    monkeypatch.setenv("FLEET_PS_COORDINATOR", "127.0.0.1:1")
    assert wanted(trainer, strategy(True)) and wanted(trainer, strategy(True, k_steps=10))
    assert not wanted(trainer, strategy(False)) and wanted(
        trainer, strategy(True, barrier_interval=20)
    )
    assert not wanted(server, strategy(True))
