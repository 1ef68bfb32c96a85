"""Graph tables in the servers' metrics and the dashboard's table panel: a real in-process
server with a graph table and its ``/metrics`` endpoint; nodes, edges, sampling requests and
their latency per graph table are scraped, summarised (launcher.dashboard.scrape) and shown by
the dashboard's ``/api/state`` tables next to the sparse ones."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from test_dashboard import get, proc, wait_for, write_state

from launcher.dashboard import DashboardConfig, start_dashboard
from launcher.dashboard.scrape import parse_samples, server_stats
from ps_server import PSClient, PSServer, telemetry
from ps_server.config import GraphTableConfig
from ps_server.graph_client import GraphClient

CFG = GraphTableConfig(
    "obs_graph", edge_types=["follows"], features={"node": {"x": ("float32", 2)}}
)


@pytest.mark.timeout(60)
def test_graph_tables_in_metrics_and_dashboard(tmp_path: Path) -> None:
    started = not telemetry.enabled()
    port = telemetry.start(0)
    address = f"127.0.0.1:{port}"
    server = PSServer(grace_s=1.0, metrics_port=0)
    server.start()
    client = GraphClient([server.endpoint], timeout_s=20)
    ps = PSClient([server.endpoint])
    stop = threading.Event()
    dash = None
    try:
        client.create_graph_table(CFG)
        src = np.arange(100, dtype=np.int64)
        client.add_edges("obs_graph", np.repeat(src, 3), np.tile([1, 2, 3], 100), "follows")
        client.add_nodes("obs_graph", src[:40], features={"x": np.ones((40, 2), np.float32)})
        ps.create_table("obs_emb", 4)
        ps.pull_sparse("obs_emb", np.arange(10, dtype=np.int64))
        for _ in range(5):
            client.sample_neighbors("obs_graph", src[:50], 2, "follows")

        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            s = server_stats(parse_samples(r.read().decode()))
        g = s.tables["obs_graph"]
        assert (g.kind, g.nodes, g.edges) == ("graph", 100, 300)
        assert g.samples == 5 and g.sample_seconds > 0
        assert g.requests >= 7  # 2 adds, 5 samples (a create names no table yet)
        assert s.tables["obs_emb"].kind == "" and s.tables["obs_emb"].rows == 10

        write_state(tmp_path, [proc("server", 0, address, None)])
        dash = start_dashboard(
            DashboardConfig(log_dir=str(tmp_path), port=0, poll_interval_s=0.2, rate_window_s=1.0)
        )

        def sample() -> None:
            while not stop.wait(0.05):
                client.sample_neighbors("obs_graph", src[:50], 2, "follows")

        t = threading.Thread(target=sample, daemon=True)
        t.start()

        def graph_row() -> dict | None:
            code, body = get(dash.url + "api/state")
            rows = {r["table"]: r for r in json.loads(body)["tables"]} if code == 200 else {}
            row = rows.get("obs_graph")
            return row if row and row["qps"] and row["sample_ms"] else None

        row = wait_for(graph_row, 20, "the graph table's row")
        assert row["kind"] == "graph" and row["nodes"] == 100 and row["edges"] == 300
        assert row["samples"] > 5 and 0 < row["sample_ms"] < 5000 and row["servers"] == 1
        code, body = get(dash.url + "api/state")
        emb = {r["table"]: r for r in json.loads(body)["tables"]}["obs_emb"]
        assert emb["kind"] == "" and emb["nodes"] is None and emb["sample_ms"] is None
    finally:
        stop.set()
        if dash is not None:
            dash.close()
        ps.close()
        client.close()
        server.stop()
        if started:
            telemetry.stop()
