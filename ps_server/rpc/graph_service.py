"""The graph-table RPCs: the ``fleetrun.ps.v1.Graph`` gRPC service, next to the parameter server's.

Why a service of its own: the parameter server's protobuf messages are generated from
``ps.proto``; the graph calls carry a few int64 / float32 arrays and small settings, so each
method takes and returns raw bytes in one frame format (:func:`encode` / :func:`decode`): a
4-byte little-endian header length, a JSON header (the settings, and name, dtype and shape of
each array), then the arrays' bytes back to back (decoded as zero-copy views). The service is
registered on the same gRPC server as the parameter server (:func:`add_graph_service`), so the
job token, TLS, the request threads and the graceful stop apply to it as to every other call;
requests and failures are counted in the server's Stats and its Prometheus request metrics
(op ``Graph.<method>``) like the others, and errors map to status codes through
:func:`ps_server.rpc.status.status_of`.

Random walks cross servers without a round trip to the trainer per step: the client splits the
start nodes over the servers, and each server coordinates its part. Per step it groups the
walks by the server owning their current node, advances its own with a local step and sends one
``WalkStep`` request (all the walks that continue there) to each other server, in parallel; a
walk ends early at a node without out-edges. The client passes the servers' endpoints in the
request; the coordinating server calls them with its own job token (and, with TLS, its own
certificate and CA: the servers of a job share them).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from ps_server import telemetry
from ps_server.checkpoint.roots import confine, confine_data_paths, resolve_data_roots
from ps_server.config import GraphTableConfig, check_same_config
from ps_server.core.graph_checkpoint import load_table, read_config, save_part
from ps_server.core.graph_files import GraphInputError
from ps_server.core.graph_table import GraphTable, as_ids
from ps_server.core.routing import split_by_server
from ps_server.errors import ReadOnlyServingError, ShmSegmentError, TableNotFoundError
from ps_server.rpc import graph_shm
from ps_server.rpc.auth import METADATA_KEY
from ps_server.rpc.local_channel import LocalListener
from ps_server.rpc.service import MAX_DETAILS_CHARS, ServerState
from ps_server.rpc.status import RequestDecodeError, rpc_error, status_of
from ps_server.rpc.tls import TLSConfig, channel_credentials, channel_options

logger = logging.getLogger(__name__)

GRAPH_SERVICE = "fleetrun.ps.v1.Graph"
"""The gRPC service name of the graph calls."""
MUTATING = frozenset(
    {
        "CreateGraphTable",
        "LoadGraph",
        "LoadEdges",
        "LoadNodes",
        "AddEdges",
        "RemoveEdges",
        "AddNodes",
        "RemoveNodes",
    }
)
"""Graph calls a read-only serving server refuses."""
_LEN = struct.Struct("<I")


# -- the frame format ------------------------------------------------------------------------
def encode(header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> bytes:
    """One frame: header length, JSON header (with the arrays' layout), the arrays' bytes."""
    arrays = arrays or {}
    layout, blobs = [], []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        layout.append([name, a.dtype.str, list(a.shape)])
        blobs.append(a.tobytes())
    head = json.dumps({**header, "_arrays": layout}).encode()
    return b"".join([_LEN.pack(len(head)), head, *blobs])


def decode(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Inverse of :func:`encode` (arrays are read-only views of ``data``); RequestDecodeError
    for a body that is not a frame."""
    try:
        (n,) = _LEN.unpack_from(data, 0)
        header = json.loads(bytes(data[4 : 4 + n]))
        offset = 4 + n
        arrays = {}
        for name, dtype, shape in header.pop("_arrays"):
            dt = np.dtype(dtype)
            count = int(np.prod(shape)) if shape else 1
            arrays[name] = np.frombuffer(data, dt, count, offset).reshape(shape)
            offset += count * dt.itemsize
        if offset != len(data):
            raise ValueError(f"{len(data) - offset} bytes after the arrays")
    except (struct.error, ValueError, TypeError, KeyError) as err:
        raise RequestDecodeError(
            f"the {len(data)}-byte body is not a graph request frame: {err}"
        ) from None
    return header, arrays


_I32 = np.iinfo(np.int32)


def narrow(a: np.ndarray) -> np.ndarray:
    """int64 ``a`` as int32 when every value fits (half the bytes on the wire; the receiver
    widens it back with ``as_ids``), else ``a`` itself."""
    if a.dtype == np.int64 and a.size and _I32.min <= a.min() and a.max() <= _I32.max:
        return a.astype(np.int32)
    return a


# -- state -----------------------------------------------------------------------------------
@dataclass
class GraphState:
    """One server's graph tables and the channels to its peers (random walks)."""

    server: ServerState
    token: str | None = None
    tls: TLSConfig = field(default_factory=TLSConfig)
    tables: dict[str, GraphTable] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _peers: dict[str, Any] = field(default_factory=dict)
    _pool: concurrent.futures.ThreadPoolExecutor | None = None
    local: LocalListener | None = None
    """The same-host SampleNeighbors channel (:mod:`ps_server.rpc.local_channel`), once asked."""

    def close(self) -> None:
        """Close the same-host channel (its connections' calls fail over to gRPC)."""
        with self.lock:
            local, self.local = self.local, None
        if local is not None:
            local.close()

    def table(self, name: str) -> GraphTable:
        """Graph table ``name`` (TableNotFoundError naming the graph tables that exist)."""
        t = self.tables.get(name)
        if t is None:
            raise TableNotFoundError(
                f"graph table {name!r} does not exist on server {self.server.server_index}; "
                f"graph tables: {sorted(self.tables) or 'none'} (create it with "
                "create_graph_table first)"
            )
        return t

    def peer(self, endpoint: str) -> Callable[..., bytes]:
        """The WalkStep method on a channel to ``endpoint`` (opened once)."""
        with self.lock:
            call = self._peers.get(endpoint)
            if call is None:
                if self.tls.server_enabled:
                    creds = channel_credentials(
                        TLSConfig(
                            cert=self.tls.cert,
                            key=self.tls.key,
                            ca=self.tls.ca,
                            server_name=self.tls.server_name,
                        )
                    )
                    ch = grpc.secure_channel(endpoint, creds, options=channel_options(self.tls))
                else:
                    ch = grpc.insecure_channel(endpoint)
                call = ch.unary_unary(f"/{GRAPH_SERVICE}/WalkStep")
                self._peers[endpoint] = call
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(2, self.server.num_servers), thread_name_prefix="graphwalk"
                )
            return call


def _rng(header: dict[str, Any], *extra: int) -> np.random.Generator:
    seed = header.get("seed")
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([int(seed) & (2**63 - 1), *extra])


Reply = tuple[dict[str, Any], dict[str, np.ndarray]]


# -- handlers --------------------------------------------------------------------------------
def create_graph_table(gs: GraphState, h: dict, a: dict) -> Reply:
    config = GraphTableConfig.from_dict(h["config"], "config")
    with gs.lock:
        existing = gs.tables.get(config.name)
        if existing is not None:
            check_same_config(existing.config, config)
            return {"created": False}, {}
        gs.tables[config.name] = GraphTable(config, gs.server.server_index, gs.server.num_servers)
    logger.info("server %d: created graph table %s", gs.server.server_index, config.to_dict())
    return {"created": True}, {}


def describe(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    return {"config": t.config.to_dict(), "stats": t.stats()}, {}


def _data_paths(gs: GraphState, t: GraphTable, paths: object) -> object:
    """``paths`` once every local file lies under the server's data roots (DataPathError)."""
    st = gs.server
    roots = st.data_roots or resolve_data_roots(None, st.checkpoint_roots)
    if isinstance(paths, (str, list)):
        return confine_data_paths(t.name, paths, roots)
    return paths  # not file names: the table's own check names the value


def load_edges(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    paths = _data_paths(gs, t, h["paths"])
    return t.load_edges(
        h.get("edge_type"), paths, bool(h.get("reverse")), h.get("on_error", "raise")
    ), {}


def load_nodes(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    return t.load_nodes(_data_paths(gs, t, h["paths"]), h.get("on_error", "raise")), {}


def add_edges(gs: GraphState, h: dict, a: dict) -> Reply:
    """The client's edges for this server; ``positions`` in the client's batch of ``total``
    give the edge ids (every server gets the call, so the id counters stay equal)."""
    t = gs.table(h["table"])
    kept = t.add_edge_batch(
        h.get("edge_type"), a["src"], a["dst"], a.get("weight"), a["positions"], h["total"]
    )
    return {"kept": kept}, {}


def remove_edges(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    return {"removed": t.remove_edges(h.get("edge_type"), a["src"], a["dst"])}, {}


def add_nodes(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    feats = {k[5:]: v for k, v in a.items() if k.startswith("feat:")}
    return {"kept": t.add_nodes(h.get("node_type"), a["ids"], feats)}, {}


def remove_nodes(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    return {"removed": t.remove_nodes(h.get("node_type"), a["ids"])}, {}


def sample_neighbors(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    rng = _rng(h, gs.server.server_index)
    fanout = t.check_fanout(t.name, h["fanout"])
    name = t.edge_type(h.get("edge_type"))[0]
    if h.get("shm_segment") is not None:
        return _sample_in_shm(gs, t, h, a, fanout, name, rng)
    ids = as_ids(t.name, "nodes", a["nodes"])
    csr, pos, counts = t.sample_positions(ids, fanout, name, bool(h.get("weighted")), rng)
    # only the columns asked for are gathered; ids and counts go as int32 when they fit
    out = {"values": narrow(csr.dst[pos]), "counts": narrow(counts)}
    if h.get("return_weights"):
        out["weights"] = csr.weight[pos]
    if h.get("return_eids"):
        out["eids"] = csr.eid[pos]
    return {}, out


def _sample_in_shm(
    gs: GraphState,
    t: GraphTable,
    h: dict,
    a: dict,
    fanout: int,
    name: str,
    rng: np.random.Generator,
) -> Reply:
    """:func:`sample_neighbors` of the nodes in a same-host client's segment, the reply written
    there (:mod:`ps_server.rpc.graph_shm`); the reply frame carries the sampled count."""
    if a:
        raise RequestDecodeError(f"{t.name}: a shm SampleNeighbors request carries no arrays")
    rw, re = bool(h.get("return_weights")), bool(h.get("return_eids"))
    buf, size = gs.server.shm.mapping(str(h["shm_segment"]))
    v = graph_shm.views(buf, size, h["shm_num_nodes"], fanout, rw, re)
    csr, pos, counts = t.sample_positions(v["nodes"], fanout, name, bool(h.get("weighted")), rng)
    v["counts"][...] = counts
    total = int(pos.shape[0])
    # mode="clip": no bounds-check buffer (the positions are the CSR's own)
    np.take(csr.dst, pos, out=v["values"][:total], mode="clip")
    if rw:
        np.take(csr.weight, pos, out=v["weights"][:total], mode="clip")
    if re:
        np.take(csr.eid, pos, out=v["eids"][:total], mode="clip")
    return {"total": total}, {}


def degree(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    return {}, {"degree": t.degree(a["nodes"], h.get("edge_type"))}


def node_features(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    feats, found = t.node_features(a["nodes"], h.get("names"), h.get("node_type"))
    return {"names": list(feats)}, {"found": found, **{f"feat:{k}": v for k, v in feats.items()}}


def random_nodes(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    ids, count = t.random_nodes(h["n"], h.get("node_type"), _rng(h, gs.server.server_index))
    return {"count": count}, {"ids": ids}


def node_page(gs: GraphState, h: dict, a: dict) -> Reply:
    """``count`` of the type's nodes here; with ``size`` > 0, the sorted ids [start, start+size)."""
    t = gs.table(h["table"])
    ids = t.node_ids(h.get("node_type"))
    start, size = int(h.get("start", 0)), int(h.get("size", 0))
    return {"count": int(ids.shape[0])}, {"ids": ids[start : start + size] if size > 0 else ids[:0]}


def walk_step(gs: GraphState, h: dict, a: dict) -> Reply:
    t = gs.table(h["table"])
    nxt, has = t.walk_step(a["nodes"], h.get("edge_type"), _rng(h, gs.server.server_index))
    return {}, {"next": nxt, "has": has}


def random_walk(gs: GraphState, h: dict, a: dict) -> Reply:
    """Coordinate the walks of ``starts`` (see the module docstring)."""
    t = gs.table(h["table"])
    length = h["length"]
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise GraphInputError(t.name, "length", f"must be an integer >= 0, got {length!r}")
    metapath = h.get("metapath")
    types = (
        [e[0] for e in t.check_metapath(metapath, length)]
        if metapath
        else [t.edge_type(h.get("edge_type"))[0]]
    )
    endpoints = list(h.get("endpoints") or [])
    num = gs.server.num_servers
    if num > 1 and len(endpoints) != num:
        raise GraphInputError(
            t.name,
            "endpoints",
            f"a walk on {num} servers needs their {num} endpoints, got {endpoints}",
        )
    starts = as_ids(t.name, "starts", a["starts"])
    n = starts.shape[0]
    paths = np.zeros((n, length + 1), np.int64)
    paths[:, 0] = starts
    lengths = np.ones(n, np.int64)
    alive = np.arange(n, dtype=np.int64)
    me = gs.server.server_index
    for step in range(length):
        if alive.shape[0] == 0:
            break
        etype = types[step % len(types)]
        cur = paths[alive, step]
        if num == 1:
            nxt, has = t.walk_step(cur, etype, _rng(h, me, step, 0))
        else:
            nxt, has = _walk_step_everywhere(gs, t, cur, etype, endpoints, h, step)
        paths[alive, step + 1] = nxt
        alive = alive[has]
        lengths[alive] += 1
    keep = np.arange(length + 1)[None, :] < lengths[:, None]
    return {}, {"values": paths[keep], "lengths": lengths}


def _walk_step_everywhere(
    gs: GraphState,
    t: GraphTable,
    cur: np.ndarray,
    etype: str,
    endpoints: list[str],
    h: dict,
    step: int,
) -> tuple[np.ndarray, np.ndarray]:
    """One step of the walks at ``cur``: local for this server's nodes, one WalkStep request
    per other server for theirs, in parallel."""
    num, me, seed = gs.server.num_servers, gs.server.server_index, h.get("seed")
    positions, keys = split_by_server(cur, num, t.config.num_shards)
    nxt = np.zeros(cur.shape[0], np.int64)
    has = np.zeros(cur.shape[0], bool)
    futures = {}
    meta = ((METADATA_KEY, gs.token),) if gs.token else None
    for s in range(num):
        if s == me or keys[s].shape[0] == 0:
            continue
        header: dict[str, Any] = {"table": t.name, "edge_type": etype}
        if seed is not None:
            header["seed"] = (int(seed) * 1_000_003 + step * 1009 + me) & (2**62 - 1)
        call = gs.peer(endpoints[s])
        assert gs._pool is not None
        futures[s] = gs._pool.submit(
            call, encode(header, {"nodes": keys[s]}), timeout=60.0, metadata=meta
        )
    if keys[me].shape[0]:
        nxt[positions[me]], has[positions[me]] = t.walk_step(keys[me], etype, _rng(h, me, step, 1))
    for s, fut in futures.items():
        try:
            reply = fut.result()
        except grpc.RpcError as err:
            raise rpc_error("WalkStep", endpoints[s], err) from None
        arrays = decode(reply)[1]
        nxt[positions[s]], has[positions[s]] = arrays["next"], arrays["has"]
    return nxt, has


def save_graph(gs: GraphState, h: dict, a: dict) -> Reply:
    """This server's part of the table into ``dir`` (under the server's checkpoint roots)."""
    t = gs.table(h["table"])
    directory = confine(h["dir"], gs.server.checkpoint_roots)
    return save_part(t, directory), {}


def load_graph(gs: GraphState, h: dict, a: dict) -> Reply:
    """This server's share of a saved table (any number of servers saved it); replaces the
    table's contents, creating it from the saved config when it does not exist."""
    directory = confine(h["dir"], gs.server.checkpoint_roots)
    name = h["table"]
    existing = gs.tables.get(name)
    if existing is not None:
        check_same_config(existing.config, read_config(directory, name))
    table, counts = load_table(directory, name, gs.server.server_index, gs.server.num_servers)
    with gs.lock:
        gs.tables[name] = table
    logger.info("server %d: loaded graph table %s from %s: %s", gs.server.server_index, name,
                directory, counts)  # fmt: skip
    return counts, {}


def local_channel(gs: GraphState, h: dict, a: dict) -> Reply:
    """The name and key of this server's same-host channel (:mod:`ps_server.rpc.local_channel`),
    opened on first use; FAILED_PRECONDITION when it cannot be (shared memory off here, or no
    abstract Unix sockets: not Linux)."""
    if not gs.server.shm.enabled:
        raise ShmSegmentError("local channel: shared memory is off on this server (FLEET_PS_SHM=0)")
    with gs.lock:
        if gs.local is None:
            try:
                gs.local = LocalListener(
                    _serving(gs, "SampleNeighbors"), f"graph{gs.server.server_index}"
                )
            except (OSError, AttributeError) as err:  # AttributeError: no AF_UNIX
                raise ShmSegmentError(f"local channel: cannot listen ({err}); use gRPC") from err
        return {"name": gs.local.name, "key": gs.local.key.hex()}, {}


HANDLERS: dict[str, Callable[[GraphState, dict, dict], Reply]] = {
    "LocalChannel": local_channel,
    "SaveGraph": save_graph,
    "LoadGraph": load_graph,
    "CreateGraphTable": create_graph_table,
    "Describe": describe,
    "LoadEdges": load_edges,
    "LoadNodes": load_nodes,
    "AddEdges": add_edges,
    "RemoveEdges": remove_edges,
    "AddNodes": add_nodes,
    "RemoveNodes": remove_nodes,
    "SampleNeighbors": sample_neighbors,
    "Degree": degree,
    "NodeFeatures": node_features,
    "RandomNodes": random_nodes,
    "NodePage": node_page,
    "WalkStep": walk_step,
    "RandomWalk": random_walk,
}
"""Method name -> handler ``(state, header, arrays) -> (header, arrays)``."""


def _serving(gs: GraphState, op: str) -> Callable[[bytes], tuple[grpc.StatusCode | None, Any]]:
    """Method ``op`` on a request frame: (None, reply frame) or (status code, details)."""
    fn = HANDLERS[op]
    label = f"Graph.{op}"

    def serve(request: bytes) -> tuple[grpc.StatusCode | None, Any]:
        st = gs.server
        with st.counter_lock:
            st.requests[label] += 1
        t0 = time.perf_counter() if telemetry.enabled() else 0.0
        table = ""
        try:
            if st.serving and op in MUTATING:
                raise ReadOnlyServingError(
                    f"Graph.{op} refused: server {st.server_index} serves a read-only export"
                )
            header, arrays = decode(request)
            table = header.get("table", "") if header.get("table") in gs.tables else ""
            try:
                out_h, out_a = fn(gs, header, arrays)
            except KeyError as missing:  # a field the method needs is not in the request
                raise RequestDecodeError(f"{label}: the request has no {missing}") from None
            if t0:
                telemetry.record_request(label, table, "OK", time.perf_counter() - t0)
            return None, encode(out_h, out_a)
        except Exception as err:  # noqa: BLE001 - every error becomes a status code
            code = status_of(err)
            if t0:
                telemetry.record_request(label, table, code.name, time.perf_counter() - t0)
            with st.counter_lock:
                st.errors[f"{label}:{code.name}"] += 1
            if code is grpc.StatusCode.INTERNAL:
                logger.error("%s failed with an unexpected error (a bug)", label, exc_info=err)
                details = (
                    f"{type(err).__name__}: {err} (unexpected server error; see the server log)"
                )
            else:
                details = str(err)
            return code, details[:MAX_DETAILS_CHARS]

    return serve


def _method(gs: GraphState, op: str) -> Callable[[bytes, Any], bytes]:
    serve = _serving(gs, op)

    def handle(request: bytes, context: Any) -> bytes:
        code, out = serve(request)
        if code is not None:
            context.abort(code, out)
            raise AssertionError("context.abort returned") from None  # pragma: no cover
        return out

    return handle


def add_graph_service(
    server: grpc.Server, state: ServerState, token: str | None = None, tls: TLSConfig | None = None
) -> GraphState:
    """Register the graph service on ``server`` (raw-bytes methods); returns its state."""
    gs = GraphState(state, token, tls or TLSConfig(), tables=state.graph_tables)
    handlers = {op: grpc.unary_unary_rpc_method_handler(_method(gs, op)) for op in HANDLERS}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(GRAPH_SERVICE, handlers),)
    )
    return gs


__all__ = ["GRAPH_SERVICE", "GraphState", "add_graph_service", "decode", "encode", "narrow"]
