"""The gRPC parameter server end to end: real servers on 127.0.0.1 (port 0) in this process,
the real PSClient; results compared with one in-process table of the same config."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ps_server import (
    SGD,
    Adagrad,
    Adam,
    Constant,
    DenseTable,
    DenseTableConfig,
    SparseTable,
    SparseTableConfig,
    Uniform,
)
from ps_server.core.routing import shard_of
from ps_server.rpc.status import PSAlreadyExistsError, PSDeadlineExceededError, PSUnavailableError

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster

CFG = SparseTableConfig("emb", 8, Adagrad(0.05), Uniform(-0.1, 0.1), num_shards=16, seed=3)


def _batch(rng: np.random.Generator, n: int = 400, dim: int = 8) -> tuple[np.ndarray, np.ndarray]:
    keys = rng.integers(-500, 500, size=n).astype(np.int64)  # many duplicates, negative keys
    return keys, rng.standard_normal((n, dim)).astype(np.float32)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_pull_push_equal_one_table(num_servers: int) -> None:
    ref = SparseTable(CFG)
    rng = np.random.default_rng(num_servers)
    with cluster(num_servers) as (servers, client):
        assert client.create_table_from_config(CFG) is True
        for _ in range(3):
            keys, grads = _batch(rng)
            np.testing.assert_array_equal(client.pull_sparse("emb", keys), ref.pull(keys))
            stats = client.push_sparse("emb", keys, grads)
            ref_stats = ref.push(keys, grads)
            assert stats["num_keys"] == ref_stats.num_keys
            assert stats["applied"] == ref_stats.applied
        probe = np.arange(-600, 600, dtype=np.int64)
        np.testing.assert_array_equal(client.pull_sparse("emb", probe), ref.pull(probe))
        # each key lives on the server that owns its shard, and nowhere else
        total = 0
        for index, server in enumerate(servers):
            table = server.state.tables["emb"]
            held = table.store.keys[table.store.live_rows()]
            assert (shard_of(held, CFG.num_shards) % num_servers == index).all()
            total += table.num_rows
        assert total == ref.num_rows


@pytest.mark.timeout(30)
def test_client_reorders_replies_with_duplicates() -> None:
    cfg = SparseTableConfig("t", 4, SGD(0.1), Uniform(-1, 1), num_shards=8)
    ref = SparseTable(cfg)
    with cluster(3) as (_, client):
        client.create_table_from_config(cfg)
        keys = np.array([9, 3, 9, 2**62, -7, 3, 3, 0, 9], dtype=np.int64)
        rows = client.pull_sparse("t", keys)
        assert rows.shape == (9, 4) and rows.dtype == np.float32
        for i, k in enumerate(keys):
            np.testing.assert_array_equal(rows[i], ref.pull(np.array([k]))[0])
        assert client.pull_sparse("t", np.zeros(0, np.int64)).shape == (0, 4)
        assert client.pull_sparse("t", [5, 5]).shape == (2, 4)  # lists work too


@pytest.mark.timeout(30)
def test_sync_mode_applies_the_mean_once() -> None:
    cfg = SparseTableConfig("s", 4, Adam(0.1), Uniform(-0.1, 0.1), num_shards=8)
    rng = np.random.default_rng(0)
    ka, ga = _batch(rng, 50, 4)
    kb, gb = _batch(rng, 70, 4)
    ref = SparseTable(cfg)
    ref.push(np.concatenate([ka, kb]), np.concatenate([ga, gb]) / np.float32(2))
    with cluster(2) as (servers, client):
        client.create_table_from_config(cfg)
        before = client.pull_sparse("s", ka)
        # the first of W=2 returns at once, having only accumulated
        assert client.push_sparse("s", ka, ga, mode="sync", sync_count=2)["applied"] == 0
        np.testing.assert_array_equal(client.pull_sparse("s", ka), before)
        open_rounds = [st["sync_rounds_open"] for st in client.stats()]
        assert all(r == {"sparse/s": {"count": 2, "arrived": 1}} for r in open_rounds)
        client.push_sparse("s", kb, gb, mode="sync", sync_count=2)
        probe = np.unique(np.concatenate([ka, kb]))
        np.testing.assert_allclose(client.pull_sparse("s", probe), ref.pull(probe), rtol=1e-6)
        # a second round, W=2 concurrent trainers (threads); one has no keys at all
        ref.push(ka, ga / np.float32(2))
        start = threading.Barrier(2)
        errors: list[BaseException] = []

        def trainer(keys: np.ndarray, grads: np.ndarray) -> None:
            try:
                start.wait()
                client.push_sparse("s", keys, grads, mode="sync", sync_count=2)
            except BaseException as err:  # noqa: BLE001 - reported by the assert below
                errors.append(err)

        threads = [
            threading.Thread(target=trainer, args=a)
            for a in [(ka, ga), (np.zeros(0, np.int64), np.zeros((0, 4), np.float32))]
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        np.testing.assert_allclose(client.pull_sparse("s", probe), ref.pull(probe), rtol=1e-6)
        assert sum(s.state.events["sync_rounds_applied"] for s in servers) == 4


@pytest.mark.timeout(30)
def test_delta_mode_adds_without_optimizer() -> None:
    cfg = SparseTableConfig("g", 3, Adagrad(0.5), Uniform(-1, 1), num_shards=8, seed=7)
    ref = SparseTable(cfg)
    keys = np.array([1, 2, 1, 40], dtype=np.int64)
    deltas = np.arange(12, dtype=np.float32).reshape(4, 3)
    with cluster(2) as (_, client):
        client.create_table_from_config(cfg)
        client.pull_sparse("g", [2])  # key 2 exists, the others are created by the delta
        stats = client.push_sparse("g", keys, deltas, mode="delta")
        assert stats["applied"] == 3
        expect = ref.initial_values(np.array([1, 2, 40])) + np.array(
            [deltas[0] + deltas[2], deltas[1], deltas[3]]
        )
        np.testing.assert_allclose(client.pull_sparse("g", [1, 2, 40]), expect, rtol=1e-6)


@pytest.mark.timeout(30)
def test_dense_init_pull_push_modes() -> None:
    cfg = DenseTableConfig("d", SGD(0.5), num_shards=4)
    ref = DenseTable(cfg)
    w = np.linspace(-1, 1, 10, dtype=np.float32)
    with cluster(2) as (_, client):
        client.create_table_from_config(cfg)
        for name in ("a", "b", "c"):
            assert client.init_dense("d", name, w) is True
            assert client.init_dense("d", name, w) is False  # idempotent
            ref.init(name, w)
        g = np.ones(10, np.float32)
        assert client.push_dense("d", "a", g) is True
        ref.push("a", g)
        assert client.push_dense("d", "b", g, mode="sync", sync_count=2) is False
        assert client.push_dense("d", "b", 3 * g, mode="sync", sync_count=2) is True
        ref.push("b", 2 * g)
        assert client.push_dense("d", "c", g, mode="delta") is True
        for name in ("a", "b"):
            np.testing.assert_allclose(client.pull_dense("d", name), ref.pull(name), rtol=1e-6)
        np.testing.assert_allclose(client.pull_dense("d", "c"), w + 1, rtol=1e-6)


@pytest.mark.timeout(30)
def test_create_is_idempotent_and_mismatch_shows_both_configs() -> None:
    with cluster(2) as (_, client):
        cfg = client.create_table("emb", dim=8)
        assert client.create_table("emb", dim=8) == cfg
        assert client.create_table_from_config(cfg) is False
        with pytest.raises(PSAlreadyExistsError) as info:
            client.create_table("emb", dim=16, optimizer=Adagrad(0.1))
        msg = str(info.value)
        assert "ALREADY_EXISTS" in msg and "127.0.0.1:" in msg
        assert "dim: 8 (existing) != 16 (requested)" in msg
        assert "existing:" in msg and "requested:" in msg and "'adagrad'" in msg
        assert client.pull_sparse("emb", [1]).shape == (1, 8)  # still the first config


@pytest.mark.timeout(60)
def test_save_load_delta_and_reshard_2_to_3(tmp_path: Path) -> None:
    cfg = SparseTableConfig("emb", 4, Adagrad(0.1), Uniform(-0.1, 0.1), num_shards=12)
    dcfg = DenseTableConfig("dense", Adam(0.01), num_shards=4)
    rng = np.random.default_rng(5)
    probe = np.arange(-500, 500, dtype=np.int64)
    with cluster(2, checkpoint_root=str(tmp_path)) as (_, client):
        client.create_table_from_config(cfg)
        client.create_table_from_config(dcfg)
        client.init_dense("dense", "w", np.ones(6, np.float32))
        client.push_sparse("emb", *_batch(rng, 300, 4))
        manifests = client.save(str(tmp_path / "full"))
        assert [m["writer"] for m in manifests] == ["server-0", "server-1"]
        client.push_sparse("emb", *_batch(rng, 300, 4))
        client.push_dense("dense", "w", np.full(6, 0.5, np.float32))
        client.end_day()
        client.save(str(tmp_path / "delta"), mode="delta")
        want_stats = sum(s["tables"]["emb"]["num_rows"] for s in client.stats())
        want_rows = client.pull_sparse("emb", probe)  # (creates the rows it lacks)
        want_dense = client.pull_dense("dense", "w")
    with cluster(3, checkpoint_root=str(tmp_path)) as (servers, client):
        rows = client.load(str(tmp_path / "full"))
        assert set(rows) == {"emb", "dense"}
        client.load(str(tmp_path / "delta"))
        assert sum(s["tables"]["emb"]["num_rows"] for s in client.stats()) == want_stats
        np.testing.assert_array_equal(client.pull_sparse("emb", probe), want_rows)
        np.testing.assert_array_equal(client.pull_dense("dense", "w"), want_dense)
        assert all(len(s.state.tables["emb"].shards) == 4 for s in servers)


@pytest.mark.timeout(30)
def test_shrink_and_end_day_via_rpc() -> None:
    cfg = SparseTableConfig("emb", 2, SGD(0.1), Constant(0.0), num_shards=8)
    ref = SparseTable(cfg)
    old, new = np.arange(0, 100, dtype=np.int64), np.arange(1000, 1050, dtype=np.int64)
    with cluster(2) as (_, client):
        client.create_table_from_config(cfg)
        client.push_sparse("emb", old, np.ones((100, 2), np.float32))
        ref.push(old, np.ones((100, 2), np.float32))
        for _ in range(2):
            client.end_day()
            ref.end_day()
        client.push_sparse("emb", new, np.ones((50, 2), np.float32))
        ref.push(new, np.ones((50, 2), np.float32))
        client.end_day()
        ref.end_day()
        assert client.shrink("emb", 1) == ref.shrink(1) == 100
        assert sum(s["tables"]["emb"]["num_rows"] for s in client.stats()) == ref.num_rows == 50


@pytest.mark.timeout(30)
def test_barrier_three_threads_and_timeout() -> None:
    with cluster(2) as (_, client):
        generations: list[int] = []

        def arrive() -> None:
            generations.append(client.barrier("step", 3, timeout_s=10))

        for round_ in (1, 2):  # the name is reusable: a new generation each time
            threads = [threading.Thread(target=arrive) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(15)
            assert generations[-3:] == [round_] * 3
        with pytest.raises(PSDeadlineExceededError, match="only 1 of 2 callers arrived"):
            client.barrier("lonely", 2, timeout_s=0.3)
        assert client.stats()[0]["barriers"]["lonely"]["arrived"] == 0  # the timed-out withdrew


@pytest.mark.timeout(30)
def test_stats_and_stop() -> None:
    with cluster(2) as (servers, client):
        client.create_table("emb", dim=4)
        client.pull_sparse("emb", np.arange(100))
        stats = client.stats()
        assert [s["server_index"] for s in stats] == [0, 1]
        assert sum(s["tables"]["emb"]["num_rows"] for s in stats) == 100
        assert all(s["tables"]["emb"]["memory_bytes"] > 0 for s in stats)
        assert all(s["requests"]["CreateTable"] == 1 for s in stats)
        assert all(s["requests"]["PullSparse"] == 1 for s in stats)
        client.wait_ready(5)
        client.stop_servers()
        assert all(s.wait(10) for s in servers)
        client.retries = 0
        with pytest.raises(PSUnavailableError, match="UNAVAILABLE"):
            client.stats()
