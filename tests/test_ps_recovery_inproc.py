"""In async/GEO mode a dead server is restarted alone (fleetrun --ps_checkpoint_dir): a real
fleetrun job of the CTR example (2 servers, 2 trainers, async) whose server 1 is killed with
SIGKILL mid-pass. Only that server restarts, on its endpoint, restoring its shards from the
newest good checkpoint by itself; the other server and both trainers keep their processes and go
on (their calls to the dead server wait for it); the job finishes with exit 0, one recovery
listed as ``restarted: server 1 only``; every row of the restored checkpoint is still there at
the end; no process outlives the job. The same with SSD tables (marked slow): the restarted server
gets its SSD directory back and restores both tiers; the default run checks that part on one
server process started as the launcher restarts it (``--from_env``, FLEET_PS_SSD_ROOT,
FLEET_PS_RESTORE_LATEST).

Checkpoints are taken every 0.5 s, so the kill usually lands while one is being taken or
committed: such a checkpoint fails on the trainers, is logged and skipped, and training goes on
(counted in the progress files; the test asserts the job goes on either way, as the kill's
moment is not controlled).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import psutil
import pytest
from conftest import SCRIPTS, wait_for
from test_ps_recovery import LINES, Job, slot_dir  # noqa: F401 - slot_dir is a fixture

sys.path.insert(0, str(SCRIPTS))
from ps_cluster import start_server_process, stop_process  # noqa: E402

GLOBAL_BATCH = 32


def keys_of(directory: Path) -> dict[str, set[int]]:
    """Keys of every sparse table of a checkpoint (all servers' shards)."""
    import dataclasses

    from ps_server.checkpoint.manifest import read_checkpoint
    from ps_server.checkpoint.save_load import load
    from ps_server.core.factory import make_table
    from ps_server.core.shard_data import SparseShardData

    tables = {}
    for name, entry in read_checkpoint(directory).tables.items():
        config = entry.config  # SSD tables are read back into memory tables here
        if getattr(config, "storage", None) is not None:
            config = dataclasses.replace(
                config, storage="memory", cache_rows=None, cache_bytes=None
            )
        tables[name] = make_table(config, 0, 1)
    load(directory, tables)
    out: dict[str, set[int]] = {}
    for name, table in tables.items():
        shards = table.export_shards(False)
        if all(isinstance(d, SparseShardData) for d in shards.values()):  # dense: no keys
            out[name] = {k for d in shards.values() for k in d.keys.tolist()}
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("storage", ["memory", pytest.param("ssd", marks=pytest.mark.slow)])
def test_async_server_kill_restarts_it_alone(
    tmp_path: Path,
    slot_dir: Path,  # noqa: F811
    storage: str,
) -> None:
    final = tmp_path / "log" / "final"
    ssd = storage == "ssd"  # the restarted server (python -m ps_server --from_env) gets its tier
    job = Job(
        tmp_path,
        slot_dir,
        "async",
        max_restarts=1,
        interval=0.5,
        extra=("--save", str(final), *(("--storage", "ssd", "--cache_rows", "300") if ssd else ())),
        keep=0,
        flags=("--ps_ssd_dir", str(tmp_path / "ssd")) if ssd else (),
    )
    try:
        wait_for(lambda: job.checkpointed(0), 120, "a checkpoint of attempt 0")
        before = {
            (r, k): wait_for(lambda r=r, k=k: job.pid(r, k, 0), 60, f"{r} {k}")
            for r, k in (("server", 0), ("server", 1), ("trainer", 0), ("trainer", 1))
        }
        created = {key: psutil.Process(pid).create_time() for key, pid in before.items()}
        job.kill("server", 1, 0)
        # the replacement server is up in the same attempt, with a new pid
        wait_for(
            lambda: (job.pid("server", 1, 0) or before[("server", 1)]) != before[("server", 1)],
            120,
            "server 1 restarted",
        )
        for key, pid in before.items():
            if key != ("server", 1):  # the others never stopped
                assert job.pid(*key, 0) == pid, (key, job.state()["processes"])
                assert psutil.Process(pid).create_time() == created[key]
        rc, err = job.wait(180)
    finally:
        job.close()
    assert rc == 0, err[-4000:]
    state = json.loads((job.log / "job_state.json").read_text())
    assert state["state"] == "succeeded" and state["attempt"] == 0 and state["restarts"] == 1, state
    (line,) = state["recoveries"]
    assert "server 1 signal SIGKILL" in line and "restarted: server 1 only" in line, line
    assert "0 steps redone" in line and "work lost" in line, line
    assert "restarted: server 1 only" in err and "PS recoveries:" in err, err[-3000:]
    steps = LINES // (GLOBAL_BATCH // 2)
    for rank in (0, 1):  # one attempt: no trainer was restarted, each trained every step once
        p = json.loads((job.log / f"ps_progress.{rank}.json").read_text())
        assert p["attempt"] == 0 and p["step"] == steps and p["mode"] == "async", p
    log = (job.log / "serverlog.1").read_text()
    restored = re.findall(r"server 1 restored its shards from (ckpt-\d+)", log)
    assert len(restored) == 1, log[-3000:]
    at_restore, at_end = keys_of(job.ckpt / restored[0]), keys_of(final)
    assert at_restore and set(at_restore) == set(at_end), (at_restore.keys(), at_end.keys())
    for name, keys in at_restore.items():  # the restored shard's rows are all still there
        assert keys <= at_end[name], (name, len(keys - at_end[name]))


@pytest.mark.timeout(60)
def test_server_restarted_from_env_restores_an_ssd_table(tmp_path: Path) -> None:
    """A server started as the launcher restarts one alone (``python -m ps_server --from_env``
    with FLEET_PS_SSD_ROOT and FLEET_PS_RESTORE_LATEST) gets its SSD directory and restores an
    SSD table's rows, both tiers, from the newest checkpoint."""
    import numpy as np

    from collective.env import find_free_port
    from ps_server import PSClient, PSServer

    pytest.importorskip("rocksdict")
    root, keys = str(tmp_path / "ckpt"), np.arange(2000, dtype=np.int64)
    first = PSServer(
        host="127.0.0.1", port=0, checkpoint_root=str(tmp_path), ssd_root=str(tmp_path)
    )
    port = first.start()
    try:
        with PSClient([f"127.0.0.1:{port}"], timeout_s=20) as client:
            client.create_table("emb", 8, num_shards=4, storage="ssd", cache_rows=100)
            client.push_sparse("emb", keys, np.ones((keys.size, 8), dtype=np.float32))
            client.begin_checkpoint(root, 1).result()
            saved = client.pull_sparse("emb", keys)
    finally:
        first.stop()
    port = find_free_port()
    env = {
        "TRAINING_ROLE": "PSERVER",
        "POD_IP": "127.0.0.1",
        "PADDLE_PORT": str(port),
        "PADDLE_PSERVERS_IP_PORT_LIST": f"127.0.0.1:{port}",
        "PADDLE_TRAINERS_NUM": "1",
        "FLEET_PS_CHECKPOINT_ROOT": str(tmp_path),
        "FLEET_PS_SSD_ROOT": str(tmp_path / "ssd" / "server-0"),  # created by the server
        "FLEET_PS_RESTORE_LATEST": root,
    }
    proc, endpoint = start_server_process("--from_env", env=env)
    try:
        with PSClient([endpoint], timeout_s=20) as client:
            np.testing.assert_array_equal(client.pull_sparse("emb", keys), saved)
            stats = [s for s in client.stats() if "tables" in s][0]["tables"]
            emb = stats["emb"] if isinstance(stats, dict) else stats[0]
            assert emb["cold_rows"] > 0 and emb["hot_rows"] <= 100, emb
    finally:
        stop_process(proc)
    assert (tmp_path / "ssd" / "server-0" / "emb").is_dir()


@pytest.mark.timeout(180)
def test_failed_automatic_checkpoints_are_skipped(tmp_path: Path, slot_dir: Path) -> None:  # noqa: F811
    """A checkpoint that fails (here every checkpoint's directory name is taken by a file, so
    the servers cannot write it; a server restarted while a checkpoint is taken or committed
    fails it the same way) is logged by every trainer and skipped; training goes on and the job
    ends normally."""
    steps = LINES // (GLOBAL_BATCH // 2)
    (tmp_path / "ckpt").mkdir()
    for step in range(steps + 1):
        (tmp_path / "ckpt" / f"ckpt-{step:06d}").write_text("not a checkpoint")
    job = Job(tmp_path, slot_dir, "async", max_restarts=0, interval=0.5)
    try:
        rc, err = job.wait(150)
    finally:
        job.close()
    assert rc == 0, err[-4000:]
    for rank in (0, 1):
        p = json.loads((job.log / f"ps_progress.{rank}.json").read_text())
        assert p["checkpoints_failed"] >= 1 and p["step"] == steps, p
        log = (job.log / f"workerlog.{rank}").read_text()
        assert re.search(
            rf"trainer {rank}: automatic checkpoint at step \d+ failed, skipped", log
        ), log[-3000:]
    from launcher.recovery.ps_policy import latest_committed

    assert latest_committed(str(job.ckpt)) is None
