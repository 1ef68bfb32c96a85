"""The client of graph tables: :class:`GraphClient`, one request per server for every query.

Nodes are routed to servers as sparse keys are (:func:`ps_server.core.routing.split_by_server`
with the table's ``num_shards``), and replies are put back in the caller's order. Jagged replies
use the layout of :mod:`fleet.data`: ``values`` (all items, node after node) and ``offsets``
(int64, ``len(nodes) + 1``; node ``i``'s items are ``values[offsets[i]:offsets[i + 1]]``).

SampleNeighbors to a server on this host moves its ids and the sampled neighbours through a
shared-memory segment (:mod:`ps_server.rpc.graph_shm`) instead of gRPC messages; the results are
the same. ``GraphClient(..., shm=False)`` or ``FLEET_PS_SHM=0`` turn it off.

Queries are idempotent and retried as the parameter server's pulls are; loads and edits are not
(a retried add would add twice). Errors are :class:`ps_server.rpc.status.PSRpcError` subclasses
naming the method, the server and the server's message (a bad request: INVALID_ARGUMENT naming
the value; an unknown table: NOT_FOUND).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from ps_server.config import GraphTableConfig
from ps_server.core import graph_kernels
from ps_server.core.graph_files import GraphInputError
from ps_server.core.graph_table import GraphTable, as_ids
from ps_server.core.routing import split_by_server
from ps_server.rpc import graph_shm, local_channel
from ps_server.rpc.graph_service import GRAPH_SERVICE, HANDLERS, decode, encode, narrow
from ps_server.rpc.rpc_client import Call, RpcClient
from ps_server.rpc.shm import MIN_SHM_BYTES, Segment
from ps_server.rpc.status import ERROR_OF_CODE, PSInternalError, PSRpcError

logger = logging.getLogger(__name__)

IDEMPOTENT = frozenset(
    {
        "LocalChannel",
        "Describe",
        "SampleNeighbors",
        "Degree",
        "NodeFeatures",
        "RandomNodes",
        "NodePage",
        "WalkStep",
    }
)
"""Graph calls that are retried like pulls."""


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.shape[0] + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _wide(a: np.ndarray) -> np.ndarray:
    """Ids a server sent as int32 (:func:`ps_server.rpc.graph_service.narrow`) as int64."""
    return a.astype(np.int64) if a.dtype.kind in "iu" and a.dtype != np.int64 else a


def _regroup(
    positions: list[np.ndarray], counts: list[np.ndarray], items: list[list[np.ndarray]], n: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Jagged per-server replies (server ``s`` answered for ``positions[s]``) back in the
    caller's order: (offsets, one concatenated array per item kind)."""
    all_counts = np.zeros(n, np.int64)
    for p, c in zip(positions, counts):
        all_counts[p] = c
    offsets = _offsets(all_counts)
    out = []
    for kind in range(len(items[0]) if items else 0):
        total = int(offsets[-1])
        dtype = items[0][kind].dtype if items else np.int64
        arr = np.empty(total, dtype)
        for p, c, it in zip(positions, counts, items):
            if p.shape[0] == 0:
                continue
            if graph_kernels.ENABLED:  # one memcpy per node
                graph_kernels.place_segments(offsets, p, c, it[kind], arr)
                continue
            starts = offsets[p]
            lens = c.astype(np.int64)
            ends = np.cumsum(lens)
            idx = np.arange(int(ends[-1]) if ends.shape[0] else 0) + np.repeat(
                starts - (ends - lens), lens
            )
            arr[idx] = it[kind]
        out.append(arr)
    return offsets, out


def _node_type(cfg: GraphTableConfig, node_type: str | None) -> str:
    """``node_type``, or the only node type when None (GraphInputError otherwise)."""
    if node_type is None and len(cfg.node_types) == 1:
        return cfg.node_types[0]
    if node_type not in cfg.node_types:
        raise GraphInputError(
            cfg.name,
            "node_type",
            f"unknown node type {node_type!r}; node types: {list(cfg.node_types)}",
        )
    return node_type


class GraphClient(RpcClient):
    """Graph-table calls to the servers at ``endpoints`` (options as :class:`RpcClient`'s:
    ``timeout_s``, ``retries``, ``token``, ``tls_*``, ...)."""

    def __init__(self, endpoints: Sequence[str] | str, **options: Any) -> None:
        super().__init__(endpoints, **options)
        for methods, channel in zip(self._methods, self._channels):
            for op in HANDLERS:
                methods[f"Graph.{op}"] = channel.unary_unary(f"/{GRAPH_SERVICE}/{op}")
        self._configs: dict[str, GraphTableConfig] = {}
        self._local = local_channel.LocalChannels() if self._shm is not None else None

    # -- plumbing --------------------------------------------------------------------------
    def _send(self, op: str, calls: list[tuple[int, bytes]]) -> list[tuple[dict, dict]]:
        """Send ``(server, body)`` calls at once; the decoded replies in the same order."""
        replies = self._invoke([Call(s, f"Graph.{op}", b) for s, b in calls], op in IDEMPOTENT)
        return [decode(r) for r in replies]

    def _calls(self, op: str, bodies: dict[int, bytes]) -> dict[int, tuple[dict, dict]]:
        """One call per server in ``bodies``; the replies by server."""
        return dict(zip(bodies, self._send(op, list(bodies.items()))))

    def _all(self, op: str, header: dict, arrays: dict | None = None) -> list:
        body = encode(header, arrays)
        return self._send(op, [(s, body) for s in range(self.num_servers)])

    def config(self, table: str) -> GraphTableConfig:
        """Graph table ``table``'s config (asked of server 0 once)."""
        cfg = self._configs.get(table)
        if cfg is None:
            h, _ = self._calls("Describe", {0: encode({"table": table})})[0]
            cfg = self._configs[table] = GraphTableConfig.from_dict(h["config"])
        return cfg

    def _split(self, table: str, ids: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return split_by_server(ids, self.num_servers, self.config(table).num_shards)

    def _routed(
        self,
        op: str,
        table: str,
        ids: np.ndarray,
        header: dict,
        name: str = "nodes",
        row_bytes: int = 8,
        along: dict[str, np.ndarray] | None = None,
    ) -> list[tuple[np.ndarray, tuple[dict, dict]]]:
        """Route ``ids`` (and the arrays ``along`` them) to their servers: one call per server,
        split into several when a request or its reply (``row_bytes`` per id, the larger of
        the two) would not fit one message. Returns (positions in ``ids``, reply) per call."""
        positions, keys = self._split(table, ids)
        calls, parts = [], []
        for s in range(self.num_servers):
            for part, part_keys in self._pieces(positions[s], keys[s], row_bytes):
                arrays = {name: part_keys}
                arrays.update({k: v[part] for k, v in (along or {}).items()})
                calls.append((s, encode({"table": table, **header}, arrays)))
                parts.append(part)
        return list(zip(parts, self._send(op, calls)))

    def _exchange(
        self, calls: list[tuple[int, bytes]], segs: list[Segment | None]
    ) -> list[tuple[dict, dict]]:
        """SampleNeighbors ``calls``: those with a segment over their server's local channel
        (:mod:`ps_server.rpc.local_channel`) where it has one, the others through gRPC, all at
        once; a call whose connection breaks or times out goes again through gRPC."""
        local = self._local
        if local is None or not any(seg is not None for seg in segs):
            return self._send("SampleNeighbors", calls)
        socks = [local.lease(s, self._hello) if g else None for (s, _), g in zip(calls, segs)]
        out: list[Any] = [None] * len(calls)
        error: PSRpcError | None = None
        try:
            for i, sock in enumerate(socks):
                try:
                    if sock is not None:
                        local_channel.send(sock, calls[i][1], self.timeout_s)
                except OSError as err:
                    socks[i] = local.broken(calls[i][0], sock, err)
            rest = [i for i, sock in enumerate(socks) if sock is None]
            if rest:
                for i, reply in zip(rest, self._send("SampleNeighbors", [calls[i] for i in rest])):
                    out[i] = reply
            for i, sock in enumerate(socks):
                if sock is None:
                    continue
                s = calls[i][0]
                try:
                    code, data = local_channel.receive(sock)
                except OSError as err:
                    socks[i] = local.broken(s, sock, err)
                    out[i] = self._send("SampleNeighbors", [calls[i]])[0]
                    continue
                socks[i] = local.release(s, sock)
                if code is None:
                    out[i] = decode(data)
                elif error is None:
                    error = ERROR_OF_CODE.get(code, PSInternalError)(
                        "Graph.SampleNeighbors",
                        self.endpoints[s],
                        code,
                        data.decode("utf-8", "replace"),
                    )
        finally:
            for sock in socks:  # a reply still on its way: the connection cannot be reused
                if sock is not None:
                    sock.close()
        if error is not None:
            raise error
        return out

    def _hello(self, server: int) -> tuple[str, bytes] | None:
        """(name, key) of ``server``'s local channel; None when it has none."""
        try:
            h, _ = self._calls("LocalChannel", {server: encode({})})[server]
        except PSRpcError as err:
            if err.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                raise
            logger.info("%s: no local channel, using gRPC: %s", self.endpoints[server], err.details)
            return None
        return str(h["name"]), bytes.fromhex(h["key"])

    def close(self) -> None:
        """Close the local channels, then as :meth:`RpcClient.close`."""
        if self._local is not None:
            self._local.close()
        super().close()

    def _pieces(
        self, positions: np.ndarray, keys: np.ndarray, row_bytes: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(positions, keys) of one server's ids in parts whose request and reply (``row_bytes``
        per id, the larger of the two) each fit one message."""
        per = max(1, self._payload_bytes // (2 * max(row_bytes, 8)))
        return [
            (positions[lo : lo + per], keys[lo : lo + per])
            for lo in range(0, positions.shape[0], per)
        ]

    # -- tables and loading ----------------------------------------------------------------
    def create_graph_table(self, config: GraphTableConfig) -> bool:
        """Create ``config`` on every server (idempotent; ALREADY_EXISTS for another config).
        True if any server created it now."""
        if not isinstance(config, GraphTableConfig):
            raise GraphInputError("?", "config", f"must be a GraphTableConfig, got {config!r}")
        replies = self._all("CreateGraphTable", {"config": config.to_dict()})
        self._configs[config.name] = config
        return any(h["created"] for h, _ in replies)

    def load_edges(
        self,
        table: str,
        paths: str | Sequence[str],
        edge_type: str | None = None,
        reverse: bool = False,
        on_error: str = "raise",
    ) -> dict[str, int]:
        """Every server reads the edge files (``src<TAB>dst[<TAB>weight]``; paths, globs, fsspec
        URLs as the servers see them) and keeps the edges whose source it owns. Returns
        ``{"files", "edges", "skipped", "kept"}`` (kept: summed over servers)."""
        paths = [paths] if isinstance(paths, str) else list(paths)
        header = {"table": table, "paths": paths, "edge_type": edge_type, "reverse": reverse}
        replies = self._all("LoadEdges", {**header, "on_error": on_error})
        out = dict(replies[0][0])
        out["kept"] = sum(h["kept"] for h, _ in replies)
        return out

    def load_nodes(
        self, table: str, paths: str | Sequence[str], on_error: str = "raise"
    ) -> dict[str, int]:
        """Every server reads the node files (``type<TAB>id<TAB>name v v...``) and keeps the
        nodes it owns. Returns ``{"files", "nodes", "skipped", "kept"}``."""
        paths = [paths] if isinstance(paths, str) else list(paths)
        replies = self._all("LoadNodes", {"table": table, "paths": paths, "on_error": on_error})
        out = dict(replies[0][0])
        out["kept"] = sum(h["kept"] for h, _ in replies)
        return out

    def add_edges(
        self,
        table: str,
        src: Any,
        dst: Any,
        edge_type: str | None = None,
        weight: Any = None,
        reverse: bool = False,
    ) -> int:
        """Add edges (``reverse``: dst->src too); returns how many were stored."""
        s = as_ids(table, "src", src)
        d = as_ids(table, "dst", dst)
        if s.shape != d.shape:
            raise GraphInputError(table, "dst", f"{d.shape[0]} dst ids for {s.shape[0]} src ids")
        w = np.ones(s.shape[0], np.float32) if weight is None else np.asarray(weight, np.float32)
        if w.shape != s.shape:
            raise GraphInputError(table, "weight", f"{w.shape[0]} weights for {s.shape[0]} edges")
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise GraphInputError(table, "weight", "weights must be finite and >= 0")
        if reverse:
            s, d, w = np.concatenate([s, d]), np.concatenate([d, s]), np.concatenate([w, w])
        kept = 0
        per = max(1, self._payload_bytes // 28)  # src, dst, position: 8 bytes, weight: 4
        for lo in range(0, max(s.shape[0], 1), per):  # one batch of edge ids per part
            cs, cd, cw = s[lo : lo + per], d[lo : lo + per], w[lo : lo + per]
            positions, keys = self._split(table, cs)
            bodies = {
                srv: encode(
                    {"table": table, "edge_type": edge_type, "total": int(cs.shape[0])},
                    {
                        "src": keys[srv],
                        "dst": cd[positions[srv]],
                        "weight": cw[positions[srv]],
                        "positions": positions[srv],
                    },
                )
                for srv in range(self.num_servers)
            }
            kept += sum(h["kept"] for h, _ in self._calls("AddEdges", bodies).values())
        return kept

    def remove_edges(self, table: str, src: Any, dst: Any, edge_type: str | None = None) -> int:
        """Remove the edges equal to the (src, dst) pairs; returns how many were removed."""
        s, d = as_ids(table, "src", src), as_ids(table, "dst", dst)
        if s.shape != d.shape:
            raise GraphInputError(table, "dst", f"{d.shape[0]} dst ids for {s.shape[0]} src ids")
        got = self._routed("RemoveEdges", table, s, {"edge_type": edge_type}, "src", 16, {"dst": d})
        return sum(h["removed"] for _, (h, _) in got)

    def add_nodes(
        self,
        table: str,
        ids: Any,
        node_type: str | None = None,
        features: dict[str, Any] | None = None,
    ) -> int:
        """Add or update nodes with their features (``{name: [n, width]}``); returns how many."""
        ids_a = as_ids(table, "ids", ids)
        cfg = self.config(table)
        t = _node_type(cfg, node_type)
        spec = {f[0]: f for f in cfg.node_features(t)}
        feats = {k: np.asarray(v) for k, v in (features or {}).items()}
        for k, v in feats.items():  # checked here too, so no server takes a part of a bad batch
            if k not in spec:
                raise GraphInputError(
                    table,
                    "features",
                    f"unknown feature {k!r} of node type {t!r}; features: {sorted(spec)}",
                )
            width = spec[k][2]
            if v.ndim == 1 and width == 1:
                v = feats[k] = v.reshape(-1, 1)
            if v.shape != (ids_a.shape[0], width):
                raise GraphInputError(
                    table,
                    k,
                    f"feature {k!r} of node type {t!r} has width {width}: expected shape "
                    f"({ids_a.shape[0]}, {width}) for {ids_a.shape[0]} node(s), got {v.shape}",
                )
        row = 8 + sum(spec[k][2] * 8 for k in feats)
        along = {f"feat:{k}": v for k, v in feats.items()}
        got = self._routed("AddNodes", table, ids_a, {"node_type": t}, "ids", row, along)
        return sum(h["kept"] for _, (h, _) in got)

    def remove_nodes(self, table: str, ids: Any, node_type: str | None = None) -> int:
        """Remove nodes (their features and out-edges); returns how many were held."""
        got = self._routed(
            "RemoveNodes", table, as_ids(table, "ids", ids), {"node_type": node_type}, "ids"
        )
        return sum(h["removed"] for _, (h, _) in got)

    # -- queries ---------------------------------------------------------------------------
    def sample_neighbors(
        self,
        table: str,
        nodes: Any,
        fanout: int,
        edge_type: str | None = None,
        weighted: bool = False,
        return_weights: bool = False,
        return_eids: bool = False,
        seed: int | None = None,
    ) -> tuple[np.ndarray, ...]:
        """``(values, offsets[, weights][, eids])``: up to ``fanout`` distinct neighbours of each
        node without replacement (uniformly, or by edge weight), every neighbour when ``fanout``
        >= the degree, in the order of ``nodes``."""
        ids = as_ids(table, "nodes", nodes)
        fanout = GraphTable.check_fanout(table, fanout)
        header = {
            "edge_type": edge_type,
            "fanout": fanout,
            "weighted": bool(weighted),
            "return_weights": bool(return_weights),
            "return_eids": bool(return_eids),
            "seed": seed,
        }
        return self._sample(table, ids, header, retry=True)

    def _sample(
        self, table: str, ids: np.ndarray, header: dict, retry: bool
    ) -> tuple[np.ndarray, ...]:
        """:meth:`sample_neighbors` of checked ``ids``: through a shared-memory segment for
        each server on this host (:mod:`ps_server.rpc.graph_shm`), else through gRPC; once
        more when a server lost its segment (it restarted)."""
        fanout, rw, re = header["fanout"], header["return_weights"], header["return_eids"]
        kinds = ["values"] + ["weights"] * rw + ["eids"] * re
        row = 8 + fanout * (8 + 4 * rw + 8 * re)
        positions, keys = self._split(table, ids)
        calls: list[tuple[int, bytes]] = []
        parts: list[np.ndarray] = []
        segs: list[Segment | None] = []
        for s in range(self.num_servers):
            n = positions[s].shape[0]
            # a segment whatever the request's size: a server's share of a small batch (under
            # MIN_SHM_BYTES, 512 seeds at fanout 15) otherwise went through gRPC, whose request
            # costs client and server about 1.5 ms of CPU against a few hundredths of that
            need = max(graph_shm.bytes_needed(n, fanout, rw, re), MIN_SHM_BYTES)
            seg = self._lease_bytes(s, need) if n else None
            if seg is not None:
                graph_shm.views(seg.buf, seg.size, n, fanout, rw, re)["nodes"][...] = keys[s]
                shm_h = {"shm_segment": seg.name, "shm_num_nodes": n}
                calls.append((s, encode({"table": table, **header, **shm_h})))
                parts.append(positions[s])
                segs.append(seg)
                continue
            for part, part_keys in self._pieces(positions[s], keys[s], row):
                calls.append((s, encode({"table": table, **header}, {"nodes": narrow(part_keys)})))
                parts.append(part)
                segs.append(None)
        try:
            counts, items = [], []
            for (h, a), part, seg in zip(self._exchange(calls, segs), parts, segs):
                if seg is None:
                    counts.append(a["counts"])
                    items.append([_wide(a[k]) for k in kinds])
                    continue
                v = graph_shm.views(seg.buf, seg.size, part.shape[0], fanout, rw, re)
                counts.append(v["counts"])
                items.append([v[k][: h["total"]] for k in kinds])
            offsets, arrays = _regroup(parts, counts, items, ids.shape[0])  # copies out
        except PSRpcError as err:
            if self._release(segs, err) and retry:  # a server lost its segment: once more
                return self._sample(table, ids, header, retry=False)
            raise
        except BaseException:
            self._release(segs, None)
            raise
        self._release(segs, None)
        if not calls:
            arrays = [np.empty(0, np.float32 if k == "weights" else np.int64) for k in kinds]
        return (arrays[0], offsets, *arrays[1:])

    def degree(self, table: str, nodes: Any, edge_type: str | None = None) -> np.ndarray:
        """Out-degree of each node in ``edge_type``."""
        ids = as_ids(table, "nodes", nodes)
        out = np.zeros(ids.shape[0], np.int64)
        for part, (_, a) in self._routed("Degree", table, ids, {"edge_type": edge_type}):
            out[part] = a["degree"]
        return out

    def node_features(
        self,
        table: str,
        nodes: Any,
        names: Sequence[str] | None = None,
        node_type: str | None = None,
    ) -> dict[str, np.ndarray]:
        """``{name: [len(nodes), width]}`` in the order of ``nodes`` (zeros for unknown nodes;
        ``names`` None: every feature of the type)."""
        ids = as_ids(table, "nodes", nodes)
        cfg = self.config(table)
        t = _node_type(cfg, node_type)
        spec = {f[0]: f for f in cfg.node_features(t)}
        names = list(spec) if names is None else list(names)
        for n in names:
            if n not in spec:
                raise GraphInputError(
                    table,
                    "names",
                    f"unknown feature {n!r} of node type {t!r}; features: {sorted(spec)}",
                )
        out = {
            n: np.zeros(
                (ids.shape[0], spec[n][2]), np.float32 if spec[n][1] == "float32" else np.int64
            )
            for n in names
        }
        row = 8 + sum(spec[n][2] * 8 for n in names)
        header = {"names": names, "node_type": t}
        for part, (_, a) in self._routed("NodeFeatures", table, ids, header, row_bytes=row):
            for n in names:
                out[n][part] = a[f"feat:{n}"]
        return out

    def random_nodes(
        self, table: str, n: int, node_type: str | None = None, seed: int | None = None
    ) -> np.ndarray:
        """``min(n, total)`` distinct nodes of ``node_type``, uniform over every server's nodes
        (each server draws up to ``n`` of its own; the split over servers is multivariate
        hypergeometric in their counts)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise GraphInputError(table, "n", f"must be an integer >= 0, got {n!r}")
        replies = self._all(
            "RandomNodes", {"table": table, "n": int(n), "node_type": node_type, "seed": seed}
        )
        counts = np.array([h["count"] for h, _ in replies], np.int64)
        k = int(min(n, counts.sum()))
        rng = np.random.default_rng(seed)
        take = rng.multivariate_hypergeometric(counts, k) if k else np.zeros_like(counts)
        out = np.concatenate([a["ids"][:t] for (_, a), t in zip(replies, take)])
        return out[rng.permutation(out.shape[0])]

    def random_walk(
        self,
        table: str,
        start_nodes: Any,
        length: int,
        metapath: Sequence[str] | None = None,
        edge_type: str | None = None,
        seed: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(values, offsets)``: one walk per start node (the start, then up to ``length``
        nodes), each step a uniform out-neighbour along ``edge_type``, or along
        ``metapath[step % len(metapath)]``; a walk stops early at a node without out-edges.
        The walks cross servers server to server (one request per server from here)."""
        starts = as_ids(table, "start_nodes", start_nodes)
        parts = np.array_split(np.arange(starts.shape[0]), self.num_servers)
        header = {
            "table": table,
            "length": length,
            "metapath": list(metapath) if metapath else None,
            "edge_type": edge_type,
            "endpoints": list(self.endpoints),
            "seed": seed,
        }
        bodies = {
            s: encode(header, {"starts": starts[p]}) for s, p in enumerate(parts) if p.shape[0]
        }
        if not bodies:  # still check the arguments
            bodies = {0: encode(header, {"starts": starts})}
        replies = self._calls("RandomWalk", bodies)
        lengths = np.concatenate([replies[s][1]["lengths"] for s in sorted(replies)])
        values = np.concatenate([replies[s][1]["values"] for s in sorted(replies)])
        return values, _offsets(lengths)

    def node_counts(self, table: str, node_type: str | None = None) -> list[int]:
        """How many nodes of ``node_type`` each server holds."""
        replies = self._all("NodePage", {"table": table, "node_type": node_type, "size": 0})
        return [int(h["count"]) for h, _ in replies]

    def pull_graph_list(
        self, table: str, start: int, size: int, node_type: str | None = None
    ) -> np.ndarray:
        """Ids ``[start, start + size)`` of every node of ``node_type``, in a fixed order (server
        after server, sorted ids within one): page through them for full-graph inference."""
        for what, v in (("start", start), ("size", size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise GraphInputError(table, what, f"must be an integer >= 0, got {v!r}")
        counts = self.node_counts(table, node_type)
        bodies, first = {}, 0
        for s, c in enumerate(counts):
            lo, hi = max(start - first, 0), min(start + size - first, c)
            if hi > lo:
                bodies[s] = encode(
                    {"table": table, "node_type": node_type, "start": lo, "size": hi - lo}
                )
            first += c
        replies = self._calls("NodePage", bodies)
        parts = [replies[s][1]["ids"] for s in sorted(replies)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def save_graph(self, table: str, directory: str) -> dict[str, int]:
        """Every server writes its part of ``table`` under ``directory/<table>/`` (a path under
        the servers' checkpoint roots). Returns the nodes and edges written, summed."""
        replies = self._all("SaveGraph", {"table": table, "dir": directory})
        return {k: sum(h[k] for h, _ in replies) for k in ("nodes", "edges")}

    def load_graph(self, table: str, directory: str) -> dict[str, int]:
        """Load a saved table (saved by any number of servers) into these servers, replacing
        its contents; each keeps what it owns. Returns the nodes and edges held, summed."""
        replies = self._all("LoadGraph", {"table": table, "dir": directory})
        self._configs.pop(table, None)
        return {k: sum(h[k] for h, _ in replies) for k in ("nodes", "edges")}

    def graph_stats(self, table: str) -> list[dict[str, Any]]:
        """Per server: nodes per type, edges per edge type, skipped lines, next edge id."""
        return [h["stats"] for h, _ in self._all("Describe", {"table": table})]


__all__ = ["GraphClient"]
