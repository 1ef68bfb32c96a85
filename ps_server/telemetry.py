"""The parameter server's Prometheus metrics: definitions, the scrape-time request and table
collectors, the ``/metrics`` endpoint of a server process.

Per request (recorded by the servicer, :mod:`ps_server.rpc.service`): ``fleet_ps_requests_total``
by op, table and gRPC status code, ``fleet_ps_request_seconds`` by op, sparse keys pulled/pushed.
Per table, read from :meth:`~ps_server.core.table.Table.stats` only when Prometheus scrapes
(:class:`TableCollector`; nothing on the request path): rows, bytes, admitted / filtered /
evicted keys and non-finite gradients skipped; non-finite gradients *rejected* on arrival
(``nonfinite: reject``) are counted by the servicer and added in. Checkpoint save/load durations.
Graph tables (:mod:`ps_server.rpc.graph_service`): their requests count in
``fleet_ps_requests_total`` (op ``Graph.<method>``) like the others, plus their handling time per
op and table (``fleet_ps_graph_request_seconds``, a summary: sum and count), and nodes and edges
per graph table read at scrape time (``fleet_ps_graph_nodes`` / ``fleet_ps_graph_edges``).
Calls refused for a missing or wrong token (``fleet_ps_auth_failures_total`` by op and cause,
counted by :class:`ps_server.rpc.auth.TokenInterceptor`; a plain Counter: refusals are not the
hot path).

Labels stay small: ``op`` is an RPC name, ``table`` a table the job created, ``code`` a gRPC
status name. One endpoint per process (:func:`start`): several ``PSServer`` objects in one
process (tests) share it, and their tables are reported together.

Why the per-request metrics are not ``prometheus_client`` Counter/Histogram objects: each of
their ``inc``/``observe`` calls takes its own lock (a histogram observation two): 4-10 us per
request for the three metrics on a 2-core box, the per-request part of the server-side cost that
``bench/bench_metrics_overhead.py`` measures. :class:`RequestCollector` adds a request to plain
dicts under one lock (about 3x less: 3.4 vs 9.8 us, measured interleaved on the same loaded box)
and builds the same metric families (same names, labels, buckets; no ``_created`` samples) only
when Prometheus scrapes, as :class:`TableCollector` does for the tables.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from collective.errors import PSError
from collective.metrics_http import serve_metrics, stop_metrics

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)

# -- metric definitions (the naming test scans this module) -----------------------------------
CHECKPOINT_SECONDS = Histogram(
    "fleet_ps_checkpoint_seconds",
    "Checkpoint time (op: save / load "
    "RPCs; snapshot: tables locked for a job checkpoint or export; "
    "write: its background write)",
    ["op"],
    buckets=CHECKPOINT_BUCKETS,
)
AUTH_FAILURES = Counter(
    "fleet_ps_auth_failures",
    "RPCs refused for a missing or wrong token "
    "(op: the method, or 'unknown'; cause: missing_token / wrong_token)",
    ["op", "cause"],
)
# Collected at scrape time by RequestCollector and TableCollector: exposed name -> label names
REQUESTS = "fleet_ps_requests_total"
REQUEST_SECONDS = "fleet_ps_request_seconds"
KEYS = "fleet_ps_keys_total"
TABLE_ROWS = "fleet_ps_table_rows"
TABLE_BYTES = "fleet_ps_table_bytes"
ENTRY_KEYS = "fleet_ps_entry_keys_total"
NONFINITE = "fleet_ps_nonfinite_gradients_total"
SSD_KEYS = "fleet_ps_ssd_keys_total"
SSD_BYTES = "fleet_ps_ssd_bytes"
SSD_READ_SECONDS = "fleet_ps_ssd_read_seconds_total"
GRAPH_REQUEST_SECONDS = "fleet_ps_graph_request_seconds"
GRAPH_NODES = "fleet_ps_graph_nodes"
GRAPH_EDGES = "fleet_ps_graph_edges"
SSD_RESULTS = {
    "hot_hit": "hot_hits",
    "hot_miss": "hot_misses",
    "cold_hit": "cold_hits",
    "evicted": "tier_evictions",
}
"""``result`` label of ``fleet_ps_ssd_keys_total`` -> the SSD table's stats key."""
COLLECTED: dict[str, tuple[str, ...]] = {
    REQUESTS: ("op", "table", "code"),
    REQUEST_SECONDS: ("op",),
    KEYS: ("op", "table"),
    TABLE_ROWS: ("table",),
    TABLE_BYTES: ("table",),
    ENTRY_KEYS: ("table", "result"),
    NONFINITE: ("table",),
    SSD_KEYS: ("table", "result"),
    SSD_BYTES: ("table",),
    SSD_READ_SECONDS: ("table",),
    GRAPH_REQUEST_SECONDS: ("op", "table"),
    GRAPH_NODES: ("table",),
    GRAPH_EDGES: ("table",),
}


class RequestCollector(Collector):
    """``fleet_ps_requests_total`` (op, table, code), ``fleet_ps_request_seconds`` (op),
    ``fleet_ps_keys_total`` (op pull/push, table) and ``fleet_ps_graph_request_seconds`` (op,
    table; graph calls only): counted per request in plain dicts under one lock
    (:meth:`record`), turned into metric families at scrape time (:meth:`collect`)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self._bounds = tuple(sorted(buckets))
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, str], int] = {}
        self._latency: dict[str, list[float]] = {}
        """op -> [sum of seconds, count per bucket (not cumulative) ..., count above the last]"""
        self._keys: dict[tuple[str, str], int] = {}
        self._graph: dict[tuple[str, str], list[float]] = {}
        """(graph op, table) -> [sum of seconds, count]"""

    def record(self, op: str, table: str, code: str, seconds: float, num_keys: int = 0) -> None:
        """Count one request of ``op`` that took ``seconds`` and moved ``num_keys`` sparse keys."""
        slot = bisect_left(self._bounds, seconds) + 1  # first bucket with seconds <= le
        req = (op, table, code)
        with self._lock:
            self._requests[req] = self._requests.get(req, 0) + 1
            lat = self._latency.get(op)
            if lat is None:
                lat = self._latency[op] = [0.0] * (len(self._bounds) + 2)
            lat[0] += seconds
            lat[slot] += 1
            if num_keys:
                key = ("pull" if op == "PullSparse" else "push", table)
                self._keys[key] = self._keys.get(key, 0) + num_keys
            if table and op.startswith("Graph."):
                g = self._graph.get(req[:2])
                if g is None:
                    g = self._graph[req[:2]] = [0.0, 0.0]
                g[0] += seconds
                g[1] += 1

    def collect(self) -> Iterator[Any]:
        with self._lock:
            requests, keys = dict(self._requests), dict(self._keys)
            latency = {op: list(v) for op, v in self._latency.items()}
            graph = {k: list(v) for k, v in self._graph.items()}
        req = CounterMetricFamily(
            REQUESTS.removesuffix("_total"),
            "RPCs handled, by op, table and gRPC status code",
            labels=COLLECTED[REQUESTS],
        )
        for labels, n in sorted(requests.items()):
            req.add_metric(labels, n)
        hist = HistogramMetricFamily(
            REQUEST_SECONDS, "RPC handling time, by op", labels=COLLECTED[REQUEST_SECONDS]
        )
        les = [floatToGoString(b) for b in (*self._bounds, math.inf)]
        for op, lat in sorted(latency.items()):
            cumulative, buckets = 0.0, []
            for le, n in zip(les, lat[1:]):
                cumulative += n
                buckets.append((le, cumulative))
            hist.add_metric([op], buckets, lat[0])
        moved = CounterMetricFamily(
            KEYS.removesuffix("_total"), "Sparse keys pulled / pushed", labels=COLLECTED[KEYS]
        )
        for labels2, n in sorted(keys.items()):
            moved.add_metric(labels2, n)
        graph_time = SummaryMetricFamily(
            GRAPH_REQUEST_SECONDS,
            "Graph-table RPC handling time, by op and graph table",
            labels=COLLECTED[GRAPH_REQUEST_SECONDS],
        )
        for labels3, (total, count) in sorted(graph.items()):
            graph_time.add_metric(labels3, count_value=count, sum_value=total)
        yield from (req, hist, moved, graph_time)

    def describe(self) -> Iterator[Any]:
        return iter(())


class TableCollector(Collector):
    """Table gauges and counters read from the live servers' tables at scrape time."""

    def __init__(self) -> None:
        self._states: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def add(self, state: Any) -> None:
        """Report the tables of this :class:`~ps_server.rpc.service.ServerState` (weakly held)."""
        with self._lock:
            self._states[id(state)] = state

    def collect(self) -> Iterator[Any]:
        rows = GaugeMetricFamily(
            TABLE_ROWS, "Rows (sparse) or values (dense) held", labels=["table"]
        )
        size = GaugeMetricFamily(TABLE_BYTES, "Memory held by the table", labels=["table"])
        entry = CounterMetricFamily(
            ENTRY_KEYS.removesuffix("_total"),
            "Keys admitted (rows created), filtered by the entry policy, "
            "evicted (capacity or shrink)",
            labels=["table", "result"],
        )
        bad = CounterMetricFamily(
            NONFINITE.removesuffix("_total"),
            "NaN/inf gradient contributions rejected or skipped",
            labels=["table"],
        )
        ssd_keys = CounterMetricFamily(
            SSD_KEYS.removesuffix("_total"),
            "storage='ssd' tables: keys found in memory (hot_hit) or not (hot_miss), rows read "
            "back from disk (cold_hit), rows written to disk (evicted)",
            labels=["table", "result"],
        )
        ssd_bytes = GaugeMetricFamily(
            SSD_BYTES, "storage='ssd' tables: bytes of the cold tier's files", labels=["table"]
        )
        ssd_read = CounterMetricFamily(
            SSD_READ_SECONDS.removesuffix("_total"),
            "storage='ssd' tables: time spent reading cold rows from RocksDB",
            labels=["table"],
        )
        graph_nodes = GaugeMetricFamily(
            GRAPH_NODES, "Nodes of a graph table (every node type)", labels=["table"]
        )
        graph_edges = GaugeMetricFamily(
            GRAPH_EDGES, "Edges of a graph table (every edge type)", labels=["table"]
        )
        ssd: dict[str, dict[str, float]] = {}
        totals: dict[str, dict[str, float]] = {}
        graphs: dict[str, list[float]] = {}
        with self._lock:
            states = list(self._states.values())
        for state in states:
            for name, graph in list(getattr(state, "graph_tables", {}).items()):
                gst = graph.stats()
                g = graphs.setdefault(name, [0.0, 0.0])
                g[0] += sum(gst["nodes"].values())
                g[1] += sum(gst["edges"].values())
            with state.counter_lock:
                rejected = dict(state.nonfinite_rejected)
            for name, table in list(state.tables.items()):
                st = table.stats()
                t = totals.setdefault(
                    name,
                    dict.fromkeys(
                        ("rows", "bytes", "admitted", "filtered", "evicted", "nonfinite"), 0.0
                    ),
                )
                t["sparse"] = float(st.get("kind") == "sparse")
                t["rows"] += st.get("num_rows", st.get("num_values", 0))
                t["bytes"] += st.get("memory_bytes", 0)
                t["admitted"] += st.get("rows_created", 0)
                t["filtered"] += st.get("pushes_filtered", 0)
                t["evicted"] += st.get("rows_evicted", 0) + st.get("rows_shrunk", 0)
                t["nonfinite"] += st.get("nonfinite_skipped", 0) + rejected.get(name, 0)
                if st.get("storage") == "ssd":
                    d = ssd.setdefault(name, {})
                    for key in (*SSD_RESULTS.values(), "ssd_bytes", "ssd_read_seconds"):
                        d[key] = d.get(key, 0.0) + st.get(key, 0)
        for name in sorted(totals):
            t = totals[name]
            rows.add_metric([name], t["rows"])
            size.add_metric([name], t["bytes"])
            if t["sparse"]:
                for result in ("admitted", "filtered", "evicted"):
                    entry.add_metric([name, result], t[result])
            bad.add_metric([name], t["nonfinite"])
        for name in sorted(ssd):
            d = ssd[name]
            for result, key in SSD_RESULTS.items():
                ssd_keys.add_metric([name, result], d[key])
            ssd_bytes.add_metric([name], d["ssd_bytes"])
            ssd_read.add_metric([name], d["ssd_read_seconds"])
        for name in sorted(graphs):
            graph_nodes.add_metric([name], graphs[name][0])
            graph_edges.add_metric([name], graphs[name][1])
        yield from (rows, size, entry, bad, ssd_keys, ssd_bytes, ssd_read, graph_nodes, graph_edges)

    def describe(self) -> Iterator[Any]:
        return iter(())


REQUEST_STATS = RequestCollector()
REGISTRY.register(REQUEST_STATS)
TABLES = TableCollector()
REGISTRY.register(TABLES)

_server_lock = threading.Lock()
_endpoint: dict[str, Any] = {"server": None, "port": 0}


def start(port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` on ``host:port`` for this process (0 = a free port); returns the port.
    Idempotent: later calls (another PSServer in the process) return the running port."""
    with _server_lock:
        if _endpoint["server"] is None:
            try:
                server, _port = serve_metrics(host, port)
            except OSError as err:
                raise PSError(
                    f"parameter server cannot serve /metrics on {host}:{port}: "
                    f"{err.strerror or err} (port busy? let fleetrun pick FLEET_METRICS_PORT)"
                ) from None
            _endpoint.update(server=server, port=int(server.server_port))
            logger.info("parameter-server metrics on http://%s:%d/metrics", host, _endpoint["port"])
        return int(_endpoint["port"])


def stop() -> None:
    """Stop this process's ``/metrics`` endpoint (tests)."""
    with _server_lock:
        server = _endpoint["server"]
        if server is not None:
            stop_metrics(server)
        _endpoint.update(server=None, port=0)


__all__ = [
    "AUTH_FAILURES",
    "CHECKPOINT_SECONDS",
    "COLLECTED",
    "GRAPH_EDGES",
    "GRAPH_NODES",
    "GRAPH_REQUEST_SECONDS",
    "KEYS",
    "REQUESTS",
    "REQUEST_SECONDS",
    "REQUEST_STATS",
    "TABLES",
    "RequestCollector",
    "TableCollector",
    "enabled",
    "record_request",
    "start",
    "stop",
]


# -- the servicer's hook -----------------------------------------------------------------------
_CHECKPOINT_OPS = {"Save": "save", "Load": "load"}


def enabled() -> bool:
    """Whether this process records (its ``/metrics`` endpoint is serving)."""
    return _endpoint["server"] is not None


def record_request(op: str, table: str, code: str, seconds: float, num_keys: int = 0) -> None:
    """One handled RPC (:meth:`RequestCollector.record`; a successful Save/Load also times the
    checkpoint)."""
    REQUEST_STATS.record(op, table, code, seconds, num_keys)
    ck = _CHECKPOINT_OPS.get(op)
    if ck is not None and code == "OK":
        CHECKPOINT_SECONDS.labels(op=ck).observe(seconds)
