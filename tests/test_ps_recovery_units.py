"""The pieces of PS recovery without processes: the flags and job-file keys (bad values named),
the env contract, the data position a resumed trainer skips, the launcher's choice of checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from collective.env import PSCheckpointEnv, ps_checkpoint_env, read_ps_checkpoint_env
from collective.errors import ConfigError, EnvContractError
from fleet.base.data_position import DataPosition, PositionTracker
from launcher.ps_recovery import PSRecovery, latest_committed, make_recovery
from launcher.spec import build_spec

PS = {"mode": "ps", "sizes": {"server_num": 1, "worker_num": 2}}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("section", "key"), [
    ({"dir": "ck", "interval_s": 0}, "ps_checkpoint.interval_s"),
    ({"dir": "ck", "keep": -1}, "ps_checkpoint.keep"),
    ({"dir": "ck", "every": 3}, "ps_checkpoint.every"),
])
def test_bad_ps_checkpoint_values_are_named(section: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_spec({**PS, "ps_checkpoint": section})


@pytest.mark.timeout(30)
def test_ps_checkpoint_needs_ps_mode_on_the_local_scheduler() -> None:
    with pytest.raises(ConfigError, match="ps_checkpoint.dir"):
        build_spec({"ps_checkpoint": {"dir": "ck"}})
    for scheduler in ("ray", "k8s"):
        with pytest.raises(ConfigError, match="local scheduler only, not yet"):
            build_spec({**PS, "scheduler": scheduler, "ps_checkpoint": {"dir": "ck"}})


@pytest.mark.timeout(30)
def test_flags_reach_the_trainers_env(tmp_path: Path) -> None:
    spec = build_spec({**PS, "ps_checkpoint": {"dir": str(tmp_path / "ck"), "interval_s": 2.5, "keep": 4},
                       "log_dir": str(tmp_path / "log")})
    rec = make_recovery(spec)
    assert isinstance(rec, PSRecovery)
    env = rec.trainer_env()
    assert read_ps_checkpoint_env(env) == PSCheckpointEnv(str(tmp_path / "ck"), 2.5, 4)
    assert rec.server_roots("/a:/b").split(":") == ["/a", "/b", str(tmp_path / "ck")]
    assert make_recovery(build_spec(PS)) is None
    assert read_ps_checkpoint_env({}) is None
    with pytest.raises(EnvContractError, match="FLEET_PS_CHECKPOINT_INTERVAL"):
        read_ps_checkpoint_env({**ps_checkpoint_env(PSCheckpointEnv("d")), "FLEET_PS_CHECKPOINT_INTERVAL": "x"})


@pytest.mark.timeout(30)
def test_latest_committed_skips_unfinished(tmp_path: Path) -> None:
    assert latest_committed(str(tmp_path / "none")) is None
    for step, committed in ((10, True), (20, True), (30, False)):
        d = tmp_path / f"ckpt-{step:06d}"
        d.mkdir()
        if committed:
            (d / "checkpoint.json").write_text("{}")
    (tmp_path / "other").mkdir()
    assert latest_committed(str(tmp_path)) == ("ckpt-000020", 20)


@pytest.mark.timeout(30)
def test_resumed_tracker_skips_what_was_trained() -> None:
    t = PositionTracker()
    t.resume(DataPosition.from_dict({"pass": 1, "step_in_pass": 7, "step": 57}))
    assert t.skip_batches() is None  # pass 0 was trained entirely
    assert t.begin_pass() is None
    assert t.skip_batches() == 7
    assert t.begin_pass() == 7
    t.on_step()
    assert t.position() == DataPosition(1, 8, 58)
    assert t.begin_pass() == 0  # pass 2: after the resume point
    assert t.position() == DataPosition(2, 0, 58)
    assert DataPosition.from_dict(None) == DataPosition()


@pytest.mark.timeout(60)
def test_in_memory_dataset_resumes_mid_pass(tmp_path: Path) -> None:
    import fleet
    from fleet.base import data_position

    (tmp_path / "part-0").write_text("".join(f"1 {i} 1 {i % 2}\n" for i in range(10)))
    ds = fleet.data.InMemoryDataset()
    ds.init(batch_size=3, thread_num=1, use_var=[fleet.data.Slot("id", "int64"), fleet.data.Slot("label", "int64")])
    ds.set_filelist([str(tmp_path / "part-0")])
    ds.load_into_memory()
    saved = data_position._tracker
    data_position._tracker = PositionTracker()
    try:
        data_position._tracker.resume(DataPosition(0, 2, 2))
        assert ds.get_memory_data_size() == 4  # 10 examples, 2 batches of 3 trained
        first = [b["id"].values.tolist() for b in ds]
        assert ds.get_memory_data_size() == 10  # the next pass is after the resume point
        second = [b["id"].values.tolist() for b in ds]
    finally:
        data_position._tracker = saved
    assert first == [[6, 7, 8], [9]]
    assert second == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.timeout(60)
def test_skip_examples_of_slices_across_chunks() -> None:
    from fleet.data.dataset import skip_examples_of

    class Cols:
        def __init__(self, lo: int, hi: int) -> None:
            self.lo, self.hi, self.num_examples = lo, hi, hi - lo

        def slice(self, a: int, b: int) -> Cols:
            return Cols(self.lo + a, self.lo + b)

    parts = [Cols(0, 4), Cols(4, 6), Cols(6, 10)]
    out = [(c.lo, c.hi) for c in skip_examples_of(iter(parts), 5)]
    assert out == [(5, 6), (6, 10)]
    assert [(c.lo, c.hi) for c in skip_examples_of(iter(parts), 0)] == [(0, 4), (4, 6), (6, 10)]


@pytest.mark.timeout(30)
def test_recoveries_reach_job_state_status_line_and_metric(tmp_path: Path) -> None:
    from launcher.console import Status
    from launcher.telemetry import PS_RECOVERIES, JobMonitor

    monitor = JobMonitor("job", "run", 3, str(tmp_path), "127.0.0.1", metrics=False)
    before = PS_RECOVERIES.labels(role="server")._value.get()
    monitor.recovered("server", "recovery 1 (attempt 0 -> 1): server 1 signal SIGKILL (9)")
    assert monitor.snapshot()["recoveries"] == ["recovery 1 (attempt 0 -> 1): server 1 signal SIGKILL (9)"]
    assert PS_RECOVERIES.labels(role="server")._value.get() == before + 1
    text = Status(4, 4, 10, None, None, None, recoveries="1 PS recovery(ies), last: x").text()
    assert text == "4/4 up | step 10 | 1 PS recovery(ies), last: x"


@pytest.mark.timeout(60)
def test_client_waits_for_a_server_restarted_on_its_endpoint() -> None:
    import threading

    from ps_server import PSClient, PSServer
    from ps_server.rpc.status import PSRpcError

    first = PSServer(host="127.0.0.1", port=0, server_index=0, num_servers=1)
    port = first.start()
    patient = PSClient([f"127.0.0.1:{port}"], token=None, retries=0, reconnect_s=30, timeout_s=5)
    hasty = PSClient([f"127.0.0.1:{port}"], token=None, retries=0, timeout_s=5)
    second = PSServer(host="127.0.0.1", port=port, server_index=0, num_servers=1)
    restarted = threading.Event()

    def restart() -> None:
        time.sleep(1.0)
        second.start()
        restarted.set()

    thread = threading.Thread(target=restart)
    try:
        patient.create_table("emb", 4)
        first.stop()
        with pytest.raises(PSRpcError, match="UNAVAILABLE"):
            hasty.create_table("emb", 4)
        thread.start()
        patient.create_table("emb", 4)  # waits for the new server (an idempotent call)
        assert restarted.is_set()
        assert patient.pull_sparse("emb", [1, 2]).shape == (2, 4)
    finally:
        thread.join(10)
        patient.close()
        hasty.close()
        second.stop()


@pytest.mark.timeout(30)
def test_no_recovery_without_a_checkpoint_or_budget(tmp_path: Path) -> None:
    spec = build_spec({**PS, "ps_checkpoint": {"dir": str(tmp_path / "ck")}, "log_dir": str(tmp_path / "log")})
    rec = make_recovery(spec)
    assert rec is not None
    got = rec.recover(0, "server 1 signal SIGKILL (9)", "server", budget_left=True)
    assert isinstance(got, str) and got.startswith("no PS recovery: no committed checkpoint")
    (tmp_path / "ck" / "ckpt-000007").mkdir(parents=True)
    (tmp_path / "ck" / "ckpt-000007" / "checkpoint.json").write_text("{}")
    got = rec.recover(0, "server 1 signal SIGKILL (9)", "server", budget_left=False)
    assert isinstance(got, str) and "budget" in got
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "ps_progress.0.json").write_text('{"rank": 0, "attempt": 0, "step": 19}')
    got = rec.recover(0, "server 1 signal SIGKILL (9)", "server", budget_left=True)
    assert not isinstance(got, str) and got.redone == 12
    assert got.text() == ("recovery 1 (attempt 0 -> 1): server 1 signal SIGKILL (9) at step ~19; "
                          "restored ckpt-000007 (step 7); ~12 steps redone")
    assert rec.finish(1).startswith("PS recoveries:\n  recovery 1")


@pytest.mark.timeout(30)
def test_free_ports_come_from_below_the_ephemeral_range() -> None:
    import socket

    from collective.env import _ephemeral_range_start, find_free_port

    top = _ephemeral_range_start()
    ports = {find_free_port() for _ in range(20)}
    assert len(ports) > 10
    for port in ports:
        assert top - 10000 <= port < top or top - 10000 < 1024
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
