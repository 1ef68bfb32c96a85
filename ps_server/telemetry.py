"""The parameter server's Prometheus metrics: definitions, the scrape-time table collector, the
``/metrics`` endpoint of a server process.

Per request (recorded by the servicer, :mod:`ps_server.service`): ``fleet_ps_requests_total``
by op, table and gRPC status code, ``fleet_ps_request_seconds`` by op, sparse keys pulled/pushed.
Per table, read from :meth:`~ps_server.table.Table.stats` only when Prometheus scrapes
(:class:`TableCollector`; nothing on the request path): rows, bytes, admitted / filtered /
evicted keys and non-finite gradients skipped; non-finite gradients *rejected* on arrival
(``nonfinite: reject``) are counted by the servicer and added in. Checkpoint save/load durations.

Labels stay small: ``op`` is an RPC name, ``table`` a table the job created, ``code`` a gRPC
status name. One endpoint per process (:func:`start`): several ``PSServer`` objects in one
process (tests) share it, and their tables are reported together.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from collective.errors import PSError

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 10.0)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)

# -- metric definitions (the naming test scans this module) -----------------------------------
REQUESTS = Counter("fleet_ps_requests", "RPCs handled, by op, table and gRPC status code",
                   ["op", "table", "code"])
REQUEST_SECONDS = Histogram("fleet_ps_request_seconds", "RPC handling time, by op", ["op"],
                            buckets=LATENCY_BUCKETS)
KEYS = Counter("fleet_ps_keys", "Sparse keys pulled / pushed", ["op", "table"])
CHECKPOINT_SECONDS = Histogram("fleet_ps_checkpoint_seconds", "Checkpoint save / load time",
                               ["op"], buckets=CHECKPOINT_BUCKETS)
# Collected at scrape time by TableCollector (names listed for the naming test and docs):
TABLE_ROWS = "fleet_ps_table_rows"
TABLE_BYTES = "fleet_ps_table_bytes"
ENTRY_KEYS = "fleet_ps_entry_keys_total"
NONFINITE = "fleet_ps_nonfinite_gradients_total"
COLLECTED = (TABLE_ROWS, TABLE_BYTES, ENTRY_KEYS, NONFINITE)


class TableCollector(Collector):
    """Table gauges and counters read from the live servers' tables at scrape time."""

    def __init__(self) -> None:
        self._states: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def add(self, state: Any) -> None:
        """Report the tables of this :class:`~ps_server.service.ServerState` (weakly held)."""
        with self._lock:
            self._states[id(state)] = state

    def collect(self) -> Iterator[Any]:
        rows = GaugeMetricFamily(TABLE_ROWS, "Rows (sparse) or values (dense) held", labels=["table"])
        size = GaugeMetricFamily(TABLE_BYTES, "Memory held by the table", labels=["table"])
        entry = CounterMetricFamily(ENTRY_KEYS.removesuffix("_total"),
                                    "Keys admitted (rows created), filtered by the entry policy, "
                                    "evicted (capacity or shrink)", labels=["table", "result"])
        bad = CounterMetricFamily(NONFINITE.removesuffix("_total"),
                                  "NaN/inf gradient contributions rejected or skipped",
                                  labels=["table"])
        totals: dict[str, dict[str, float]] = {}
        with self._lock:
            states = list(self._states.values())
        for state in states:
            with state.counter_lock:
                rejected = dict(state.nonfinite_rejected)
            for name, table in list(state.tables.items()):
                st = table.stats()
                t = totals.setdefault(name, dict.fromkeys(
                    ("rows", "bytes", "admitted", "filtered", "evicted", "nonfinite"), 0.0))
                t["sparse"] = float(st.get("kind") == "sparse")
                t["rows"] += st.get("num_rows", st.get("num_values", 0))
                t["bytes"] += st.get("memory_bytes", 0)
                t["admitted"] += st.get("rows_created", 0)
                t["filtered"] += st.get("pushes_filtered", 0)
                t["evicted"] += st.get("rows_evicted", 0) + st.get("rows_shrunk", 0)
                t["nonfinite"] += st.get("nonfinite_skipped", 0) + rejected.get(name, 0)
        for name in sorted(totals):
            t = totals[name]
            rows.add_metric([name], t["rows"])
            size.add_metric([name], t["bytes"])
            if t["sparse"]:
                for result in ("admitted", "filtered", "evicted"):
                    entry.add_metric([name, result], t[result])
            bad.add_metric([name], t["nonfinite"])
        yield from (rows, size, entry, bad)

    def describe(self) -> Iterator[Any]:
        return iter(())


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
                server, _thread = start_http_server(port, addr=host)
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
            server.shutdown()
            server.server_close()
        _endpoint.update(server=None, port=0)


__all__ = [
    "CHECKPOINT_SECONDS",
    "COLLECTED",
    "KEYS",
    "REQUESTS",
    "REQUEST_SECONDS",
    "TABLES",
    "TableCollector",
    "enabled",
    "record_request",
    "start",
    "stop",
]


# -- the servicer's hook -----------------------------------------------------------------------
_children: dict[tuple[str, str, str], Any] = {}
_latency: dict[str, Any] = {}
_keys: dict[tuple[str, str], Any] = {}
_CHECKPOINT_OPS = {"Save": "save", "Load": "load"}


def enabled() -> bool:
    """Whether this process records (its ``/metrics`` endpoint is serving)."""
    return _endpoint["server"] is not None


def record_request(op: str, table: str, code: str, seconds: float, num_keys: int = 0) -> None:
    """One handled RPC (children cached: no label parsing on the request path)."""
    child = _children.get((op, table, code))
    if child is None:
        child = _children.setdefault((op, table, code), REQUESTS.labels(op=op, table=table, code=code))
    child.inc()
    hist = _latency.get(op)
    if hist is None:
        hist = _latency.setdefault(op, REQUEST_SECONDS.labels(op=op))
    hist.observe(seconds)
    if num_keys:
        kop = "pull" if op == "PullSparse" else "push"
        keys = _keys.get((kop, table))
        if keys is None:
            keys = _keys.setdefault((kop, table), KEYS.labels(op=kop, table=table))
        keys.inc(num_keys)
    ck = _CHECKPOINT_OPS.get(op)
    if ck is not None and code == "OK":
        CHECKPOINT_SECONDS.labels(op=ck).observe(seconds)
