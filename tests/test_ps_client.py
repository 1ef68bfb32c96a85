"""PSClient behaviour: splitting into several requests, retries of idempotent calls only,
readiness, error messages and local argument checks."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from collective.env import find_free_port
from collective.errors import ConfigError
from ps_server import (
    SGD,
    Adagrad,
    Adam,
    DenseTable,
    DenseTableConfig,
    PSClient,
    PSServer,
    SparseTable,
    SparseTableConfig,
    Uniform,
)
from ps_server.errors import TableInputError
from ps_server.rpc.status import PSDeadlineExceededError, PSNotFoundError, PSUnavailableError

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster

SMALL = {"timeout_s": 20, "max_message_mb": 0.1, "shm": False}  # ~40 KB of payload per request


@pytest.mark.timeout(60)
def test_split_apply_push_keeps_each_key_in_one_request() -> None:
    cfg = SparseTableConfig("emb", 8, Adagrad(0.1), Uniform(-0.1, 0.1), num_shards=8)
    ref = SparseTable(cfg)
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 300, 6000).astype(np.int64)  # every key ~20 times
    grads = rng.standard_normal((6000, 8)).astype(np.float32)
    with cluster(2, client_kw=SMALL) as (servers, client):
        client.create_table_from_config(cfg)
        client.push_sparse("emb", keys, grads)
        ref.push(keys, grads)
        probe = np.arange(300, dtype=np.int64)
        # Adagrad is not additive: equal only if each key's occurrences were applied together
        np.testing.assert_allclose(client.pull_sparse("emb", probe), ref.pull(probe), rtol=2e-6)
        pushes = sum(s.state.requests["PushSparse"] for s in servers)
        assert pushes >= 4  # 6000 * 40 B = 240 KB over ~40 KB requests
        big = rng.integers(0, 10**9, 20_000)
        np.testing.assert_array_equal(client.pull_sparse("emb", big), ref.pull(big))


@pytest.mark.timeout(60)
def test_split_sync_push_counts_one_trainer_once() -> None:
    cfg = SparseTableConfig("s", 8, Adam(0.01), Uniform(-0.1, 0.1), num_shards=8)
    ref = SparseTable(cfg)
    rng = np.random.default_rng(1)
    pushes = [
        (
            rng.integers(0, 5000, 3000).astype(np.int64),
            rng.standard_normal((3000, 8)).astype(np.float32),
        )
        for _ in range(2)
    ]
    ref.push(
        np.concatenate([k for k, _ in pushes]),
        np.concatenate([g for _, g in pushes]) / np.float32(2),
    )
    with cluster(2, client_kw=SMALL) as (_, client):
        client.create_table_from_config(cfg)
        client.push_sparse("s", *pushes[0], mode="sync", sync_count=2)
        rounds = [s["sync_rounds_open"]["sparse/s"] for s in client.stats()]
        assert rounds == [{"count": 2, "arrived": 1}] * 2  # several parts, one arrival
        client.push_sparse("s", *pushes[1], mode="sync", sync_count=2)
        probe = np.arange(5000, dtype=np.int64)
        np.testing.assert_allclose(
            client.pull_sparse("s", probe), ref.pull(probe), rtol=1e-5, atol=1e-7
        )


@pytest.mark.timeout(60)
def test_split_dense_init_push_pull() -> None:
    cfg = DenseTableConfig("d", Adam(0.01), num_shards=4)
    ref = DenseTable(cfg)
    w = np.random.default_rng(2).standard_normal(100_000).astype(np.float32)  # 400 KB
    with cluster(2, client_kw=SMALL) as (servers, client):
        client.create_table_from_config(cfg)
        assert client.init_dense("d", "w", w.reshape(100, 1000)) is True
        assert client.init_dense("d", "w", w) is False  # same values, any shape
        ref.init("w", w)
        g = np.full(100_000, 0.5, np.float32)
        assert client.push_dense("d", "w", g) is True
        ref.push("w", g)
        assert client.push_dense("d", "w", g, mode="sync", sync_count=2) is False
        assert client.push_dense("d", "w", 3 * g, mode="sync", sync_count=2) is True
        ref.push("w", 2 * g)
        np.testing.assert_allclose(client.pull_dense("d", "w"), ref.pull("w"), rtol=1e-6)
        assert sum(s.state.requests["PullDense"] for s in servers) >= 10
        assert all(s.state.uploads.num_pending() == 0 for s in servers)


@pytest.mark.timeout(60)
def test_idempotent_calls_retry_pushes_do_not(caplog: pytest.LogCaptureFixture) -> None:
    port = find_free_port()
    server = PSServer(port=port)
    timer = threading.Timer(0.5, server.start)
    timer.start()
    client = PSClient([f"127.0.0.1:{port}"], retries=6, backoff_s=0.2, timeout_s=5)
    try:
        with caplog.at_level(logging.WARNING, logger="ps_server.client"):
            client.create_table("emb", dim=4)  # UNAVAILABLE until the server is up: retried
        assert "CreateTable on 127.0.0.1" in caplog.text and "UNAVAILABLE; retry 1/6" in caplog.text
        timer.join()
        server.stop(grace_s=0)
        caplog.clear()
        client.retries = 2
        client.backoff_s = 0.05
        with caplog.at_level(logging.WARNING, logger="ps_server.client"):
            with pytest.raises(PSUnavailableError):
                client.push_sparse("emb", [1], np.ones((1, 4), np.float32))
            assert "retry" not in caplog.text  # a push is never resent
            with pytest.raises(PSUnavailableError) as info:
                client.pull_sparse("emb", [1])
        assert caplog.text.count("PullSparse on 127.0.0.1") == 2  # retried twice, then raised
        assert f"PullSparse on 127.0.0.1:{port} failed: UNAVAILABLE" in str(info.value)
    finally:
        timer.cancel()
        server.stop(grace_s=0)
        client.close()


@pytest.mark.timeout(30)
def test_wait_ready_times_out_naming_the_server() -> None:
    port = find_free_port()
    with PSClient([f"127.0.0.1:{port}"]) as client:
        t0 = time.monotonic()
        with pytest.raises(PSDeadlineExceededError, match=f"127.0.0.1:{port}.*not serving"):
            client.wait_ready(0.5)
        assert time.monotonic() - t0 < 5


@pytest.mark.timeout(30)
def test_local_argument_checks_and_unknown_table() -> None:
    with cluster(1) as (_, client):
        client.create_table("emb", dim=4)
        with pytest.raises(
            TableInputError, match=r"grads: shape must be .* \(2, 4\), got \(2, 5\)"
        ):
            client.push_sparse("emb", [1, 2], np.ones((2, 5), np.float32))
        with pytest.raises(TableInputError, match="keys: must be a 1-D array of integers"):
            client.pull_sparse("emb", [1.5, 2.0])
        with pytest.raises(ConfigError, match="mode"):
            client.push_sparse("emb", [1], np.ones((1, 4)), mode="async")
        with pytest.raises(ConfigError, match="sync_count"):
            client.push_sparse("emb", [1], np.ones((1, 4)), mode="sync")
        with pytest.raises(ConfigError, match="num_servers"):
            PSClient(["127.0.0.1:1", "127.0.0.1:2"]).create_table("x", dim=2, num_shards=1)
        with pytest.raises(PSNotFoundError, match=r"'nope' does not exist; tables: \['emb'\]"):
            client.pull_sparse("nope", [1])
        with pytest.raises(TableInputError, match="is a sparse table"):
            client.pull_dense("emb", "w")
        with pytest.raises(ConfigError, match="endpoints"):
            PSClient([])


@pytest.mark.timeout(60)
def test_remembered_routing_follows_the_keys() -> None:
    """A push of the keys just pulled reuses their routing; keys changed in place (same array,
    new values) or another shard count are routed afresh — results equal a local table's."""
    cfg = SparseTableConfig("r", 4, SGD(0.5), Uniform(-0.1, 0.1), num_shards=8)
    other = SparseTableConfig("r16", 4, SGD(0.5), Uniform(-0.1, 0.1), num_shards=16)
    refs = {c.name: SparseTable(c) for c in (cfg, other)}
    rng = np.random.default_rng(3)
    keys = rng.integers(-(2**63), 2**63 - 1, 8192, dtype=np.int64)
    grads = rng.standard_normal((8192, 4)).astype(np.float32)
    with cluster(2, client_kw={"timeout_s": 20, "shm": False}) as (_, client):
        for c in (cfg, other):
            client.create_table_from_config(c)
        for step in range(3):
            for name in ("r", "r16"):  # alternating shard counts: never a stale routing
                np.testing.assert_array_equal(client.pull_sparse(name, keys), refs[name].pull(keys))
                client.push_sparse(name, keys, grads)
                refs[name].push(keys, grads)
            keys[: 4096 * step] = rng.integers(0, 10**12, 4096 * step)  # in place
        for name, ref in refs.items():
            np.testing.assert_array_equal(client.pull_sparse(name, keys), ref.pull(keys))
