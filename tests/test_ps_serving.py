"""Serving exports: rows with show count >= min_show (keys, values), dense tables, the caller's
model config; ``python -m ps_server --serve`` serves them read-only (every mutating RPC refused
with FAILED_PRECONDITION naming read-only serving; unknown ids pull zeros); a Load of the next
delta export updates a serving server in place; ``fleet.ps.ServingModel`` reads the same rows
from the directory or from the servers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ps_server import Adagrad, PSClient, Uniform
from ps_server.rpc.status import PSFailedPreconditionError

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster, start_server_process, stop_process

DIM = 4
HOT = np.arange(100, dtype=np.int64) * 31  # pushed 3 times
COLD = np.arange(100, 150, dtype=np.int64) * 31  # pushed once: below min_show
UNKNOWN = np.array([-1, 7, 10**15], dtype=np.int64)
CONFIG = {"tables": {"emb": {"dim": DIM, "slots": ["user", "item"]}}, "version": 3}


def push(client: PSClient, keys: np.ndarray, times: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(times):
        client.push_sparse("emb", keys, rng.standard_normal((keys.size, DIM)).astype(np.float32))


@pytest.mark.timeout(180)
def test_export_serve_read_only_and_update_with_a_delta(tmp_path: Path) -> None:
    with cluster(2, checkpoint_root=str(tmp_path)) as (_servers, client):
        client.create_table("emb", DIM, Adagrad(0.1), Uniform(-0.5, 0.5), num_shards=8)
        client.create_dense_table("__dense__", Adagrad(0.1), num_shards=2)
        client.init_dense("__dense__", "dense", np.arange(5, dtype=np.float32))
        push(client, HOT, 3, 0)
        push(client, COLD, 1, 1)
        base = client.export_serving("exports/base", min_show=2, model_config=CONFIG)
        assert base.kind == "serving" and base.rows == {"__dense__": 1, "emb": HOT.size}
        assert base.extra["model_config"] == CONFIG and base.extra["min_show"] == 2
        want_base = client.pull_sparse("emb", HOT)
        push(client, HOT[:10], 1, 2)  # the hour's changes
        push(client, COLD[:5], 1, 3)  # now pushed twice: admitted to serving
        delta = client.export_serving("exports/d1", min_show=2, mode="delta")
        assert delta.mode == "delta" and delta.extra["follows"] == "base"
        want_hot, want_cold = client.pull_sparse("emb", HOT), client.pull_sparse("emb", COLD[:5])
    manifest = json.loads((tmp_path / "exports/base/manifest.server-0.json").read_text())
    assert manifest["tables"]["emb"]["state_dim"] == 0  # no optimizer state in a serving copy

    proc, ep = start_server_process(
        "--port", "0", "--serve", str(tmp_path / "exports/base"), "--checkpoint_root", str(tmp_path)
    )
    try:
        with PSClient([ep], timeout_s=30) as serving:
            np.testing.assert_array_equal(serving.pull_sparse("emb", HOT), want_base)
            assert not serving.pull_sparse("emb", np.concatenate([COLD, UNKNOWN])).any()
            np.testing.assert_array_equal(
                serving.pull_dense("__dense__", "dense"), np.arange(5, dtype=np.float32)
            )
            refused = {
                "PushSparse": lambda: serving.push_sparse(
                    "emb", HOT[:2], np.ones((2, DIM), np.float32)
                ),
                "CreateTable": lambda: serving.create_table("other", DIM),
                "InitDense": lambda: serving.init_dense("__dense__", "x", np.ones(2, np.float32)),
                "PushDense": lambda: serving.push_dense(
                    "__dense__", "dense", np.ones(5, np.float32)
                ),
                "Save": lambda: serving.save("stolen"),
                "Shrink": lambda: serving.shrink("emb", 0),
                "EndDay": serving.end_day,
                "CheckpointBegin": lambda: serving.checkpoint("ck", 1),
            }
            for op, call in refused.items():
                with pytest.raises(PSFailedPreconditionError, match="read-only export") as info:
                    call()
                assert op in str(info.value)
            np.testing.assert_array_equal(serving.pull_sparse("emb", HOT), want_base)  # unchanged
            stats = serving.stats()[0]
            assert stats["serving"][0]["extra"]["model_config"] == CONFIG
            assert stats["errors"]["PushSparse:FAILED_PRECONDITION"] == 1
            serving.load(str(tmp_path / "exports/d1"))  # the hourly delta, in place
            np.testing.assert_array_equal(serving.pull_sparse("emb", HOT), want_hot)
            np.testing.assert_array_equal(serving.pull_sparse("emb", COLD[:5]), want_cold)
            assert not serving.pull_sparse("emb", COLD[5:]).any()
            with pytest.raises(PSFailedPreconditionError, match="follows export 'base', not 'd1'"):
                serving.load(str(tmp_path / "exports/d1"))

        from fleet.ps import ServingModel

        with ServingModel([ep]) as remote:
            np.testing.assert_array_equal(remote.pull("emb", HOT), want_hot)
            assert remote.model_config == CONFIG
        local = ServingModel(tmp_path / "exports/base", deltas=[tmp_path / "exports/d1"])
        np.testing.assert_array_equal(local.pull("emb", HOT), want_hot)
        assert not local.pull("emb", UNKNOWN).any()
        stop_process(proc)
    finally:
        stop_process(proc)


@pytest.mark.timeout(60)
def test_serve_refuses_what_is_not_a_serving_export(tmp_path: Path) -> None:
    with cluster(1, checkpoint_root=str(tmp_path)) as (_servers, client):
        client.create_table("emb", DIM, num_shards=4)
        push(client, HOT, 1, 0)
        client.export_serving("exports/base")
        client.push_sparse("emb", HOT, np.ones((HOT.size, DIM), np.float32))
        client.export_serving("exports/d1", mode="delta")
        client.checkpoint("ck", 1)
        client.begin_checkpoint("ck", 2)  # never committed
    from ps_server import PSServer
    from ps_server.errors import CheckpointError

    for dirs, message in (
        ([tmp_path / "ck/ckpt-000001"], "is a checkpoint, not a serving export"),
        ([tmp_path / "ck/ckpt-000002"], "no checkpoint.json"),
        ([tmp_path / "exports/d1"], "a delta export where a all export is needed"),
    ):
        with pytest.raises(CheckpointError, match=message):
            PSServer(port=0).serve_export([str(d) for d in dirs])


@pytest.mark.timeout(180)
def test_a_trainer_0_restarted_alone_does_not_export_again(tmp_path: Path) -> None:
    """Async trainers meeting through fleetrun's coordinator: trainer 0 SIGKILLs itself right
    after ``export_serving`` and fleetrun restarts it alone; its rerun replays the export's rounds
    and gets the record of the export made before, without exporting again (the export's commit
    file is not rewritten)."""
    from conftest import SCRIPTS, run_fleetrun

    log, out = tmp_path / "log", tmp_path / "out"
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "2",
        "--log_dir",
        str(log),
        "--ps_checkpoint_dir",
        str(tmp_path / "ckpt"),
        "--ps_checkpoint_interval",
        "60",
        "--max_restarts",
        "1",
        "--tee",
        "none",
        "--grace_period",
        "2",
        str(SCRIPTS / "ps_export_replay.py"),
        "--export",
        str(log / "export"),
        "--out",
        str(out),
        timeout=150,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "restarted: trainer 0 only" in r.stderr, r.stderr[-3000:]
    first = json.loads(Path(f"{out}.0.first.json").read_text())
    rerun = json.loads(Path(f"{out}.0.rerun.json").read_text())
    assert rerun == first, (first, rerun)  # same record, commit file untouched since
    assert json.loads(Path(f"{out}.1.first.json").read_text())["record"] == first["record"]
