"""Pure pieces of the gRPC layer: the zero-copy wire codec agrees with the generated protobuf
classes both ways; packed-bytes decoding errors; SYNC rounds, barriers and dense uploads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from collective.errors import ConfigError
from ps_server.errors import TableInputError
from ps_server.rpc.codec import decode_keys, decode_rows, decode_values
from ps_server.rpc.proto import ps_pb2
from ps_server.rpc.status import BarrierTimeoutError, ServerStoppingError
from ps_server.rpc.sync import Barriers, DenseUploads, SyncRounds
from ps_server.rpc.wire import wire_message


@pytest.mark.timeout(10)
def test_wire_encode_matches_generated_classes() -> None:
    keys = np.array([3, -1, 2**62], dtype=np.int64)
    grads = np.arange(6, dtype=np.float32).reshape(3, 2)
    cases = [
        (
            ps_pb2.PushSparseRequest,
            {
                "table": "emb",
                "keys": keys,
                "grads": grads,
                "mode": 2,
                "sync_count": 4,
                "more_parts": True,
            },
        ),
        (ps_pb2.PushSparseRequest, {"table": "é", "keys": keys[:0], "grads": grads[:0]}),
        (ps_pb2.PullSparseRequest, {"table": "t" * 300, "keys": keys}),
        (ps_pb2.PullSparseResponse, {"values": grads, "dim": 2}),
        (ps_pb2.PullSparseResponse, {}),
    ]
    for cls, values in cases:
        ours = wire_message(cls).encode(values)
        as_bytes = {k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in values.items()}
        assert ours == cls(**as_bytes).SerializeToString()
        back = wire_message(cls).decode(ours)
        for name, value in as_bytes.items():
            got = getattr(back, name)
            assert (bytes(got) if isinstance(got, memoryview) else got) == value


@pytest.mark.timeout(10)
def test_wire_decode_matches_generated_and_skips_unknown_fields() -> None:
    msg = ps_pb2.PushSparseRequest(
        table="emb",
        keys=b"k" * 16,
        grads=b"\x00" * 32,
        mode=ps_pb2.PUSH_MODE_DELTA,
        sync_count=2**32 - 1,
    )
    data = msg.SerializeToString() + ps_pb2.PullSparseResponse(dim=9).SerializeToString()
    # field 2 of PullSparseResponse is a varint; in PushSparseRequest field 2 is bytes: skipped
    view = wire_message(ps_pb2.PushSparseRequest).decode(data)
    assert (view.table, bytes(view.keys), view.mode, view.sync_count, view.more_parts) == (
        "emb",
        b"k" * 16,
        3,
        2**32 - 1,
        False,
    )
    assert isinstance(view.grads, memoryview)  # no copy of the payload
    unknown = data + b"\xf8\x07\x01" + b"\x81\x08" + bytes(8) + b"\x8d\x08" + bytes(4)
    assert bytes(wire_message(ps_pb2.PushSparseRequest).decode(unknown).grads) == b"\x00" * 32
    for bad in (
        b"\x0a\xff\xff\xff\xff\x0f",
        b"\x0a\x05ab",
        b"\x80",
        b"\x0b",
        b"\x00\x01",
        b"\x0a\x02\xff\xfe",
    ):  # past the end, truncated varint, group, field 0, UTF-8
        with pytest.raises(DecodeError):
            wire_message(ps_pb2.PushSparseRequest).decode(bad)


@pytest.mark.timeout(10)
def test_packed_bytes_errors_name_field_and_sizes() -> None:
    assert decode_keys("t", np.arange(3, dtype="<i8").tobytes()).tolist() == [0, 1, 2]
    with pytest.raises(TableInputError, match=r"table 't', keys: 20 bytes is not a multiple of 8"):
        decode_keys("t", bytes(20))
    with pytest.raises(TableInputError, match=r"grads: 24 bytes, expected .* = 2 \* 4 \* 4 = 32"):
        decode_rows("t", bytes(24), 2, 4)
    with pytest.raises(TableInputError, match="2 rows of dim 3 but the table's dim is 4"):
        decode_rows("t", bytes(24), 2, 3 + 1)
    with pytest.raises(TableInputError, match="values: 7 bytes"):
        decode_values("t", bytes(7), "values")
    assert decode_rows("t", b"", 0, 8).shape == (0, 8)


@pytest.mark.timeout(10)
def test_sync_rounds() -> None:
    rounds = SyncRounds()
    assert rounds.add("t", "k", 3, "a", final=False) == (0, None)  # a part, not an arrival
    assert rounds.add("t", "k", 3, "b", final=True) == (1, None)
    with pytest.raises(TableInputError, match="sync_count=2"):
        rounds.add("t", "k", 2, "x", final=True)
    assert rounds.add("t", "k", 3, "c", final=True) == (2, None)
    assert rounds.pending() == {"k": {"count": 3, "arrived": 2}}
    assert rounds.add("t", "k", 3, "d", final=True) == (3, ["a", "b", "c", "d"])
    assert rounds.pending() == {}
    assert rounds.add("t", "k", 1, "e", final=True) == (1, ["e"])  # W=1: applies at once
    with pytest.raises(TableInputError, match="sync_count >= 1"):
        rounds.add("t", "k", 0, "f", final=True)


@pytest.mark.timeout(10)
def test_barriers_generations_timeout_and_stop() -> None:
    barriers = Barriers()
    out: list[int] = []
    threads = [
        threading.Thread(target=lambda: out.append(barriers.wait("b", 2, 5))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [1, 1]
    with pytest.raises(BarrierTimeoutError, match="only 1 of 2 callers arrived within 0.1s"):
        barriers.wait("b", 2, 0.1)
    with pytest.raises(BarrierTimeoutError, match="cancelled"):
        barriers.wait("c", 2, 5, is_active=lambda: False)
    with pytest.raises(ConfigError, match="barrier.count"):
        barriers.wait("b", 0, 1)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            barriers.wait("s", 2, 10)
        except ServerStoppingError as err:
            errors.append(err)

    t = threading.Thread(target=waiter)
    t.start()
    while barriers.snapshot().get("s", {}).get("arrived") != 1:
        threading.Event().wait(0.01)
    barriers.stop()
    t.join(5)
    assert len(errors) == 1 and "stopping" in str(errors[0])


@pytest.mark.timeout(10)
def test_dense_uploads() -> None:
    uploads = DenseUploads()
    part = np.ones(4, np.float32)
    assert uploads.add_part("t", "w", "u1", 4, 10, part, more_parts=True) is None
    assert uploads.add_part("t", "w", "u1", 4, 10, part, more_parts=True) is None  # a retry
    with pytest.raises(TableInputError, match="belongs to t/w"):
        uploads.add_part("t", "v", "u1", 0, 10, part, more_parts=True)
    with pytest.raises(TableInputError, match=r"part \[8, 12\) of 'w' is past"):
        uploads.add_part("t", "w", "u1", 8, 10, part, more_parts=True)
    with pytest.raises(TableInputError, match="8 of 10 elements"):  # [0, 8) sent, not [8, 10)
        uploads.add_part("t", "w", "u1", 0, 10, part, more_parts=False)
    assert uploads.add_part("t", "w", "u2", 0, 6, part, more_parts=True) is None
    whole = uploads.add_part("t", "w", "u2", 4, 6, np.full(2, 7, np.float32), more_parts=False)
    assert whole is not None and whole.tolist() == [1, 1, 1, 1, 7, 7]
    assert uploads.num_pending() == 0
