"""Prefetching pulls in the async communicators (``DistributedEmbedding.prefetch``): a prefetch
of exactly the next forward's keys is used, anything else falls back to a normal pull, and sync
mode ignores prefetches (its pulls must see the previous step's update)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from fleet.ps.communicator import AsyncCommunicator, SyncCommunicator
from ps_server import SGD, Constant

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster

pytestmark = pytest.mark.timeout(60)


def _counts(servers: list) -> int:
    return sum(s.state.requests["PullSparse"] for s in servers)


def test_async_prefetch_is_used_only_for_the_same_keys() -> None:
    with cluster(2) as (servers, client):
        client.create_table("t", dim=3, optimizer=SGD(1.0), initializer=Constant(0.5))
        comm = AsyncCommunicator(
            client, 1, lambda: None, queue_size=4, max_merge=1, barrier_interval=0
        )
        comm.add_table("t", 3, 1.0)
        try:
            keys = np.array([3, 9, 42, -7], np.int64)
            comm.prefetch("t", keys)
            comm._prefetched["t"][-1][1].result()  # the background pull has reached the servers
            before = _counts(servers)
            rows = comm.pull_sparse("t", keys)  # served by the prefetch: no new request
            np.testing.assert_array_equal(rows, np.full((4, 3), 0.5, np.float32))
            assert _counts(servers) == before
            comm.prefetch("t", keys[:2])
            rows = comm.pull_sparse("t", keys)  # other keys: the prefetch is dropped, real pull
            assert rows.shape == (4, 3) and _counts(servers) > before
            comm.record_sparse("t", keys[:1], np.ones((1, 3), np.float32))
            comm.step()
            comm.flush()
            np.testing.assert_allclose(comm.pull_sparse("t", keys[:1]), [[-0.5, -0.5, -0.5]])
        finally:
            comm.close()


def test_prefetch_of_the_next_batch_before_this_forward() -> None:
    """The training-loop order prefetch(batch s + 1) -> forward(batch s): the forward still
    gets the prefetch made one step earlier, with no request of its own."""
    with cluster(1) as (servers, client):
        client.create_table("t", dim=2, optimizer=SGD(1.0), initializer=Constant(0.5))
        comm = AsyncCommunicator(
            client, 1, lambda: None, queue_size=4, max_merge=1, barrier_interval=0
        )
        comm.add_table("t", 2, 1.0)
        try:
            batches = [np.array([10 * s + 1, 10 * s + 2], np.int64) for s in range(5)]
            comm.prefetch("t", batches[0])
            forwards = 0
            for s in range(4):
                comm.prefetch("t", batches[s + 1])
                for _, fut in comm._prefetched["t"]:
                    fut.result()
                before = _counts(servers)
                rows = comm.pull_sparse("t", batches[s])
                forwards += _counts(servers) - before
                np.testing.assert_array_equal(rows, np.full((2, 2), 0.5, np.float32))
            assert forwards == 0
            assert [k.tolist() for k, _ in comm._prefetched["t"]] == [batches[4].tolist()]
        finally:
            comm.close()


def test_async_prefetch_sees_every_step_queued_before_it() -> None:
    """A prefetch waits until the sender applied the steps queued before it: the rows it
    returns miss at most the current step, however far the sender lags."""
    with cluster(1) as (_, client):
        client.create_table("t", dim=2, optimizer=SGD(1.0), initializer=Constant(0.5))
        comm = AsyncCommunicator(
            client, 1, lambda: None, queue_size=8, max_merge=1, barrier_interval=0
        )
        comm.add_table("t", 2, 1.0)
        keys = np.array([5, 6], np.int64)
        try:
            for step in range(1, 4):
                comm.record_sparse("t", keys, np.ones((2, 2), np.float32))
                comm.step()  # queued; the sender applies it in the background
                comm.prefetch("t", keys)
                rows = comm.pull_sparse("t", keys)
                np.testing.assert_allclose(rows, np.full((2, 2), 0.5 - step, np.float32))
        finally:
            comm.close()


def test_sync_mode_ignores_prefetch() -> None:
    with cluster(1) as (servers, client):
        client.create_table("t", dim=2, optimizer=SGD(1.0), initializer=Constant(0.0))
        comm = SyncCommunicator(client, 1, lambda: None)
        comm.add_table("t", 2, 1.0)
        keys = np.array([1, 2], np.int64)
        comm.prefetch("t", keys)
        before = _counts(servers)
        comm.pull_sparse("t", keys)
        assert _counts(servers) == before + 1 and comm._pool is None
        comm.close()
