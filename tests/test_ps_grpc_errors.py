"""Bad requests against a live server: each gets the right status code and a message naming the
table / field / sizes, and is followed by a request that proves the server still serves and
lost nothing."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from ps_server import SGD, Adagrad, DenseTableConfig, SparseTable, SparseTableConfig, Uniform
from ps_server.core.routing import shard_of
from ps_server.errors import TableInputError
from ps_server.rpc.proto import ps_pb2, ps_pb2_grpc
from ps_server.rpc.service import SERVICE_NAME, ServerState
from ps_server.rpc.servicer import ParameterServerServicer
from ps_server.rpc.status import PSResourceExhaustedError, status_of

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster

DIM = 4
CFG = SparseTableConfig("emb", DIM, Adagrad(0.1), Uniform(-0.1, 0.1), num_shards=8)
SKIP = SparseTableConfig("skip", DIM, SGD(1.0), Uniform(-0.1, 0.1), num_shards=8, nonfinite="skip")
KEYS = np.arange(20, dtype=np.int64)


@pytest.fixture()
def live() -> Iterator[tuple[Any, Any, Any, SparseTable]]:
    """One server (max message 1 MiB) with tables 'emb' and 'skip' holding KEYS after one push;
    yields (server, client, raw stub, reference table in the same state)."""
    with cluster(
        1, client_kw={"timeout_s": 20, "max_message_mb": 1, "shm": False}, max_message_mb=1
    ) as (
        servers,
        client,
    ):
        ref = SparseTable(CFG)
        for cfg in (CFG, SKIP):
            client.create_table_from_config(cfg)
        grads = np.ones((20, DIM), np.float32)
        client.push_sparse("emb", KEYS, grads)
        ref.push(KEYS, grads)
        stub = ps_pb2_grpc.ParameterServerStub(client._channels[0])
        yield servers[0], client, stub, ref


def _still_serves(client: Any, ref: SparseTable) -> None:
    """The table is exactly as before the bad request, and a new push works."""
    np.testing.assert_array_equal(client.pull_sparse("emb", KEYS), ref.pull(KEYS))
    grads = np.full((20, DIM), 0.5, np.float32)
    client.push_sparse("emb", KEYS, grads)
    ref.push(KEYS, grads)
    np.testing.assert_array_equal(client.pull_sparse("emb", KEYS), ref.pull(KEYS))


def _fails(code: grpc.StatusCode, call: Any, *args: Any) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=10)
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def _push(table: str, keys: bytes, grads: bytes, mode: int = ps_pb2.PUSH_MODE_APPLY) -> Any:
    return ps_pb2.PushSparseRequest(table=table, keys=keys, grads=grads, mode=mode)


@pytest.mark.timeout(30)
def test_unknown_table(live: Any) -> None:
    _, client, stub, ref = live
    msg = _fails(
        grpc.StatusCode.NOT_FOUND,
        stub.PullSparse,
        ps_pb2.PullSparseRequest(table="nope", keys=KEYS.tobytes()),
    )
    assert "'nope'" in msg and "['emb', 'skip']" in msg
    _fails(grpc.StatusCode.NOT_FOUND, stub.Shrink, ps_pb2.ShrinkRequest(table="nope"))
    _fails(
        grpc.StatusCode.NOT_FOUND, stub.PullDense, ps_pb2.PullDenseRequest(table="emb2", name="w")
    )
    _still_serves(client, ref)


@pytest.mark.timeout(30)
def test_wrong_dim_length_mismatch_truncated_keys(live: Any) -> None:
    _, client, stub, ref = live
    keys = KEYS.tobytes()
    msg = _fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.PushSparse,
        _push("emb", keys, np.ones((20, DIM + 1), np.float32).tobytes()),
    )
    assert "'emb'" in msg and "grads" in msg and "400 bytes" in msg and "dim 5" in msg
    msg = _fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.PushSparse,
        _push("emb", keys, np.ones(20 * DIM - 1, np.float32).tobytes()),
    )
    assert "grads" in msg and "316 bytes" in msg and "320" in msg
    msg = _fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.PullSparse,
        ps_pb2.PullSparseRequest(table="emb", keys=keys[:-3]),
    )
    assert "keys" in msg and "157 bytes" in msg and "multiple of 8" in msg
    _fails(grpc.StatusCode.INVALID_ARGUMENT, stub.PushSparse, _push("emb", keys[:-1], b""))
    msg = _fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.PushSparse,
        _push("emb", keys, np.ones((20, DIM), np.float32).tobytes(), mode=0),
    )
    assert "mode" in msg
    grads = np.zeros((20, DIM), np.float32).tobytes()
    for mode, shows, want in (
        (ps_pb2.PUSH_MODE_DELTA, b"\x01" * 79, "79 bytes, expected len(keys) * 4 = 20 * 4"),
        (ps_pb2.PUSH_MODE_APPLY, b"\x01" * 80, "delta push only"),
    ):
        request = _push("emb", keys, grads, mode=mode)
        request.shows = shows
        msg = _fails(grpc.StatusCode.INVALID_ARGUMENT, stub.PushSparse, request)
        assert "'emb'" in msg and "shows" in msg and want in msg, msg
    for mode, moved, want in (
        (ps_pb2.PUSH_MODE_DELTA, b"\x01" * 79, "79 bytes, expected len(keys) * state_dim * 4"),
        (ps_pb2.PUSH_MODE_APPLY, b"\x01" * 80, "delta push only"),
    ):
        request = _push("emb", keys, grads, mode=mode)
        request.state_deltas = moved
        msg = _fails(grpc.StatusCode.INVALID_ARGUMENT, stub.PushSparse, request)
        assert "'emb'" in msg and "state_deltas" in msg and want in msg, msg
    request = _push("emb", keys, grads, mode=ps_pb2.PUSH_MODE_DELTA)
    request.with_state = True  # the shm push's flag, over bytes
    msg = _fails(grpc.StatusCode.INVALID_ARGUMENT, stub.PushSparse, request)
    assert "with_state is for a shm push" in msg and "state_deltas" in msg, msg
    from collective.errors import ConfigError

    ones = np.ones((20, DIM), np.float32)
    with pytest.raises(ConfigError, match="only for mode='delta'") as info:
        client.push_sparse("emb", KEYS, ones, state_deltas=ones)  # the client's own checks
    assert info.value.key == "state_deltas"
    with pytest.raises(TableInputError, match=r"\(20, 4\), got \(20, 5\)") as err:
        client.push_sparse("emb", KEYS, ones, mode="delta", state_deltas=np.ones((20, 5)))
    assert err.value.field == "state_deltas"
    _still_serves(client, ref)


@pytest.mark.timeout(30)
def test_nonfinite_reject_and_skip(live: Any) -> None:
    server, client, stub, ref = live
    grads = np.ones((20, DIM), np.float32)
    grads[3, 1], grads[7, 0] = np.nan, np.inf
    msg = _fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.PushSparse,
        _push("emb", KEYS.tobytes(), grads.tobytes()),
    )
    assert "2 non-finite value(s)" in msg and "nothing was applied" in msg
    _fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.PushSparse,
        _push("emb", KEYS.tobytes(), grads.tobytes(), mode=ps_pb2.PUSH_MODE_SYNC),
    )
    assert server.state.events["nonfinite_rejected"] == 2
    _still_serves(client, ref)
    before = client.pull_sparse("skip", KEYS)
    stats = client.push_sparse("skip", KEYS, grads)
    assert stats["skipped_nonfinite"] == 2 and stats["applied"] == 18
    after = client.pull_sparse("skip", KEYS)
    np.testing.assert_array_equal(after[[3, 7]], before[[3, 7]])
    np.testing.assert_allclose(np.delete(after, [3, 7], 0), np.delete(before, [3, 7], 0) - 1)
    assert client.stats()[0]["tables"]["skip"]["nonfinite_skipped"] == 2


@pytest.mark.timeout(30)
def test_wrong_shard_kind_config_and_checkpoint_errors(tmp_path: Path) -> None:
    with cluster(2, checkpoint_root=str(tmp_path)) as (_, client):
        client.create_table_from_config(CFG)
        client.create_table_from_config(DenseTableConfig("d", SGD(0.1), num_shards=4))
        stub1 = ps_pb2_grpc.ParameterServerStub(client._channels[1])
        on_server0 = KEYS[shard_of(KEYS, CFG.num_shards) % 2 == 0]
        msg = _fails(
            grpc.StatusCode.FAILED_PRECONDITION,
            stub1.PullSparse,
            ps_pb2.PullSparseRequest(table="emb", keys=on_server0.tobytes()),
        )
        assert "does not own" in msg
        msg = _fails(
            grpc.StatusCode.INVALID_ARGUMENT,
            stub1.PullSparse,
            ps_pb2.PullSparseRequest(table="d", keys=b""),
        )
        assert "dense table" in msg
        msg = _fails(
            grpc.StatusCode.INVALID_ARGUMENT,
            stub1.CreateTable,
            ps_pb2.CreateTableRequest(config_json='{"kind": "sparse", "name": "x"}'),
        )
        assert "dim" in msg
        _fails(
            grpc.StatusCode.INVALID_ARGUMENT,
            stub1.CreateTable,
            ps_pb2.CreateTableRequest(config_json="{not json"),
        )
        msg = _fails(
            grpc.StatusCode.FAILED_PRECONDITION,
            stub1.Load,
            ps_pb2.LoadRequest(dir=str(tmp_path / "missing")),
        )
        assert "no manifest" in msg
        client.push_sparse("emb", KEYS, np.ones((20, DIM), np.float32))
        client.save(str(tmp_path / "ck"))
        shard_file = next((tmp_path / "ck" / "emb").glob("shard-*.bin"))
        data = bytearray(shard_file.read_bytes())
        data[-10] ^= 0xFF
        shard_file.write_bytes(bytes(data))
        before = client.pull_sparse("emb", KEYS)
        _fails(
            grpc.StatusCode.DATA_LOSS,
            ps_pb2_grpc.ParameterServerStub(client._channels[0]).Load,
            ps_pb2.LoadRequest(dir=str(tmp_path / "ck")),
        )
        np.testing.assert_array_equal(client.pull_sparse("emb", KEYS), before)


@pytest.mark.timeout(30)
def test_garbage_request_bodies(live: Any) -> None:
    _, client, _, ref = live
    channel = client._channels[0]
    garbage = b"\x0a\xff\xff\xff\xff\x0f" + os.urandom(32)  # a field longer than the body
    for method in ("PullSparse", "PushSparse", "CreateTable", "PushDense", "Stats"):
        raw = channel.unary_unary(
            f"/{SERVICE_NAME}/{method}", request_serializer=None, response_deserializer=None
        )
        msg = _fails(grpc.StatusCode.INVALID_ARGUMENT, raw, garbage)
        assert "not a valid fleetrun.ps.v1." in msg
    raw = channel.unary_unary(
        f"/{SERVICE_NAME}/NoSuchMethod", request_serializer=None, response_deserializer=None
    )
    _fails(grpc.StatusCode.UNIMPLEMENTED, raw, b"")
    _still_serves(client, ref)


@pytest.mark.timeout(30)
def test_raw_garbage_on_the_tcp_socket(live: Any) -> None:
    server, client, _, ref = live
    for payload in (
        os.urandom(4096),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(512),
    ):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(payload)
            sock.settimeout(2)
            try:
                sock.recv(1024)
            except (TimeoutError, ConnectionError):
                pass
    _still_serves(client, ref)


@pytest.mark.timeout(60)
def test_oversize_request_and_client_splitting(live: Any) -> None:
    server, client, _, ref = live  # the server takes at most 1 MiB per message
    from ps_server import PSClient

    keys = np.arange(100_000, dtype=np.int64)  # 100k * (8 + 16) bytes = 2.3 MiB
    grads = np.full((100_000, DIM), 0.25, np.float32)
    with PSClient([server.endpoint], max_message_mb=8, timeout_s=20, shm=False) as big:
        with pytest.raises(PSResourceExhaustedError) as info:
            big.push_sparse("emb", keys, grads)
        assert "RESOURCE_EXHAUSTED" in str(info.value) and server.endpoint in str(info.value)
    _still_serves(client, ref)
    assert client.max_message_bytes == 1 << 20  # this client splits to fit 1 MiB
    stats = client.push_sparse("emb", keys, grads)
    ref.push(keys, grads)
    assert stats["num_keys"] == 100_000
    np.testing.assert_array_equal(client.pull_sparse("emb", keys), ref.pull(keys))
    requests = client.stats()[0]["requests"]
    assert requests["PushSparse"] == 2 + 3  # fixture + _still_serves, then 3 parts (the
    # oversize request never reached the handler: gRPC refused it)
    # a pass cache's pull and push carry the optimizer state too: split to fit as well
    values, state = client.pull_sparse_with_state("emb", keys)
    ref_values, ref_state = ref.pull_with_state(keys)
    np.testing.assert_array_equal(values, ref_values)
    np.testing.assert_array_equal(state, ref_state)
    moved = np.full((100_000, DIM), 0.5, np.float32)
    client.push_sparse("emb", keys, grads, mode="delta", state_deltas=moved)
    ref.add_delta(keys, grads, state_deltas=moved)
    assert client.stats()[0]["requests"]["PushSparse"] == 5 + 5  # 40 B a row: 5 parts
    values, state = client.pull_sparse_with_state("emb", keys)
    np.testing.assert_array_equal(state, ref.pull_with_state(keys)[1])
    np.testing.assert_array_equal(values, ref.pull(keys))


@pytest.mark.timeout(10)
def test_error_mapping_is_one_table_and_internal_is_logged(caplog: Any) -> None:
    from collective.errors import ConfigError
    from ps_server.errors import (
        CheckpointCorruptError,
        TableCapacityError,
        TableNotFoundError,
        WrongShardError,
    )

    assert status_of(WrongShardError("t", "keys", "x")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_of(ConfigError("x", key="k")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(TableNotFoundError("x")) == grpc.StatusCode.NOT_FOUND
    assert status_of(TableCapacityError("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(CheckpointCorruptError("x")) == grpc.StatusCode.DATA_LOSS
    assert status_of(RuntimeError("bug")) == grpc.StatusCode.INTERNAL

    class Context:  # what the servicer needs of a grpc.ServicerContext
        def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(json.dumps([code.name, details]))

    def buggy(state: ServerState, request: Any) -> Any:
        raise KeyError("oops")

    servicer = ParameterServerServicer(ServerState())
    with pytest.raises(RuntimeError) as info:
        servicer._run("Stats", buggy, ps_pb2.StatsRequest(), Context())
    code, details = json.loads(str(info.value))
    assert code == "INTERNAL" and "KeyError" in details and "server log" in details
    assert "unexpected error" in caplog.text
    assert servicer.state.errors == {"Stats:INTERNAL": 1}
