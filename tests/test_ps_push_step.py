"""PushStep: a trainer's async step (sparse pushes, then the dense push whose reply carries the
block's values) in one call. It must leave the servers exactly as the separate PushSparse and
PushDense calls do, through shared memory or TCP; several servers, and an older server that
does not know PushStep, get the separate calls; the async sender sends one call per step."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from fleet.ps.communicator import DENSE_BLOCK, DENSE_TABLE, AsyncCommunicator
from ps_server import Adagrad, Adam, Normal
from ps_server.rpc.proto import ps_pb2, ps_pb2_grpc
from ps_server.rpc.rpc_client import Call
from ps_server.rpc.servicer import ParameterServerServicer
from ps_server.rpc.status import PSRpcError
from ps_server.rpc.step_client import _separate

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster

DENSE = 1000


def _tables(client) -> None:
    for name in ("a", "b"):
        client.create_table(
            name, dim=4, optimizer=Adagrad(0.1), initializer=Normal(0.0, 0.1), num_shards=8
        )
    client.create_dense_table("d", optimizer=Adam(0.01))
    client.init_dense("d", "w", np.linspace(-1, 1, DENSE, dtype=np.float32))


def _steps(seed: int = 0) -> list[tuple[list, tuple]]:
    """Three steps: table a large (shared memory when on), table b small or empty."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(3):
        a = np.unique(rng.integers(0, 50_000, 6000)).astype(np.int64)
        b = np.arange(s * 7, dtype=np.int64)  # empty in the first step
        sparse = [
            ("a", a, rng.standard_normal((a.shape[0], 4)).astype(np.float32)),
            ("b", b, rng.standard_normal((b.shape[0], 4)).astype(np.float32)),
        ]
        out.append((sparse, ("d", "w", rng.standard_normal(DENSE).astype(np.float32))))
    return out


def _run(num_servers: int, fused: bool, shm: bool) -> tuple[dict, list, dict]:
    """Rows of both tables and the dense values after the steps; the values each step
    returned; the servers' request counts."""
    with cluster(num_servers, client_kw={"timeout_s": 20, "shm": shm}) as (servers, client):
        _tables(client)
        returned = []
        for sparse, dense in _steps():
            send = client.push_step if fused else lambda s, d: _separate(client, s, d)
            stats, values = send(sparse, dense)
            assert [st["num_keys"] for st in stats] == [len(k) for _, k, _ in sparse]
            returned.append(values)
        keys = np.arange(60_000, dtype=np.int64)
        state = {
            "a": client.pull_sparse("a", keys),
            "b": client.pull_sparse("b", keys[:20]),
            "d": client.pull_dense("d", "w"),
        }
        counts: dict[str, int] = {}
        for s in servers:
            for op, n in s.state.requests.items():
                counts[op] = counts.get(op, 0) + n
    return state, returned, counts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", [True, False])
def test_push_step_equals_separate_calls(shm: bool) -> None:
    fused, fused_values, fused_counts = _run(1, True, shm)
    apart, apart_values, apart_counts = _run(1, False, shm)
    for name in fused:
        np.testing.assert_array_equal(fused[name], apart[name], err_msg=name)
    for got, want in zip(fused_values, apart_values, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(fused_values[-1], fused["d"])  # the values after the push
    assert fused_counts.get("PushStep") == 3 and not fused_counts.get("PushSparse")
    assert not fused_counts.get("PushDense")
    assert apart_counts["PushSparse"] == 5 and apart_counts["PushDense"] == 3
    assert (fused_counts.get("ShmAttach", 0) > 0) == shm


@pytest.mark.timeout(120)
def test_several_servers_get_separate_calls() -> None:
    fused, fused_values, counts = _run(2, True, True)
    apart, _, _ = _run(2, False, True)
    for name in fused:
        np.testing.assert_array_equal(fused[name], apart[name], err_msg=name)
    assert not counts.get("PushStep") and counts["PushDense"] == 3
    np.testing.assert_array_equal(fused_values[-1], fused["d"])


@pytest.mark.timeout(60)
def test_older_server_without_push_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server built before PushStep answers UNIMPLEMENTED (the generated servicer's default):
    the client sends that step and every later one as separate calls."""
    monkeypatch.setattr(
        ParameterServerServicer, "PushStep", ps_pb2_grpc.ParameterServerServicer.PushStep
    )
    with cluster(1, client_kw={"timeout_s": 20}) as (servers, client):
        _tables(client)
        for sparse, dense in _steps():
            _, values = client.push_step(sparse, dense)
            np.testing.assert_array_equal(values, client.pull_dense("d", "w"))
        assert client.push_step_unsupported
        requests = servers[0].state.requests
        assert requests["PushStep"] == 0 and requests["PushDense"] == 3


@pytest.mark.timeout(60)
def test_push_step_refuses_other_modes() -> None:
    with cluster(1, client_kw={"timeout_s": 20, "shm": False}) as (_, client):
        _tables(client)
        part = ps_pb2.PushSparseRequest(
            table="a",
            mode=ps_pb2.PUSH_MODE_DELTA,
            keys=np.array([1], np.int64).tobytes(),
            grads=np.ones(4, np.float32).tobytes(),
        )
        with pytest.raises(PSRpcError) as err:
            client._invoke([Call(0, "PushStep", ps_pb2.PushStepRequest(sparse=[part]))], False)
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "APPLY pushes only" in err.value.details


@pytest.mark.timeout(60)
def test_async_sender_sends_one_call_per_step() -> None:
    with cluster(1) as (servers, client):
        _tables(client)
        client.create_dense_table(DENSE_TABLE, optimizer=Adam(0.01))
        param = np.zeros(DENSE, np.float32)
        client.init_dense(DENSE_TABLE, DENSE_BLOCK, param)
        comm = AsyncCommunicator(
            client, 1, lambda: None, queue_size=4, max_merge=1, barrier_interval=0
        )
        comm.add_table("a", 4, 0.1)

        p = torch.nn.Parameter(torch.zeros(DENSE))
        comm.add_dense([p])
        try:
            for s in range(4):
                keys = np.arange(s, s + 10, dtype=np.int64)
                comm.record_sparse("a", keys, np.ones((10, 4), np.float32))
                p.grad = torch.ones(DENSE)
                comm.step()
            comm.flush()
        finally:
            comm.close()
        requests = servers[0].state.requests
        assert requests["PushStep"] == 4 and requests["PushSparse"] == 0
        assert requests["PushDense"] == 0 and requests["PullDense"] == 0
        assert float(client.pull_dense(DENSE_TABLE, DENSE_BLOCK)[0]) < 0  # Adam applied 4 steps
