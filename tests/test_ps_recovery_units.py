"""The pieces of PS recovery without processes: the flags and job-file keys (bad values named),
the env contract, the data position a resumed trainer skips, the launcher's choice of checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from collective.env import PSCheckpointEnv, ps_checkpoint_env, read_ps_checkpoint_env
from collective.errors import ConfigError, EnvContractError
from fleet.base.data_position import DataPosition, PositionTracker
from launcher.recovery.ps_policy import PSRecovery, latest_committed, make_recovery
from launcher.spec import build_spec

PS = {"mode": "ps", "sizes": {"server_num": 1, "worker_num": 2}}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"dir": "ck", "interval_s": 0}, "ps_checkpoint.interval_s"),
        ({"dir": "ck", "keep": -1}, "ps_checkpoint.keep"),
        ({"dir": "ck", "every": 3}, "ps_checkpoint.every"),
    ],
)
def test_bad_ps_checkpoint_values_are_named(section: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_spec({**PS, "ps_checkpoint": section})


@pytest.mark.timeout(30)
def test_ps_checkpoint_needs_ps_mode_on_any_scheduler() -> None:
    with pytest.raises(ConfigError, match="ps_checkpoint.dir"):
        build_spec({"ps_checkpoint": {"dir": "ck"}})
    for scheduler in ("ray", "k8s"):  # every scheduler recovers a PS job
        build_spec({**PS, "scheduler": scheduler, "ps_checkpoint": {"dir": "ck"}})


@pytest.mark.timeout(30)
def test_flags_reach_the_trainers_env(tmp_path: Path) -> None:
    spec = build_spec(
        {
            **PS,
            "ps_checkpoint": {"dir": str(tmp_path / "ck"), "interval_s": 2.5, "keep": 4},
            "log_dir": str(tmp_path / "log"),
        }
    )
    rec = make_recovery(spec)
    assert isinstance(rec, PSRecovery)
    env = rec.trainer_env()
    assert read_ps_checkpoint_env(env) == PSCheckpointEnv(str(tmp_path / "ck"), 2.5, 4)
    assert rec.server_roots("/a:/b").split(":") == ["/a", "/b", str(tmp_path / "ck")]
    assert make_recovery(build_spec(PS)) is None
    assert read_ps_checkpoint_env({}) is None
    with pytest.raises(EnvContractError, match="FLEET_PS_CHECKPOINT_INTERVAL"):
        read_ps_checkpoint_env(
            {**ps_checkpoint_env(PSCheckpointEnv("d")), "FLEET_PS_CHECKPOINT_INTERVAL": "x"}
        )


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
    ds.init(
        batch_size=3,
        thread_num=1,
        use_var=[fleet.data.Slot("id", "int64"), fleet.data.Slot("label", "int64")],
    )
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
    assert monitor.snapshot()["recoveries"] == [
        "recovery 1 (attempt 0 -> 1): server 1 signal SIGKILL (9)"
    ]
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
    spec = build_spec(
        {**PS, "ps_checkpoint": {"dir": str(tmp_path / "ck")}, "log_dir": str(tmp_path / "log")}
    )
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
    assert got.text() == (
        "recovery 1 (attempt 0 -> 1): server 1 signal SIGKILL (9) at step ~19; "
        "restarted: every process, restored ckpt-000007 (step 7); ~12 steps redone"
    )
    assert rec.finish(1).startswith("PS recoveries:\n  recovery 1")


@pytest.mark.timeout(30)
def test_free_ports_come_from_below_the_ephemeral_range() -> None:
    import socket

    from collective.ports import _ephemeral_range_start, find_free_port

    top = _ephemeral_range_start()
    ports = {find_free_port() for _ in range(20)}
    assert len(ports) > 10
    for port in ports:
        assert top - 10000 <= port < top or top - 10000 < 1024
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.timeout(60)
def test_server_restarted_alone_restores_its_shard_and_pushes_wait_for_it(tmp_path: Path) -> None:
    """A server restarted on its endpoint restores the newest checkpoint whose part loads
    (ckpt 2's shard is corrupt: ckpt 1), and a client's APPLY push waits for it, re-establishes
    shared memory (the new server does not know the old segment) and applies exactly once."""
    import threading

    import numpy as np

    from ps_server import PSClient, PSServer
    from ps_server.checkpoint.manifest import shard_path

    root = str(tmp_path / "ck")
    first = PSServer(host="127.0.0.1", port=0, checkpoint_root=str(tmp_path))
    port = first.start()
    client = PSClient(
        [f"127.0.0.1:{port}"], token=None, retries=0, reconnect_s=30, timeout_s=10, shm=True
    )
    second = PSServer(host="127.0.0.1", port=port, checkpoint_root=str(tmp_path))
    keys = np.arange(40_000, dtype=np.int64)  # 40000 x 4 floats: over the shm threshold
    grads = np.ones((keys.size, 4), dtype=np.float32)
    restored: list[str | None] = []

    def restart() -> None:
        time.sleep(1.0)
        restored.append(second.restore_latest(root))
        second.start()

    thread = threading.Thread(target=restart)
    try:
        client.create_table("emb", 4)
        client.push_sparse("emb", keys, grads)
        assert client._shm is not None and client._shm.attached  # the push went through shm
        client.begin_checkpoint(root, 1).result()
        at_ckpt1 = client.pull_sparse("emb", keys)
        client.push_sparse("emb", keys, grads)
        client.begin_checkpoint(root, 2).result()
        shard = next(
            p
            for p in (shard_path(f"{root}/ckpt-000002", "emb", s) for s in range(64))
            if p.exists()
        )
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0xFF  # same size, wrong CRC: found only when this server loads it
        shard.write_bytes(bytes(raw))
        first.stop()
        thread.start()
        client.push_sparse("emb", keys, grads)  # waits for the restarted server
        assert restored == ["ckpt-000001"]
        assert len(second.state.shm) > 0  # shared memory re-established with the new server
        after = client.pull_sparse("emb", keys)
        assert not np.array_equal(after, at_ckpt1)
        client.push_sparse("emb", keys, grads)
        twice = client.pull_sparse("emb", keys)  # one SGD step from ckpt 1 each: applied once
        np.testing.assert_allclose(after - at_ckpt1, twice - after, rtol=1e-5, atol=1e-6)
    finally:
        thread.join(10)
        client.close()
        second.stop()
        first.stop()


@pytest.mark.timeout(30)
def test_recover_alone_only_a_server_in_async_or_geo(tmp_path: Path) -> None:
    spec = build_spec(
        {**PS, "ps_checkpoint": {"dir": str(tmp_path / "ck")}, "log_dir": str(tmp_path / "log")}
    )
    rec = PSRecovery(spec)
    assert rec.num_trainers == 2
    (tmp_path / "log").mkdir()
    died = "server 1 signal SIGKILL (9)"
    assert rec.recover_alone(0, died, "server", 1, True) is None  # no checkpoint yet
    (tmp_path / "ck" / "ckpt-000007").mkdir(parents=True)
    (tmp_path / "ck" / "ckpt-000007" / "checkpoint.json").write_text("{}")
    progress = {0: ("async", 19), 1: ("sync", 18)}
    for rank, (mode, step) in progress.items():
        (tmp_path / "log" / f"ps_progress.{rank}.json").write_text(
            f'{{"rank": {rank}, "attempt": 0, "step": {step}, "mode": "{mode}"}}'
        )
    assert rec.recover_alone(0, died, "server", 1, True) is None  # sync: restart every process
    (tmp_path / "log" / "ps_progress.1.json").write_text(
        '{"rank": 1, "attempt": 0, "step": 18, "mode": "geo"}'
    )
    assert rec.recover_alone(0, "rank 1 signal SIGKILL (9)", "trainer", 1, True) is None
    assert rec.recover_alone(0, died, "server", 1, False) is None  # budget spent
    got = rec.recover_alone(0, died, "server", 1, True)
    assert got is not None and got.redone == 0 and got.lost == 12
    assert got.text() == (
        "recovery 1 (attempt 0, in place): server 1 signal SIGKILL (9) at step ~19; "
        "restarted: server 1 only, restored its shard from ckpt-000007 (step 7); "
        "work lost: that shard's updates of ~12 steps; 0 steps redone"
    )
    assert rec.restore_env() == {"FLEET_PS_RESTORE_LATEST": rec.dir}
    assert rec.trainer_env()["FLEET_PS_RECONNECT_S"] == "120.0"
