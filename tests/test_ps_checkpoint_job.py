"""Job checkpoints over gRPC (real servers on 127.0.0.1, port 0): one consistent cut of two
servers restored exactly (rows, dense values, Adagrad state: one more identical step after the
load gives the same rows as without the checkpoint); trainer states round-trip; keep=K deletes
old checkpoints only after the new one is committed; a corrupt or unfinished checkpoint is
skipped and named; a server killed (SIGKILL) while writing leaves the previous checkpoint the
one chosen; paths stay under the checkpoint roots."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from ps_server import Adagrad, PSClient, Uniform
from ps_server.checkpoint import series
from ps_server.errors import CheckpointError
from ps_server.rpc.status import (
    PSInvalidArgumentError,
    PSPermissionDeniedError,
    PSRpcError,
)

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster, start_server_process, stop_process

DIM = 8
KEYS = np.arange(0, 3000, 7, dtype=np.int64) * 1_000_003
STATES = {
    0: {"file": "part-00003", "pass": 2, "offset": 1184},
    1: {"file": "part-00007", "pass": 2, "offset": 96},
}


def make_tables(client: PSClient) -> None:
    client.create_table(
        "emb", DIM, Adagrad(0.05, initial_accumulator_value=0.1), Uniform(-0.1, 0.1), num_shards=16
    )
    client.create_dense_table("dense", Adagrad(0.05), num_shards=4)
    client.init_dense("dense", "w", np.linspace(-1, 1, 33, dtype=np.float32))


def step(client: PSClient, seed: int) -> None:
    """One training step: a sparse push (duplicates included) and a dense push."""
    rng = np.random.default_rng(seed)
    keys = KEYS[rng.integers(0, KEYS.size, 900)]
    client.push_sparse("emb", keys, rng.standard_normal((keys.size, DIM)).astype(np.float32))
    client.push_dense("dense", "w", rng.standard_normal(33).astype(np.float32))


def state(client: PSClient) -> tuple[np.ndarray, np.ndarray]:
    return client.pull_sparse("emb", KEYS), client.pull_dense("dense", "w")


def flip_byte(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.timeout(120)
def test_consistent_cut_of_two_servers_restores_exactly(tmp_path: Path) -> None:
    with cluster(2, checkpoint_root=str(tmp_path)) as (_servers, client):
        make_tables(client)
        for s in range(3):
            step(client, s)
        rows_at, dense_at = state(client)  # pulls of known keys create nothing new
        record = client.checkpoint("ck", 3, trainer_states=STATES, keep=2)
        assert record.name == "ckpt-000003" and record.trainer_states == STATES
        assert record.rows == {"dense": 1, "emb": KEYS.size} and len(record.writers) == 2
        step(client, 100)  # the step to replay after the load
        rows_next, dense_next = state(client)
        for s in range(4, 7):  # training goes on, far from the checkpoint
            step(client, s)
        assert not np.array_equal(state(client)[0], rows_at)
        result = client.load_latest("ck")
        assert result.chosen is not None and result.chosen.step == 3 and not result.skipped
        assert result.chosen.trainer_states == STATES
        rows, dense = state(client)
        np.testing.assert_array_equal(rows, rows_at)
        np.testing.assert_array_equal(dense, dense_at)
        step(client, 100)  # the same step again: Adagrad's accumulators came back too
        rows, dense = state(client)
        np.testing.assert_array_equal(rows, rows_next)
        np.testing.assert_array_equal(dense, dense_next)
        files = {p.name for p in (tmp_path / "ck" / "ckpt-000003").iterdir()}
        assert {"checkpoint.json", "manifest.server-0.json", "manifest.server-1.json"} <= files


@pytest.mark.timeout(120)
def test_keep_deletes_old_checkpoints_only_after_the_new_one_commits(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with cluster(2, checkpoint_root=str(tmp_path)) as (_servers, client):
        make_tables(client)
        for s in (1, 2):
            step(client, s)
            client.checkpoint(str(root), s, keep=2)
        step(client, 3)
        pending = client.begin_checkpoint(str(root), 3, keep=2)  # snapshot taken, not committed
        assert pending.snapshot_s >= 0 and pending.snapshot_bytes > 0
        assert sorted(p.name for p in root.iterdir()) == [
            "ckpt-000001",
            "ckpt-000002",
            "ckpt-000003",
        ]
        assert not (root / "ckpt-000003" / "checkpoint.json").exists()
        record = pending.result()
        assert record.step == 3
        assert sorted(p.name for p in root.iterdir()) == ["ckpt-000002", "ckpt-000003"]
        assert [s.name for s in client.list_checkpoints(str(root), full=True)] == [
            "ckpt-000003",
            "ckpt-000002",
        ]


@pytest.mark.timeout(120)
def test_corrupt_and_unfinished_checkpoints_are_skipped_and_named(tmp_path: Path) -> None:
    with cluster(2, checkpoint_root=str(tmp_path)) as (_servers, client):
        make_tables(client)
        states = {}
        for s in (1, 2, 3):
            step(client, s)
            states[s] = state(client)
            client.checkpoint("ck", s)
        flip_byte(tmp_path / "ck" / "ckpt-000003" / "emb" / "shard-00005.bin")
        (tmp_path / "ck" / "ckpt-000002" / "checkpoint.json").unlink()  # as if never committed
        step(client, 4)
        client.begin_checkpoint("ck", 4)  # written, never committed
        result = client.load_latest("ck")
        assert result.chosen is not None and result.chosen.name == "ckpt-000001"
        skipped = dict(result.skipped)
        assert list(skipped) == ["ckpt-000004", "ckpt-000003", "ckpt-000002"]
        assert "no checkpoint.json" in skipped["ckpt-000004"]
        assert "DATA_LOSS" in skipped["ckpt-000003"] and "shard-00005.bin" in skipped["ckpt-000003"]
        assert "no checkpoint.json" in skipped["ckpt-000002"]
        rows, dense = state(client)
        np.testing.assert_array_equal(rows, states[1][0])
        np.testing.assert_array_equal(dense, states[1][1])
        local = series.latest_good(tmp_path / "ck")  # the same choice, from the files alone
        assert local.chosen.name == "ckpt-000001"
        assert [n for n, _ in local.skipped] == ["ckpt-000004", "ckpt-000003", "ckpt-000002"]


@pytest.mark.timeout(60)
def test_checkpoint_paths_stay_under_the_roots(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    with cluster(1, checkpoint_root=str(tmp_path / "root")) as (_servers, client):
        make_tables(client)
        for root in (str(tmp_path / "elsewhere"), "../escape", "/etc"):
            with pytest.raises(PSPermissionDeniedError, match="outside this server's checkpoint"):
                client.checkpoint(root, 1)
            with pytest.raises(PSPermissionDeniedError):
                client.export_serving(f"{root}/export")
        with pytest.raises(PSInvalidArgumentError, match="one path component"):
            client.export_serving("ok/..")
        with pytest.raises(CheckpointError, match="integer >= 0"):
            client.checkpoint("ck", -1)
        with pytest.raises(Exception, match="JSON"):
            client.checkpoint("ck", 1, trainer_states={0: {"bad": object()}})
        record = client.checkpoint("ck", 1)
        assert record.directory == tmp_path / "root" / "ck" / "ckpt-000001"
        assert list((tmp_path / "root").iterdir()) == [tmp_path / "root" / "ck"]


@pytest.mark.timeout(180)
def test_server_killed_while_writing_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    def start() -> tuple[list, list[str]]:
        procs, eps = [], []
        for i in range(2):
            proc, ep = start_server_process(
                "--port",
                "0",
                "--server_index",
                str(i),
                "--num_servers",
                "2",
                "--checkpoint_root",
                str(tmp_path),
                "--log_level",
                "WARNING",
            )
            procs.append(proc)
            eps.append(ep)
        return procs, eps

    procs, eps = start()
    big = np.arange(400_000, dtype=np.int64) * 7919  # enough rows for a write that takes a while
    try:
        with PSClient(eps, timeout_s=60) as client:
            make_tables(client)
            client.push_sparse("emb", big, np.ones((big.size, DIM), np.float32))
            client.checkpoint("ck", 1, trainer_states=STATES)
            at_one = client.pull_sparse("emb", big[:5000])
            client.push_sparse("emb", big, np.ones((big.size, DIM), np.float32))
            pending = client.begin_checkpoint("ck", 2)
            os.killpg(procs[1].pid, signal.SIGKILL)  # mid-write (or just after): never committed
            procs[1].wait()
            with pytest.raises(PSRpcError):
                pending.result()
        assert not (tmp_path / "ck" / "ckpt-000002" / "checkpoint.json").exists()
        chosen = series.latest_good(tmp_path / "ck")
        assert chosen.chosen.name == "ckpt-000001"
        assert chosen.skipped[0][0] == "ckpt-000002" and "incomplete" in chosen.skipped[0][1]
    finally:
        for proc in procs:
            stop_process(proc)
    procs, eps = start()  # the job restarts its servers, which load the newest good checkpoint
    try:
        with PSClient(eps, timeout_s=60) as client:
            result = client.load_latest("ck")
            assert result.chosen.name == "ckpt-000001" and result.chosen.trainer_states == STATES
            assert result.skipped[0][0] == "ckpt-000002"
            np.testing.assert_array_equal(client.pull_sparse("emb", big[:5000]), at_one)
    finally:
        for proc in procs:
            stop_process(proc)
