"""A graph table's part on one server: CSR adjacency per edge type, node features per node type.

Nodes are int64 ids sharded over the servers as sparse keys are
(:func:`ps_server.core.routing.shard_of`, shard ``% num_servers``); a server holds the out-edges
of the nodes it owns and their features. Everything is numpy arrays, no object per node:

* per edge type, a CSR: sorted unique ``src`` ids, ``indptr``, and per edge ``dst`` (int64),
  ``weight`` (float32, 1.0 unless given) and ``eid`` (int64 edge id). Added edges are buffered
  and merged into the CSR in one vectorised pass (a stable sort by ``src``,
  :mod:`ps_server.core.graph_csr`) before the next query, so a node's edges keep the order they were
  added in; removing edges or nodes rebuilds it the same way.
* per node type, sorted ``ids`` and one array ``[n, width]`` per feature; a node's row is found
  by ``np.searchsorted``. A node added again gets the new features (the last one wins).

The nodes of a type are the ones added with that type plus the sources of the edge types whose
source type it is (what :meth:`GraphTable.node_ids` pages over and :meth:`random_nodes` draws
from). Edge ids: the edges of one load or add get consecutive ids after the table's previous
ones, in file / request order (the reversed copies of ``reverse=True`` after them), the same on
every server because every server reads every file; so an id names one edge in the whole table.

Thread safety: a lock guards changes; a query takes a consistent snapshot of the arrays under it
and computes outside it (arrays are replaced, never changed in place).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ps_server.config import GraphTableConfig
from ps_server.core import graph_kernels, kernels
from ps_server.core.graph_csr import CSR, EdgeStore
from ps_server.core.graph_files import (
    GraphInputError,
    check_on_error,
    expand_paths,
    parse_edges,
    parse_nodes,
    read_bytes,
)
from ps_server.core.graph_sampling import ranges, sample_segments
from ps_server.core.routing import ROUTE_SALT, shard_of


@dataclass(frozen=True)
class _Nodes:
    ids: np.ndarray
    features: dict[str, np.ndarray]


def as_ids(table: str, field: str, values: object) -> np.ndarray:
    """``values`` as a 1-D int64 array; GraphInputError for anything that is not int64 ids
    (floats, strings, values outside the int64 range)."""
    a = np.asarray(values)
    if a.dtype == object or a.dtype.kind not in "iu" and a.size:
        raise GraphInputError(
            table, field, f"must be int64 node ids, got dtype {a.dtype} (e.g. {a.ravel()[:3]})"
        )
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        raise GraphInputError(table, field, f"ids above the int64 range: {a.max()}")
    return np.ascontiguousarray(a.reshape(-1), dtype=np.int64)


class GraphTable:
    """Server ``server_index`` of ``num_servers``'s part of graph table ``config``."""

    KIND = "graph"

    def __init__(self, config: GraphTableConfig, server_index: int = 0, num_servers: int = 1):
        self.config = config
        self.name = config.name
        self.server_index, self.num_servers = server_index, num_servers
        self._lock = threading.RLock()
        self._edges = {e[0]: EdgeStore() for e in config.edge_types}
        self._specs = {t: config.node_features(t) for t in config.node_types}
        self._nodes = {t: self._empty_nodes(t) for t in config.node_types}
        self._type_ids: dict[str, np.ndarray] = {}
        self.next_eid = 0
        self.skipped_lines = 0

    def _empty_nodes(self, node_type: str) -> _Nodes:
        feats = {
            n: np.zeros((0, w), np.float32 if d == "float32" else np.int64)
            for n, d, w in self._specs[node_type]
        }
        return _Nodes(np.empty(0, np.int64), feats)

    # -- checks ----------------------------------------------------------------------------
    def _error(self, field: str, message: str) -> GraphInputError:
        return GraphInputError(self.name, field, message)

    def edge_type(self, name: str | None) -> tuple[str, str, str]:
        """``(name, src_type, dst_type)``; None names the only edge type."""
        if name is None or name == "":
            if len(self.config.edge_types) == 1:
                return self.config.edge_types[0]
            raise self._error(
                "edge_type",
                f"name one of the edge types {[e[0] for e in self.config.edge_types]}",
            )
        for e in self.config.edge_types:
            if e[0] == name:
                return e
        raise self._error(
            "edge_type",
            f"unknown edge type {name!r}; edge types: {[e[0] for e in self.config.edge_types]}",
        )

    def node_type(self, name: str | None) -> str:
        """The node type ``name`` (None: the only node type)."""
        if name is None or name == "":
            if len(self.config.node_types) == 1:
                return self.config.node_types[0]
            raise self._error("node_type", f"name one of {list(self.config.node_types)}")
        if name not in self._specs:
            raise self._error(
                "node_type",
                f"unknown node type {name!r}; node types: {list(self.config.node_types)}",
            )
        return name

    def owned(self, ids: np.ndarray) -> np.ndarray:
        """Mask of the ids this server owns."""
        if self.num_servers == 1:
            return np.ones(ids.shape[0], bool)
        if graph_kernels.ENABLED:
            return graph_kernels.owned_mask(
                ids, ROUTE_SALT, self.config.num_shards, self.num_servers, self.server_index
            )
        return shard_of(ids, self.config.num_shards) % self.num_servers == self.server_index

    @staticmethod
    def check_fanout(table: str, fanout: object) -> int:
        """``fanout`` as an int >= 1 (GraphInputError naming the value otherwise)."""
        if isinstance(fanout, bool) or not isinstance(fanout, (int, np.integer)) or fanout < 1:
            raise GraphInputError(table, "fanout", f"must be an integer >= 1, got {fanout!r}")
        return int(fanout)

    def check_metapath(self, metapath: Sequence[str], length: int) -> list[tuple[str, str, str]]:
        """The edge types of ``metapath``; GraphInputError when a type is unknown or the types
        do not chain (dst type of one = src type of the next, cyclically when the walk is longer
        than the metapath)."""
        if not metapath:
            raise self._error("metapath", "must name at least one edge type")
        types = [self.edge_type(m) for m in metapath]
        pairs = list(zip(types, types[1:]))
        if length > len(types):
            pairs.append((types[-1], types[0]))
        for a, b in pairs:
            if a[2] and b[1] and a[2] != b[1]:
                raise self._error(
                    "metapath",
                    f"edge type {a[0]!r} ends at {a[2]!r} but the next one, {b[0]!r}, starts "
                    f"at {b[1]!r}: metapath {list(metapath)} does not chain",
                )
        return types

    # -- editing ---------------------------------------------------------------------------
    def _changed(self) -> None:
        self._type_ids.clear()

    def add_edges(
        self,
        edge_type: str | None,
        src: object,
        dst: object,
        weight: object = None,
        eids: object = None,
    ) -> int:
        """Add the edges whose ``src`` this server owns; returns how many. ``eids``: their ids
        (default: consecutive after the table's last)."""
        name = self.edge_type(edge_type)[0]
        s, d = as_ids(self.name, "src", src), as_ids(self.name, "dst", dst)
        if s.shape != d.shape:
            raise self._error("dst", f"{d.shape[0]} dst ids for {s.shape[0]} src ids")
        w = np.ones(s.shape[0], np.float32) if weight is None else np.asarray(weight, np.float32)
        if w.shape != s.shape:
            raise self._error("weight", f"{w.shape[0]} weights for {s.shape[0]} edges")
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise self._error("weight", "weights must be finite and >= 0")
        with self._lock:
            if eids is None:
                e = self.next_eid + np.arange(s.shape[0], dtype=np.int64)
                self.next_eid += s.shape[0]
            else:
                e = as_ids(self.name, "eids", eids)
            keep = self.owned(s)
            if not np.all(keep):
                s, d, w, e = s[keep], d[keep], w[keep], e[keep]
            if s.shape[0]:
                self._edges[name].pending.append((s, d, w, e))
                self._changed()
        return int(s.shape[0])

    def add_edge_batch(
        self,
        edge_type: str | None,
        src: object,
        dst: object,
        weight: object,
        positions: object,
        total: int,
    ) -> int:
        """This server's edges of a client's batch of ``total`` edges: ``positions`` (in the
        batch) give their ids, the table's next id + position; every server moves its id
        counter by ``total``, so the counters stay equal. Returns how many were kept."""
        pos = as_ids(self.name, "positions", positions)
        if isinstance(total, bool) or not isinstance(total, int) or total < pos.shape[0]:
            raise self._error("total", f"must be an integer >= {pos.shape[0]}, got {total!r}")
        if pos.shape[0] and (pos.min() < 0 or pos.max() >= total):
            raise self._error("positions", f"must lie in [0, {total})")
        with self._lock:
            kept = self.add_edges(edge_type, src, dst, weight, self.next_eid + pos)
            self.next_eid += total
        return kept

    def remove_edges(self, edge_type: str | None, src: object, dst: object) -> int:
        """Remove every ``edge_type`` edge equal to one of the (src, dst) pairs; returns how
        many were removed."""
        name = self.edge_type(edge_type)[0]
        s, d = as_ids(self.name, "src", src), as_ids(self.name, "dst", dst)
        if s.shape != d.shape:
            raise self._error("dst", f"{d.shape[0]} dst ids for {s.shape[0]} src ids")
        if s.shape[0] == 0:
            return 0
        with self._lock:
            csr = self._edges[name].merged()
            es, ed = csr.edge_src(), csr.dst
            n = es.shape[0]
            all_s, all_d = np.concatenate([es, s]), np.concatenate([ed, d])
            order = np.lexsort((all_d, all_s))
            ss, dd = all_s[order], all_d[order]
            new_group = np.ones(order.shape[0], bool)
            new_group[1:] = (ss[1:] != ss[:-1]) | (dd[1:] != dd[:-1])
            group = np.cumsum(new_group) - 1
            hit = np.bincount(group, weights=(order >= n).astype(np.float64))
            gone = np.zeros(n, bool)
            is_edge = order < n
            gone[order[is_edge]] = hit[group[is_edge]] > 0
            removed = int(gone.sum())
            if removed:
                k = ~gone
                self._edges[name].csr = CSR.build(es[k], ed[k], csr.weight[k], csr.eid[k])
                self._changed()
        return removed

    def add_nodes(self, node_type: str | None, ids: object, features: dict | None = None) -> int:
        """Add (or update) the nodes of ``node_type`` this server owns, with their features
        (``{name: [n, width]}``; missing ones are zeros); returns how many."""
        t = self.node_type(node_type)
        ids_a = as_ids(self.name, "ids", ids)
        n = ids_a.shape[0]
        spec = {f[0]: f for f in self._specs[t]}
        features = dict(features or {})
        for fname in features:
            if fname not in spec:
                raise self._error(
                    "features",
                    f"unknown feature {fname!r} of node type {t!r}; features: {sorted(spec)}",
                )
        arrays = {}
        for fname, dtype, width in self._specs[t]:
            if fname in features:
                a = np.asarray(features[fname])
                if dtype == "int64" and a.size and a.dtype.kind not in "iu":
                    raise self._error(fname, f"feature {fname!r} is int64, got dtype {a.dtype}")
                a = a.astype(np.float32 if dtype == "float32" else np.int64, copy=False)
                if a.ndim == 1 and width == 1:
                    a = a.reshape(-1, 1)
                if a.shape != (n, width):
                    raise self._error(
                        fname,
                        f"feature {fname!r} of node type {t!r} has width {width}: expected shape "
                        f"({n}, {width}) for {n} node(s), got {tuple(a.shape)}",
                    )
            else:
                a = np.zeros((n, width), np.float32 if dtype == "float32" else np.int64)
            arrays[fname] = a
        keep = self.owned(ids_a)
        ids_a = ids_a[keep]
        arrays = {k: v[keep] for k, v in arrays.items()}
        with self._lock:
            old = self._nodes[t]
            all_ids = np.concatenate([old.ids, ids_a])
            order = np.argsort(all_ids, kind="stable")
            sorted_ids = all_ids[order]
            last = np.ones(order.shape[0], bool)
            last[:-1] = sorted_ids[1:] != sorted_ids[:-1]
            take = order[last]
            feats = {k: np.concatenate([old.features[k], arrays[k]])[take] for k in arrays}
            self._nodes[t] = _Nodes(all_ids[take], feats)
            self._changed()
        return int(ids_a.shape[0])

    def remove_nodes(self, node_type: str | None, ids: object) -> int:
        """Remove nodes of ``node_type`` (their features and out-edges of every edge type whose
        source type it is); returns how many nodes were held. In-edges held by other servers
        stay."""
        t = self.node_type(node_type)
        ids_a = np.unique(as_ids(self.name, "ids", ids))
        with self._lock:
            old = self._nodes[t]
            keep = ~np.isin(old.ids, ids_a)
            held = int(np.count_nonzero(np.isin(ids_a, self.node_ids(t))))
            self._nodes[t] = _Nodes(old.ids[keep], {k: v[keep] for k, v in old.features.items()})
            for name, src_type, _ in self.config.edge_types:
                if src_type not in ("", t):
                    continue
                csr = self._edges[name].merged()
                es = csr.edge_src()
                k = ~np.isin(es, ids_a)
                if not np.all(k):
                    self._edges[name].csr = CSR.build(es[k], csr.dst[k], csr.weight[k], csr.eid[k])
            self._changed()
        return held

    # -- loading ---------------------------------------------------------------------------
    def load_edges(
        self,
        edge_type: str | None,
        paths: str | Sequence[str],
        reverse: bool = False,
        on_error: str = "raise",
    ) -> dict[str, int]:
        """Read every file (every server reads all of them) and keep the edges whose source
        this server owns (``reverse``: dst->src too). Every file is parsed before anything is
        added: a bad line (``on_error="raise"``) leaves the table as it was."""
        name = self.edge_type(edge_type)[0]
        check_on_error(self.name, on_error)
        files = expand_paths(self.name, paths)
        parsed = self._parse_edge_files(files, on_error)
        src = np.concatenate([p.src for p in parsed]) if parsed else np.empty(0, np.int64)
        dst = np.concatenate([p.dst for p in parsed]) if parsed else np.empty(0, np.int64)
        weight = (
            np.concatenate(
                [
                    p.weight if p.weight is not None else np.ones(p.src.shape[0], np.float32)
                    for p in parsed
                ]
            )
            if parsed
            else np.empty(0, np.float32)
        )
        skipped = sum(p.skipped for p in parsed)
        n = int(src.shape[0])
        with self._lock:
            base = self.next_eid
            self.next_eid += n * (2 if reverse else 1)
            eids = base + np.arange(n, dtype=np.int64)
            kept = self.add_edges(name, src, dst, weight, eids)
            if reverse:
                kept += self.add_edges(name, dst, src, weight, eids + n)
            self._edges[name].merged()  # the CSR is built as part of the load
            self.skipped_lines += skipped
        return {
            "files": len(files),
            "edges": n * (2 if reverse else 1),
            "kept": kept,
            "skipped": skipped,
        }

    def _parse_edge_files(self, files: list[str], on_error: str) -> list:
        """Every file read and parsed; with the compiled parser (which works without the GIL),
        files in parallel on up to the server's table threads
        (:func:`ps_server.core.kernels.get_threads`). A bad line raises for the first file
        (in order) that has one, as a sequential read would."""

        def parse(path: str):
            return parse_edges(self.name, read_bytes(self.name, path), path, on_error)

        threads = min(len(files), kernels.get_threads()) if graph_kernels.ENABLED else 1
        if threads <= 1:
            return [parse(f) for f in files]
        with ThreadPoolExecutor(threads, thread_name_prefix="graphload") as pool:
            return list(pool.map(parse, files))

    def load_nodes(self, paths: str | Sequence[str], on_error: str = "raise") -> dict[str, int]:
        """Read node files (``type<TAB>id<TAB>name v v...``) and keep the nodes this server
        owns; all files are parsed before anything is added."""
        check_on_error(self.name, on_error)
        files = expand_paths(self.name, paths)
        per_file = []
        skipped = 0
        for f in files:
            nodes, bad = parse_nodes(self.name, read_bytes(self.name, f), f, self._specs, on_error)
            per_file.append(nodes)
            skipped += bad
        total = kept = 0
        with self._lock:
            for nodes in per_file:
                for t, p in nodes.items():
                    total += int(p.ids.shape[0])
                    if p.ids.shape[0]:
                        kept += self.add_nodes(t, p.ids, p.features)
            self.skipped_lines += skipped
        return {"files": len(files), "nodes": total, "kept": kept, "skipped": skipped}

    # -- queries ---------------------------------------------------------------------------
    def _csr(self, name: str) -> CSR:
        with self._lock:
            return self._edges[name].merged()

    def sample_neighbors(
        self,
        nodes: object,
        fanout: int,
        edge_type: str | None = None,
        weighted: bool = False,
        rng: np.random.Generator | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(neighbours, counts, weights, edge ids): up to ``fanout`` distinct out-edges of each
        node, grouped in the order of ``nodes`` (every edge when ``fanout`` >= the degree)."""
        fanout = self.check_fanout(self.name, fanout)
        name = self.edge_type(edge_type)[0]
        ids = as_ids(self.name, "nodes", nodes)
        csr, pos, counts = self.sample_positions(ids, fanout, name, weighted, rng)
        return csr.dst[pos], counts, csr.weight[pos], csr.eid[pos]

    def sample_positions(
        self,
        ids: np.ndarray,
        fanout: int,
        name: str,
        weighted: bool = False,
        rng: np.random.Generator | None = None,
    ) -> tuple[CSR, np.ndarray, np.ndarray]:
        """(the CSR, the CSR positions of the sampled edges, counts per node) of
        :meth:`sample_neighbors` with checked arguments (int64 ``ids``, the edge type's
        ``name``), for callers that gather only some of the edges' columns."""
        csr = self._csr(name)
        rng = rng or np.random.default_rng()
        if not weighted and graph_kernels.ENABLED:
            pos, counts = graph_kernels.sample_uniform(csr.src, csr.indptr, ids, fanout, rng)
            return csr, pos, counts
        starts, deg = csr.locate(ids)
        pos, counts = sample_segments(starts, deg, fanout, rng, csr.weight if weighted else None)
        return csr, pos, counts

    def walk_step(
        self, nodes: object, edge_type: str | None, rng: np.random.Generator | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(one uniform random out-neighbour per node, mask of the nodes that have one; the
        others' entries are 0)."""
        name = self.edge_type(edge_type)[0]
        ids = as_ids(self.name, "nodes", nodes)
        csr = self._csr(name)
        starts, deg = csr.locate(ids)
        rng = rng or np.random.default_rng()
        nxt = np.zeros(ids.shape[0], np.int64)
        has = deg > 0
        pick = starts[has] + (rng.random(int(has.sum())) * deg[has]).astype(np.int64)
        nxt[has] = csr.dst[np.minimum(pick, starts[has] + deg[has] - 1)]
        return nxt, has

    def degree(self, nodes: object, edge_type: str | None = None) -> np.ndarray:
        """Out-degree of each node in ``edge_type`` (0 for nodes without edges here)."""
        name = self.edge_type(edge_type)[0]
        return self._csr(name).locate(as_ids(self.name, "nodes", nodes))[1]

    def node_ids(self, node_type: str | None = None) -> np.ndarray:
        """Sorted ids of every node of ``node_type`` this server holds."""
        t = self.node_type(node_type)
        with self._lock:
            cached = self._type_ids.get(t)
            if cached is None:
                parts = [self._nodes[t].ids]
                for name, src_type, _ in self.config.edge_types:
                    if src_type == t:
                        parts.append(self._edges[name].merged().src)
                cached = np.unique(np.concatenate(parts))
                self._type_ids[t] = cached
            return cached

    def random_nodes(
        self, n: int, node_type: str | None = None, rng: np.random.Generator | None = None
    ) -> tuple[np.ndarray, int]:
        """(up to ``n`` distinct nodes of the type in random order, how many this server has)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise self._error("n", f"must be an integer >= 0, got {n!r}")
        ids = self.node_ids(node_type)
        rng = rng or np.random.default_rng()
        k = min(int(n), ids.shape[0])
        return ids[rng.choice(ids.shape[0], size=k, replace=False)], int(ids.shape[0])

    def node_features(
        self, nodes: object, names: Sequence[str] | None = None, node_type: str | None = None
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """({name: [n, width]} in the order of ``nodes``, found mask); nodes this server does not
        hold get zeros. ``names`` None: every feature of the type."""
        t = self.node_type(node_type)
        spec = {f[0]: f for f in self._specs[t]}
        names = list(spec) if names is None else list(names)
        for fname in names:
            if fname not in spec:
                raise self._error(
                    "names",
                    f"unknown feature {fname!r} of node type {t!r}; features: {sorted(spec)}",
                )
        ids = as_ids(self.name, "nodes", nodes)
        with self._lock:
            held = self._nodes[t]
        if held.ids.shape[0]:
            i = np.minimum(np.searchsorted(held.ids, ids), held.ids.shape[0] - 1)
            found = held.ids[i] == ids
        else:
            i, found = np.zeros(ids.shape[0], np.int64), np.zeros(ids.shape[0], bool)
        out = {}
        for fname in names:
            _, dtype, width = spec[fname]
            a = np.zeros((ids.shape[0], width), np.float32 if dtype == "float32" else np.int64)
            if held.ids.shape[0]:
                a[found] = held.features[fname][i[found]]
            out[fname] = a
        return out, found

    def stats(self) -> dict[str, object]:
        """Nodes per node type and edges per edge type on this server."""
        return {
            "nodes": {t: int(self.node_ids(t).shape[0]) for t in self.config.node_types},
            "edges": {e: self._csr(e).num_edges for e in self._edges},
            "skipped_lines": self.skipped_lines,
            "next_eid": self.next_eid,
        }


__all__ = ["GraphTable", "as_ids", "ranges"]
