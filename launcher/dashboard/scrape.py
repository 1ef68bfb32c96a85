"""Read one process's ``/metrics`` page and boil it down to the numbers the dashboard shows.

Pure functions over Prometheus text (parsed by ``prometheus_client.parser``), plus one small
HTTP fetch. The metric names are the monitoring contract (``fleet_trainer_*``, ``fleet_ps_*``,
``fleet_launcher_*``); a name a process does not export is simply absent from its summary.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

COMM_OPS = ("all_reduce", "ps_pull", "ps_push")
"""The ``op`` label values of ``fleet_trainer_comm_seconds``, in display order."""
PHASES = ("data", "pull_wait", "forward", "backward", "push_optimizer", "other", "compute")
"""The ``phase`` label values of ``fleet_trainer_phase_seconds``, in display order (the
trainer's :data:`fleet.telemetry.PHASES`; the launcher does not import fleet)."""
ENTRY_RESULTS = ("admitted", "filtered", "evicted")
"""The ``result`` label values of ``fleet_ps_entry_keys_total``."""
SAMPLE_OP = "Graph.SampleNeighbors"
"""The ``op`` of a graph table's neighbor-sampling requests (``fleet_ps_graph_request_seconds``)."""
OK_CODES = frozenset({"OK", "ok", "0", ""})
"""``code`` label values of ``fleet_ps_requests_total`` that count as success."""


class ScrapeError(Exception):
    """A target could not be read or parsed (the message says which and why)."""


Samples = dict[str, list[tuple[dict[str, str], float]]]
"""Sample name (``fleet_trainer_steps_total``, ``..._sum``) -> [(labels, value)]."""


def parse_samples(text: str) -> Samples:
    """Every sample of a Prometheus text page, keyed by sample name (``_created`` dropped)."""
    out: Samples = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not s.name.endswith("_created"):
                    out[s.name].append((dict(s.labels), float(s.value)))
    except ValueError as err:  # the parser's only error type for bad text
        raise ScrapeError(f"not Prometheus text: {err}") from None
    return dict(out)


def fetch_metrics(address: str, timeout_s: float) -> str:
    """GET ``http://ADDRESS/metrics`` (ADDRESS is ``host:port``); ScrapeError on any failure."""
    url = f"http://{address}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise ScrapeError(f"{url}: {reason}") from None


def _one(samples: Samples, name: str, **labels: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``labels`` (None when none)."""
    rows = [
        v for lab, v in samples.get(name, ()) if all(lab.get(k) == x for k, x in labels.items())
    ]
    return sum(rows) if rows else None


@dataclass(frozen=True)
class TrainerStats:
    """Cumulative trainer numbers from one scrape (counters and histogram sums/counts)."""

    steps: float | None = None
    samples: float | None = None
    loss: float | None = None
    throughput: float | None = None
    """``fleet_trainer_throughput_samples_per_second`` as the trainer reports it."""
    step_sum: float | None = None
    step_count: float | None = None
    comm_sum: dict[str, float] = field(default_factory=dict)
    """Seconds spent per communication op (cumulative)."""
    phase_sum: dict[str, float] = field(default_factory=dict)
    """Seconds spent per step phase (cumulative; empty when the trainer exports none)."""
    phase_count: float | None = None
    """Steps whose phases were observed (the largest per-phase count)."""
    bubble_ratio: float | None = None
    loss_scale: float | None = None
    amp_skipped: float | None = None


@dataclass(frozen=True)
class TableStats:
    """One PS table on one server, cumulative."""

    rows: float | None = None
    bytes: float | None = None
    requests: float = 0.0
    errors: float = 0.0
    """Requests whose ``code`` is not OK."""
    keys: dict[str, float] = field(default_factory=dict)
    """Keys per op (``pull``/``push``...)."""
    entry: dict[str, float] = field(default_factory=dict)
    """admitted / filtered / evicted keys."""
    kind: str = ""
    """``graph`` for a graph table (from its node / edge gauges); empty otherwise."""
    nodes: float | None = None
    """Graph table: nodes held by the server."""
    edges: float | None = None
    """Graph table: edges held by the server."""
    samples: float = 0.0
    """Graph table: neighbor-sampling requests handled (cumulative)."""
    sample_seconds: float = 0.0
    """Graph table: seconds those requests took (cumulative)."""


@dataclass(frozen=True)
class ServerStats:
    """One PS server: its tables, plus requests that carry no table label."""

    tables: dict[str, TableStats] = field(default_factory=dict)
    requests: float = 0.0


@dataclass(frozen=True)
class LauncherStats:
    """The launcher's own metrics."""

    state: str | None = None
    """The state whose ``fleet_launcher_job_state{state}`` gauge is 1."""
    processes_up: dict[str, float] = field(default_factory=dict)
    restarts: float | None = None
    failures: dict[str, float] = field(default_factory=dict)


def trainer_stats(s: Samples) -> TrainerStats:
    """Summarise a trainer's page."""
    comm = {}
    for op in COMM_OPS:
        v = _one(s, "fleet_trainer_comm_seconds_sum", op=op)
        if v is not None:
            comm[op] = v
    phases, counts = {}, []
    for phase in PHASES:
        v = _one(s, "fleet_trainer_phase_seconds_sum", phase=phase)
        if v is not None:
            phases[phase] = v
            counts.append(_one(s, "fleet_trainer_phase_seconds_count", phase=phase) or 0.0)
    return TrainerStats(
        steps=_one(s, "fleet_trainer_steps_total"),
        samples=_one(s, "fleet_trainer_samples_total"),
        loss=_one(s, "fleet_trainer_loss"),
        throughput=_one(s, "fleet_trainer_throughput_samples_per_second"),
        step_sum=_one(s, "fleet_trainer_step_seconds_sum"),
        step_count=_one(s, "fleet_trainer_step_seconds_count"),
        comm_sum=comm,
        phase_sum=phases,
        phase_count=max(counts) if counts else None,
        bubble_ratio=_one(s, "fleet_trainer_pipeline_bubble_ratio"),
        loss_scale=_one(s, "fleet_trainer_amp_loss_scale"),
        amp_skipped=_one(s, "fleet_trainer_amp_skipped_steps_total"),
    )


def server_stats(s: Samples) -> ServerStats:
    """Summarise a PS server's page (per table)."""
    tables: dict[str, dict] = defaultdict(
        lambda: {"requests": 0.0, "errors": 0.0, "keys": {}, "entry": {}}
    )
    untabled = 0.0
    for lab, v in s.get("fleet_ps_requests_total", ()):
        table = lab.get("table", "")
        if not table:
            untabled += v
            continue
        tables[table]["requests"] += v
        if lab.get("code", "") not in OK_CODES:
            tables[table]["errors"] += v
    for lab, v in s.get("fleet_ps_keys_total", ()):
        keys = tables[lab.get("table", "")]["keys"]
        keys[lab.get("op", "")] = keys.get(lab.get("op", ""), 0.0) + v
    for lab, v in s.get("fleet_ps_entry_keys_total", ()):
        tables[lab.get("table", "")]["entry"][lab.get("result", "")] = v
    for name, key in (("fleet_ps_table_rows", "rows"), ("fleet_ps_table_bytes", "bytes")):
        for lab, v in s.get(name, ()):
            tables[lab.get("table", "")][key] = v
    for name, key in (("fleet_ps_graph_nodes", "nodes"), ("fleet_ps_graph_edges", "edges")):
        for lab, v in s.get(name, ()):
            tables[lab.get("table", "")].update({key: v, "kind": "graph"})
    for name, key in (
        ("fleet_ps_graph_request_seconds_count", "samples"),
        ("fleet_ps_graph_request_seconds_sum", "sample_seconds"),
    ):
        for lab, v in s.get(name, ()):
            if lab.get("op") == SAMPLE_OP:
                tables[lab.get("table", "")][key] = v
    tables.pop("", None)
    return ServerStats(
        {t: TableStats(**d) for t, d in sorted(tables.items())},
        untabled + sum(d["requests"] for d in tables.values()),
    )


def launcher_stats(s: Samples) -> LauncherStats:
    """Summarise the launcher's page."""
    state = next(
        (lab.get("state") for lab, v in s.get("fleet_launcher_job_state", ()) if v >= 1), None
    )
    return LauncherStats(
        state=state,
        processes_up={
            lab.get("role", ""): v for lab, v in s.get("fleet_launcher_processes_up", ())
        },
        restarts=_one(s, "fleet_launcher_restarts_total"),
        failures={lab.get("cause", ""): v for lab, v in s.get("fleet_launcher_failures_total", ())},
    )
