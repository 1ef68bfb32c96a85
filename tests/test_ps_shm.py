"""The same-host shared-memory path of sparse pulls and pushes (ps_server/rpc/shm.py) against live
servers: the same results as TCP, the fallback when a server cannot attach, a server that lost
its segments, bad segment requests, and nothing left in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from ps_server import Adagrad, PSClient, SparseTableConfig, Uniform
from ps_server.rpc.proto import ps_pb2, ps_pb2_grpc
from ps_server.rpc.shm import MIN_SHM_BYTES, SHM_DIR
from ps_server.rpc.status import PSFailedPreconditionError

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster, start_server_process, stop_process

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

DIM = 16
N = 40_000  # 40k keys x (8 + 64) bytes = 2.9 MB per request: well above MIN_SHM_BYTES
assert N * (8 + 4 * DIM) // 2 > MIN_SHM_BYTES


def _cfg(name: str) -> SparseTableConfig:
    return SparseTableConfig(name, DIM, Adagrad(0.1), Uniform(-0.1, 0.1), num_shards=16)


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(-(2**63), 2**63 - 1, size=N // 2, dtype=np.int64)
    keys = np.concatenate([keys, keys[: N // 2]])  # every key twice: duplicates summed
    rng.shuffle(keys)
    return keys, rng.standard_normal((N, DIM), dtype=np.float32)


def _attaches(client: PSClient) -> int:
    return sum(s["requests"].get("ShmAttach", 0) for s in client.stats())


def _our_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("fleetps_")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_servers", [1, 2])
def test_shm_equals_tcp(num_servers: int) -> None:
    """Pull, push (apply), pull again: byte-identical through shm and through TCP (two clusters
    holding the same table)."""
    before = _our_segments()
    with contextlib.ExitStack() as stack:
        servers, fast = stack.enter_context(
            cluster(num_servers, client_kw={"timeout_s": 20, "shm": True})
        )
        _, slow = stack.enter_context(
            cluster(num_servers, client_kw={"timeout_s": 20, "shm": False})
        )
        for client in (fast, slow):
            client.create_table_from_config(_cfg("a"))
        for step in range(3):
            keys, grads = _batch(step)
            np.testing.assert_array_equal(fast.pull_sparse("a", keys), slow.pull_sparse("a", keys))
            assert fast.push_sparse("a", keys, grads) == slow.push_sparse("a", keys, grads)
        keys, _ = _batch(0)
        np.testing.assert_array_equal(fast.pull_sparse("a", keys), slow.pull_sparse("a", keys))
        # the shm path was taken (a segment per server and call in flight), small requests
        # still go through TCP, and the segments were unlinked once attached
        assert num_servers <= _attaches(fast) <= 4 * num_servers
        assert _attaches(slow) == 0
        np.testing.assert_array_equal(
            fast.pull_sparse("a", keys[:10]), slow.pull_sparse("a", keys[:10])
        )
        assert _our_segments() - before == set()
        assert sum(len(s.state.shm) for s in servers) > 0
    assert _our_segments() - before == set()


@pytest.mark.timeout(120)
def test_sync_push_through_shm_equals_tcp() -> None:
    """Two trainers' SYNC pushes through shm apply their mean once, as over TCP."""
    with (
        cluster(2, client_kw={"timeout_s": 20, "shm": True}) as (_, fast),
        cluster(2, client_kw={"timeout_s": 20, "shm": False}) as (_, slow),
    ):
        trainers = [
            PSClient(c.endpoints, timeout_s=20, shm=c is fast) for c in (fast, fast, slow, slow)
        ]
        try:
            keys, _ = _batch(1)
            for c in (fast, slow):
                c.create_table_from_config(_cfg("a"))
                c.pull_sparse("a", keys)
            grads = [_batch(10 + i)[1] for i in range(2)]

            def push(client: PSClient, g: np.ndarray) -> None:
                client.push_sparse("a", keys, g, mode="sync", sync_count=2)

            threads = [
                threading.Thread(target=push, args=(t, grads[i % 2]))
                for i, t in enumerate(trainers)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            np.testing.assert_array_equal(fast.pull_sparse("a", keys), slow.pull_sparse("a", keys))
            assert _attaches(fast) >= 2 and _attaches(slow) == 0
        finally:
            for t in trainers:
                t.close()


@pytest.mark.timeout(120)
def test_server_without_shm_gets_tcp() -> None:
    """A server that cannot attach (here: FLEET_PS_SHM=0 in its environment, as a server on
    another host or in another container) gets the same requests over TCP, without an error."""
    proc, ep = start_server_process("--port", "0", env={"FLEET_PS_SHM": "0"})
    try:
        with PSClient([ep], timeout_s=20, shm=True) as client:
            client.wait_ready(20)
            client.create_table_from_config(_cfg("a"))
            keys, grads = _batch(2)
            first = client.pull_sparse("a", keys)
            client.push_sparse("a", keys, grads)
            assert not np.array_equal(client.pull_sparse("a", keys), first)
            assert _attaches(client) == 1  # tried once, then TCP for good
            assert client._shm is not None and 0 in client._shm.off
            client.stop_servers()
        assert proc.wait(30) == 0
    finally:
        stop_process(proc)


@pytest.mark.timeout(120)
def test_server_that_lost_its_segments() -> None:
    """The server forgets its segments (as after a restart): a pull re-attaches and succeeds; so
    does an APPLY push (refused unread, sent once more over a fresh segment: applied once); a
    SYNC push fails with FAILED_PRECONDITION naming the segment."""
    with cluster(1, client_kw={"timeout_s": 20, "shm": True}) as (servers, client):
        client.create_table_from_config(_cfg("a"))
        keys, grads = _batch(3)
        expected = client.pull_sparse("a", keys)
        servers[0].state.shm.close()
        np.testing.assert_array_equal(client.pull_sparse("a", keys), expected)
        servers[0].state.shm.close()
        with pytest.raises(  # SYNC: a push is never sent twice
            PSFailedPreconditionError, match=r"shm: segment fleetps_\w+ is not attached"
        ):
            client.push_sparse("a", keys, grads, mode="sync", sync_count=1)
        np.testing.assert_array_equal(client.pull_sparse("a", keys), expected)  # nothing applied
        normal = client.push_sparse("a", keys, grads)
        assert not np.array_equal(client.pull_sparse("a", keys), expected)
        servers[0].state.shm.close()
        assert client.push_sparse("a", keys, grads) == normal  # the same keys, applied once


@pytest.mark.timeout(60)
def test_bad_shm_requests_keep_the_server_serving() -> None:
    with cluster(1, client_kw={"timeout_s": 20, "shm": True}) as (_, client):
        client.create_table_from_config(_cfg("a"))
        keys, _ = _batch(4)
        expected = client.pull_sparse("a", keys)  # attaches one segment
        stub = ps_pb2_grpc.ParameterServerStub(client._channels[0])
        cases = [
            (
                ps_pb2.ShmAttachRequest(segment="../etc/passwd", token=b"x" * 16),
                "ShmAttach",
                grpc.StatusCode.INVALID_ARGUMENT,
                "is not fleetps_",
            ),
            (
                ps_pb2.ShmAttachRequest(segment="fleetps_" + "0" * 32, token=b"x" * 16),
                "ShmAttach",
                grpc.StatusCode.FAILED_PRECONDITION,
                "cannot open segment",
            ),
            (
                ps_pb2.PullSparseRequest(
                    table="a", shm_segment="fleetps_" + "1" * 32, shm_num_keys=4
                ),
                "PullSparse",
                grpc.StatusCode.FAILED_PRECONDITION,
                "is not attached",
            ),
        ]
        seg = next(iter(client._shm.attached))  # type: ignore[union-attr]
        cases.append(
            (
                ps_pb2.PullSparseRequest(table="a", shm_segment=seg, shm_num_keys=10**9),
                "PullSparse",
                grpc.StatusCode.INVALID_ARGUMENT,
                "the segment has",
            )
        )
        cases.append(
            (
                ps_pb2.PullSparseRequest(
                    table="a", keys=b"\0" * 8, shm_segment=seg, shm_num_keys=1
                ),
                "PullSparse",
                grpc.StatusCode.INVALID_ARGUMENT,
                "carries no keys",
            )
        )
        for request, method, code, text in cases:
            with pytest.raises(grpc.RpcError) as info:
                getattr(stub, method)(request, timeout=10)
            assert info.value.code() == code, (method, info.value.details())
            assert text in info.value.details()
        np.testing.assert_array_equal(client.pull_sparse("a", keys), expected)
