"""SampleNeighbors through same-host shared memory (ps_server/rpc/graph_shm.py) and the local
channel (ps_server/rpc/local_channel.py) against live servers on 127.0.0.1: the same arrays as
through gRPC, off by ``shm=False`` or FLEET_PS_SHM=0, a server that cannot attach, lost its
segments or closed its channel, a connection without the key, and bad requests refused by
name."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket

import grpc
import numpy as np
import pytest
from test_graph_table import graph_cluster

from ps_server.config import GraphTableConfig
from ps_server.graph_client import GraphClient
from ps_server.rpc.graph_service import encode
from ps_server.rpc.graph_shm import bytes_needed
from ps_server.rpc.shm import MIN_SHM_BYTES, SHM_DIR
from ps_server.rpc.status import PSNotFoundError

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

CFG = GraphTableConfig("g", edge_types=["e"], num_shards=16)
NODES = 20_000
QUERY = 6_000  # 6,000 nodes x fanout 10: ~500 KB per server, well above MIN_SHM_BYTES
assert bytes_needed(QUERY // 3, 10) > MIN_SHM_BYTES
VARIANTS = [
    {"fanout": 10},
    {"fanout": 4, "return_weights": True, "return_eids": True},
    {"fanout": 6, "weighted": True, "return_eids": True},
    {"fanout": 1000},  # every neighbour: a 20 MB bound, in a segment mostly never touched
]


def _load(client: GraphClient) -> None:
    rng = np.random.default_rng(3)
    src = rng.integers(-NODES, NODES, 300_000)
    dst = rng.integers(-NODES, NODES, 300_000)
    weight = rng.integers(1, 9, 300_000).astype(np.float32) / 4
    client.create_graph_table(CFG)
    client.add_edges("g", src, dst, weight=weight)


def _same(fast: GraphClient, slow: GraphClient, nodes: np.ndarray, seed: int) -> None:
    for kw in VARIANTS:
        got = fast.sample_neighbors("g", nodes, **kw, seed=seed)
        want = slow.sample_neighbors("g", nodes, **kw, seed=seed)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype, kw
            np.testing.assert_array_equal(a, b)


def _our_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("fleetps_")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_servers", [1, 2])
def test_shm_sampling_equals_grpc(num_servers: int) -> None:
    """The same seeded samples, bit for bit, through segments and through gRPC messages."""
    before = _our_segments()
    with graph_cluster(num_servers, client_kw={"shm": True}) as (servers, fast):
        slow = GraphClient(fast.endpoints, timeout_s=20, shm=False)
        try:
            _load(fast)
            rng = np.random.default_rng(0)
            for step in range(3):  # duplicates and unknown nodes included
                _same(fast, slow, rng.integers(-NODES - 50, NODES + 50, QUERY), step)
            _same(fast, slow, np.arange(5), 9)  # small: a segment all the same, and gRPC
            _same(fast, slow, np.empty(0, np.int64), 9)
            assert slow._shm is None
            assert fast._shm is not None and fast._shm.attached  # the segments were used
            assert all(len(s.state.shm) > 0 for s in servers)
            assert all(s.graph is not None and s.graph.local is not None for s in servers)
            assert fast._local is not None and fast._local.free  # the local channels were used
            assert _our_segments() - before == set()  # unlinked once attached
        finally:
            slow.close()
    assert _our_segments() - before == set()


@pytest.mark.timeout(120)
def test_shm_off_by_env_and_server_without_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLEET_PS_SHM=0 turns the client's segments off; a server that cannot attach one (shared
    memory off there, as a server on another host) gets the same requests over gRPC."""
    with graph_cluster(2, client_kw={"shm": False}) as (servers, slow):
        _load(slow)
        nodes = np.random.default_rng(1).integers(-NODES, NODES, QUERY)
        monkeypatch.setenv("FLEET_PS_SHM", "0")
        off = GraphClient(slow.endpoints, timeout_s=20)
        monkeypatch.delenv("FLEET_PS_SHM")
        servers[1].state.shm.enabled = False
        mixed = GraphClient(slow.endpoints, timeout_s=20, shm=True)
        try:
            assert off._shm is None
            _same(off, slow, nodes, 4)
            _same(mixed, slow, nodes, 4)
            assert mixed._shm is not None and mixed._shm.off == {1}  # tried once, then gRPC
            assert len(servers[0].state.shm) > 0 and len(servers[1].state.shm) == 0
        finally:
            off.close()
            mixed.close()


@pytest.mark.timeout(120)
def test_server_that_lost_its_segments() -> None:
    """A server that forgot its segments (as after a restart) refuses them by name; the client
    re-attaches fresh ones and gets the same samples."""
    with graph_cluster(2, client_kw={"shm": True}) as (servers, fast):
        slow = GraphClient(fast.endpoints, timeout_s=20, shm=False)
        try:
            _load(fast)
            nodes = np.random.default_rng(2).integers(-NODES, NODES, QUERY)
            _same(fast, slow, nodes, 5)
            for s in servers:
                s.state.shm.close()
            _same(fast, slow, nodes, 6)
            assert all(len(s.state.shm) > 0 for s in servers)
        finally:
            slow.close()


@pytest.mark.timeout(60)
def test_bad_shm_requests_are_refused_by_name() -> None:
    with graph_cluster(1, client_kw={"shm": True}) as (_, client):
        _load(client)
        nodes = np.random.default_rng(3).integers(-NODES, NODES, QUERY)
        expected = client.sample_neighbors("g", nodes, 10, seed=1)  # attaches a segment
        assert client._shm is not None
        seg = next(iter(client._shm.attached))
        head = {"table": "g", "fanout": 10}
        cases = [
            ({"shm_segment": "fleetps_" + "1" * 32, "shm_num_nodes": 4}, None,
             grpc.StatusCode.FAILED_PRECONDITION, "is not attached"),
            ({"shm_segment": seg, "shm_num_nodes": 10**9}, None,
             grpc.StatusCode.INVALID_ARGUMENT, "the segment has"),
            ({"shm_segment": seg, "shm_num_nodes": -1}, None,
             grpc.StatusCode.INVALID_ARGUMENT, "must be an integer >= 0"),
            ({"shm_segment": seg, "shm_num_nodes": 4}, {"nodes": np.arange(4)},
             grpc.StatusCode.INVALID_ARGUMENT, "carries no arrays"),
        ]  # fmt: skip
        method = client._methods[0]["Graph.SampleNeighbors"]
        for extra, arrays, code, text in cases:
            with pytest.raises(grpc.RpcError) as info:
                method(encode({**head, **extra}, arrays), timeout=10)
            assert info.value.code() == code, info.value.details()
            assert text in info.value.details()
        for got, want in zip(client.sample_neighbors("g", nodes, 10, seed=1), expected):
            np.testing.assert_array_equal(got, want)


@pytest.mark.timeout(120)
def test_closed_channel_falls_back_and_reconnects() -> None:
    """A server that closed its channel (stopping, or restarted): the calls in the way go
    through gRPC, the next ones over a new channel; errors keep their status over it."""
    with graph_cluster(2, client_kw={"shm": True}) as (servers, fast):
        slow = GraphClient(fast.endpoints, timeout_s=20, shm=False)
        try:
            _load(fast)
            nodes = np.random.default_rng(4).integers(-NODES, NODES, QUERY)
            _same(fast, slow, nodes, 7)
            old = [s.graph.local.name for s in servers]  # type: ignore[union-attr]
            for s in servers:
                s.graph.close()  # type: ignore[union-attr]
            _same(fast, slow, nodes, 8)
            _same(fast, slow, nodes, 9)
            new = [s.graph.local.name for s in servers]  # type: ignore[union-attr]
            assert all(a != b for a, b in zip(old, new))
            with pytest.raises(PSNotFoundError, match="graph table 'nope' does not exist"):
                fast.sample_neighbors("nope", nodes, 10)
        finally:
            slow.close()


@pytest.mark.timeout(60)
def test_connection_without_the_key_is_closed() -> None:
    with graph_cluster(1, client_kw={"shm": True}) as (servers, client):
        _load(client)
        client.sample_neighbors("g", np.arange(-NODES, NODES, 3), 10)  # opens the channel
        listener = servers[0].graph.local  # type: ignore[union-attr]
        assert listener is not None
        served = servers[0].state.requests["Graph.SampleNeighbors"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect("\0" + listener.name)
            sock.sendall(b"k" * 16 + b"\x08\0\0\0" + b"x" * 8)
            with contextlib.suppress(ConnectionResetError):  # closed with the frame unread
                assert sock.recv(16) == b""
        assert servers[0].state.requests["Graph.SampleNeighbors"] == served  # nothing served


@pytest.mark.timeout(120)
def test_concurrent_calls_from_threads() -> None:
    """Calls from several threads at once: a segment and a connection each, the same samples."""
    with graph_cluster(2, client_kw={"shm": True}) as (_, fast):
        slow = GraphClient(fast.endpoints, timeout_s=20, shm=False)
        try:
            _load(fast)
            batches = [
                np.random.default_rng(10 + i).integers(-NODES, NODES, QUERY) for i in range(8)
            ]
            want = [slow.sample_neighbors("g", b, 10, seed=i) for i, b in enumerate(batches)]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                got = list(
                    pool.map(
                        lambda ib: fast.sample_neighbors("g", ib[1], 10, seed=ib[0]),
                        enumerate(batches),
                    )
                )
            for g, w in zip(got, want):
                for a, b in zip(g, w):
                    np.testing.assert_array_equal(a, b)
            assert fast._local is not None
            assert 1 <= sum(len(v) for v in fast._local.free.values()) <= 8
        finally:
            slow.close()
