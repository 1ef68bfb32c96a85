"""The communicator and the thread helpers under several training threads (in-process servers):
pushes from two threads all arrive, each thread's step pushes only its own gradients, a
prefetch made for one thread's batch is used by whichever thread trains it, model copies
share parameter storage but not gradients, and a cut waits for the other threads' steps."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fleet.ps import threads
from fleet.ps.communicator import AsyncCommunicator, GeoCommunicator
from ps_server import SGD, Constant

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster

pytestmark = pytest.mark.timeout(60)
STEPS = 200


def _two_threads(work) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as err:
            errors.append(err)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errors, errors


@pytest.mark.parametrize("kind", ["async", "geo"])
def test_pushes_of_two_threads_all_arrive(kind: str) -> None:
    with cluster(2) as (_servers, client):
        client.create_table("t", dim=2, optimizer=SGD(1.0), initializer=Constant(0.0))
        if kind == "async":
            comm = AsyncCommunicator(
                client, 1, lambda: None, queue_size=8, max_merge=4, barrier_interval=0
            )
        else:
            comm = GeoCommunicator(client, 1, lambda: None, k_steps=3)
        comm.add_table("t", 2, 1.0)
        keys = [np.array([1, 2, 3], np.int64), np.array([3, 4], np.int64)]

        def work(i: int) -> None:
            for _ in range(STEPS):
                comm.pull_sparse("t", keys[i])
                # a gradient of -1 per key and step: each row ends at the number of pushes
                comm.record_sparse("t", keys[i], -np.ones((len(keys[i]), 2), np.float32))
                time.sleep(0)  # the other thread records between this thread's record and step
                comm.step()

        try:
            _two_threads(work)
            comm.flush()
            rows = client.pull_sparse("t", np.array([1, 2, 3, 4], np.int64))
            np.testing.assert_allclose(rows[:, 0], [STEPS, STEPS, 2 * STEPS, STEPS])
            assert comm.steps == 2 * STEPS
        finally:
            comm.close()


def test_a_prefetch_for_one_thread_is_used_by_the_other() -> None:
    with cluster(1) as (servers, client):
        client.create_table("t", dim=2, optimizer=SGD(1.0), initializer=Constant(0.5))
        comm = AsyncCommunicator(
            client, 1, lambda: None, queue_size=4, max_merge=1, barrier_interval=0
        )
        comm.add_table("t", 2, 1.0)
        comm.prefetch_depth = 3
        try:
            a, b = np.array([1, 2], np.int64), np.array([5, 6], np.int64)
            comm.prefetch("t", a)
            comm.prefetch("t", b)
            for _, future in comm._prefetched["t"]:
                future.result()
            before = sum(s.state.requests["PullSparse"] for s in servers)
            got: dict[int, np.ndarray] = {}
            _two_threads(lambda i: got.__setitem__(i, comm.pull_sparse("t", (b, a)[i])))
            # the later batch first, then the earlier one: both served by their prefetches
            assert sum(s.state.requests["PullSparse"] for s in servers) == before
            np.testing.assert_allclose(got[0], 0.5)
        finally:
            comm.close()


def test_model_copies_share_storage_not_gradients() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    one, aliases = threads.replicate(model)
    two, _ = threads.replicate(model)
    for p, q, r in zip(model.parameters(), one.parameters(), two.parameters()):
        assert q is not p and q.data_ptr() == p.data_ptr() == r.data_ptr()
        assert aliases[id(p)] is q
    assert one[1].running_mean is model[1].running_mean  # buffers shared as they are
    one(torch.ones(4, 3)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in two.parameters())
    with torch.no_grad():  # a refresh of the shared values (another thread's step) ...
        model[0].weight.add_(1.0)
    assert torch.equal(one[0].weight, model[0].weight)
    loss = two(torch.ones(4, 3)).sum()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    loss.backward()  # ... does not invalidate a backward in flight in a copy
    assert threads.original(one[0]) is model[0]


def test_a_cut_waits_for_the_other_threads_step() -> None:
    gate = threads.StepGate()
    gate.running = 1
    order: list[str] = []
    inside = threading.Event()

    def other() -> None:
        gate.enter()
        inside.set()
        time.sleep(0.3)
        order.append("step done")
        gate.leave()
        gate.enter()  # held back until the cut ends
        order.append("next step")
        gate.leave()

    t = threading.Thread(target=other)
    t.start()
    inside.wait(5)
    gate.enter()
    with gate.quiesce(timeout=10):  # the caller is at its own step boundary
        order.append("cut")
        time.sleep(0.1)
    gate.leave()
    t.join(10)
    assert order == ["step done", "cut", "next step"]


def test_resolve_thread_num() -> None:
    class Ds:
        thread_num = 3

    assert threads.resolve(None, Ds(), "async") == 3
    assert threads.resolve(None, [], "async") == 1
    assert threads.resolve(2, Ds(), "geo") == 2
    assert threads.resolve(None, Ds(), None) == 1  # not a PS trainer
    assert threads.resolve(4, Ds(), "sync") == 1
    from collective.errors import ConfigError

    with pytest.raises(ConfigError, match="thread_num"):
        threads.resolve(0, Ds(), "async")


def test_threads_need_the_distributed_optimizer() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Comm:
        dense: list = []

    assert threads.check_shareable(2, opt, Comm()) == 1  # its step would miss each thread's grads
    Comm.dense = list(model.parameters())
    assert threads.check_shareable(2, opt, Comm()) == 2
    assert threads.check_shareable(2, opt, Comm(), lookup_source=True) == 1  # the pass cache
