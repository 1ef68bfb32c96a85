"""From a benchmark script's own JSON to the figures of a result file.

A *figure* is one measured quantity with its peer (or limit)::

    {"label": str, "unit": str, "ours": STATS, "peer": STATS | None, "ratio": float | None}

where ``STATS`` is ``{"median", "min", "max", "n"}`` and ``ratio`` is ours / peer of the medians.
Most scripts write :func:`common.report`'s format (``rows``); the others get an extractor here.
Nothing in this module imports torch or the benchmark scripts.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

Figure = dict[str, Any]
Extractor = Callable[[dict[str, Any]], list[Figure]]


def stats_of(values: Sequence[float]) -> dict[str, float]:
    """median / min / max / n of ``values``."""
    values = [float(v) for v in values]
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def single(value: float) -> dict[str, float]:
    """A quantity measured once (a count, a byte size, a ratio computed by the script)."""
    return {"median": float(value), "min": float(value), "max": float(value), "n": 1}


def as_stats(d: dict[str, Any] | None) -> dict[str, float] | None:
    """A script's ``{median, min, max[, n]}`` dict in the common form (n = 0 when unknown)."""
    if not d:
        return None
    return {
        "median": float(d["median"]),
        "min": float(d.get("min", d["median"])),
        "max": float(d.get("max", d["median"])),
        "n": int(d.get("n", 0)),
    }


def figure(
    label: str, unit: str, ours: dict[str, float] | None, peer: dict[str, float] | None = None
) -> Figure:
    """One figure; the ratio is ours / peer of the medians (None without a peer)."""
    ratio = None
    if ours is not None and peer is not None and peer["median"]:
        ratio = ours["median"] / peer["median"]
        if math.isnan(ratio):
            ratio = None
    return {"label": label, "unit": unit, "ours": ours, "peer": peer, "ratio": ratio}


def report_rows(raw: dict[str, Any]) -> list[Figure]:
    """The rows of :func:`common.report`'s JSON (a row whose label says ``(MiB)`` is in MiB)."""
    unit = raw.get("unit", "s")
    return [
        figure(
            r["label"],
            "MiB" if "(MiB)" in r["label"] else unit,
            as_stats(r["ours"]),
            as_stats(r["peer"]),
        )
        for r in raw.get("rows", [])
    ]


def rows_plus(*more: Extractor) -> Extractor:
    """:func:`report_rows` followed by the figures of ``more`` (from the same JSON)."""

    def extract(raw: dict[str, Any]) -> list[Figure]:
        out = report_rows(raw)
        for fn in more:
            out += fn(raw)
        return out

    return extract


def allreduce(raw: dict[str, Any]) -> list[Figure]:
    """bench_allreduce.py: bus bandwidth per size, ours vs torch."""
    out = []
    for mib, r in raw.get("results", {}).items():
        bw = r["busbw_gbs"]
        n = r.get("reps", 0)
        out.append(
            figure(
                f"bus bandwidth, {mib} MiB",
                "GB/s",
                as_stats({**bw["ours"], "n": n}),
                as_stats({**bw["torch"], "n": n}),
            )
        )
    return out


def tp_recompute(raw: dict[str, Any]) -> list[Figure]:
    """bench_tp.py extras: saved-tensor bytes and step time with recompute vs without."""
    out = []
    mem = raw.get("recompute_bytes")
    if mem:
        out.append(
            figure(
                "recompute: saved-tensor bytes",
                "MiB",
                single(mem["recompute"] / 2**20),
                single(mem["plain"] / 2**20),
            )
        )
    times = raw.get("recompute_times")
    if times:
        out.append(
            figure(
                "recompute: step time",
                "s",
                stats_of(times["recompute"]),
                stats_of(times["plain"]),
            )
        )
    return out


def pipeline_extras(raw: dict[str, Any]) -> list[Figure]:
    """bench_pipeline.py extras: activation memory growth with m, and the bubble."""
    out = []
    mem = raw.get("memory", {})
    for schedule in ("1F1B", "FThenB"):
        few, many = mem.get(f"{schedule}/4"), mem.get(f"{schedule}/16")
        if few and many:
            growth = max(b / a for a, b in zip(few, many))
            out.append(
                figure(
                    f"{schedule} peak saved activations, 16 vs 4 micro-batches (worst stage)",
                    "x",
                    single(growth),
                )
            )
    for m, b in sorted(raw.get("bubble", {}).items(), key=lambda kv: int(kv[0])):
        out.append(
            figure(f"bubble at m = {m}", "share", single(b["measured"]), single(b["theory"]))
        )
    return out


def sharding_state(raw: dict[str, Any]) -> list[Figure]:
    """bench_sharding.py extras: optimizer-state bytes per rank vs unsharded."""
    sb = raw.get("state_bytes")
    if not sb:
        return []
    full = single(sb["ddp"] / 2**20)
    return [
        figure(f"optimizer-state bytes per rank, {impl}", "MiB", single(sb[impl] / 2**20), full)
        for impl in ("fleet-s1", "fleet-s2", "zero", "fsdp2-op")
        if impl in sb
    ]


def dp_comm_extras(raw: dict[str, Any]) -> list[Figure]:
    """bench_dp_comm.py extras: bytes, all-reduce counts and the example's losses."""
    out = []
    if "fp16_bytes_ratio" in raw:
        out.append(
            figure("fp16_allreduce bytes per step vs float32", "x", single(raw["fp16_bytes_ratio"]))
        )
    if "dgc_bytes_ratio" in raw:
        out.append(figure("dgc bytes per step vs dense", "x", single(raw["dgc_bytes_ratio"])))
    ls = raw.get("localsgd")
    if ls:
        out.append(
            figure(
                "localsgd k=4: share of steps with an all-reduce",
                "share",
                single(ls["steps_communicating"]),
            )
        )
    ex = raw.get("example_final_loss")
    if ex:
        out.append(
            figure("dgc: final loss vs dense", "loss", single(ex["dgc"]), single(ex["dense"]))
        )
        out.append(
            figure(
                "fp16_allreduce: final loss vs float32",
                "loss",
                single(ex["fp16_allreduce"]),
                single(ex["dense"]),
            )
        )
    ad = raw.get("adaptive_localsgd")
    if ad and ad.get("steps_to_within_2pct") is not None:
        out.append(
            figure(
                "adaptive_localsgd: steps to within 2 % of the dense final loss",
                "steps",
                single(ad["steps_to_within_2pct"]),
                single(ad["dense_steps"]),
            )
        )
    return out


def ctr_auc(raw: dict[str, Any]) -> list[Figure]:
    """bench_ctr.py extras: test AUC of both sides."""
    if "auc_ps" not in raw:
        return []
    return [figure("test AUC", "AUC", as_stats(raw["auc_ps"]), as_stats(raw["auc_baseline"]))]


def elastic(raw: dict[str, Any]) -> list[Figure]:
    """bench_elastic.py: node loss and join per variant, each fleetrun variant vs torchrun c10d."""
    rows = {r["variant"]: r for r in raw.get("rows", [])}
    peer = rows.get("torchrun-c10d", {})
    out = []
    for variant in ("fleetrun-c10d", "fleetrun-etcd", "fleetrun-c10d-warm"):
        r = rows.get(variant)
        if not r:
            continue
        for what in ("loss", "join"):
            out.append(
                figure(
                    f"{what}, {variant} vs torchrun-c10d",
                    "s",
                    as_stats(r.get(what)),
                    as_stats(peer.get(what)),
                )
            )
    return out


def ps_memory(raw: dict[str, Any]) -> list[Figure]:
    """bench_ps_memory.py: bytes per row vs the payload, hash index vs dict index throughput."""
    out = []
    mem = raw.get("memory", {}).get("hash (chosen)")
    if mem:
        out.append(
            figure(
                "bytes per row vs the payload",
                "B/row",
                single(mem["accounted_B"]),
                single(mem["payload_B"]),
            )
        )
    thr = raw.get("throughput", {})
    for op in ("pull", "push"):
        ours, peer = thr.get("hash (chosen)", {}).get(op), thr.get("dict", {}).get(op)
        if ours and peer:
            scale = {k: (v / 1e6 if k != "n" else v) for k, v in ours.items()}
            pscale = {k: (v / 1e6 if k != "n" else v) for k, v in peer.items()}
            out.append(
                figure(
                    f"sparse {op} rows/s, hash index vs dict index",
                    "M rows/s",
                    as_stats(scale),
                    as_stats(pscale),
                )
            )
    return out


def ps_security(raw: dict[str, Any]) -> list[Figure]:
    """bench_ps_security.py: its rows (the 64k-key row is in M keys/s, the others in calls/s)
    and whether the tables stayed unchanged with the server serving."""
    out = report_rows(raw)
    for f in out:
        f["unit"] = "M keys/s" if "M keys/s" in f["label"] else "calls/s"
    return out + security_extras(raw)


def security_extras(raw: dict[str, Any]) -> list[Figure]:
    """bench_ps_security.py extras: the tables unchanged and the server still serving."""
    if "tables_identical" not in raw:
        return []
    ok = bool(raw["tables_identical"]) and bool(raw.get("server_stayed_up"))
    return [
        figure("tables unchanged and the server serving after every attack", "bool", single(ok))
    ]


def _recovery(result: dict[str, Any] | None, key: str) -> dict[str, float] | None:
    return as_stats((result or {}).get(key)) if (result or {}).get(key) else None


def ps_chaos(raw: dict[str, Any]) -> list[Figure]:
    """bench_ps_chaos.py: recovery times, the other trainer's gap, AUC, orphans."""
    res = raw.get("results", {})
    base = res.get("undisturbed", {})
    out = []
    for run, what in (("server", "servers"), ("trainer", "trainers")):
        r = res.get(run)
        if not r:
            continue
        out.append(figure(f"{what} killed: recovery per kill", "s", _recovery(r, "recovery_s")))
        if run == "trainer":
            out.append(
                figure(
                    "trainers killed: the other trainer's longest gap per kill",
                    "s",
                    _recovery(r, "other_trainer_gap_s"),
                )
            )
        if r.get("test_auc") is not None and base.get("test_auc") is not None:
            out.append(
                figure(
                    f"{what} killed: test AUC vs the undisturbed run",
                    "AUC",
                    single(r["test_auc"]),
                    single(base["test_auc"]),
                )
            )
    if res:
        orphans = sum(len(r.get("orphans") or []) for r in res.values())
        out.append(figure("orphan processes after every run", "processes", single(orphans)))
    return out


def ps_inplace(raw: dict[str, Any]) -> list[Figure]:
    """bench_ps_inplace.py: recovery per server kill, Ray vs the local scheduler."""
    res = raw.get("results", {})
    if "ray" not in res:
        return []
    return [
        figure(
            "server restarted alone in place: recovery per kill, Ray vs local",
            "s",
            _recovery(res["ray"], "recovery_s"),
            _recovery(res.get("local"), "recovery_s"),
        )
    ]


def _passes(runs: Iterable[Any]) -> list[dict[str, Any]]:
    return [p for run in runs for p in run]


def streaming_checkpoint(raw: dict[str, Any]) -> list[Figure]:
    """bench_streaming_checkpoint.py: per-pass rates and job wall time, with vs without cuts."""
    runs = raw.get("runs", {})
    if not runs.get("with") or not runs.get("without"):
        return []
    w = _passes(records for records, _ in runs["with"])
    wo = _passes(records for records, _ in runs["without"])
    out = [
        figure(
            "training examples/s, with vs without checkpoints",
            "ex/s",
            stats_of([p["train_examples_per_s"] for p in w]),
            stats_of([p["train_examples_per_s"] for p in wo]),
        ),
        figure(
            "whole-pass examples/s, with vs without checkpoints",
            "ex/s",
            stats_of([p["pass_examples_per_s"] for p in w]),
            stats_of([p["pass_examples_per_s"] for p in wo]),
        ),
        figure(
            "job wall time, with vs without checkpoints",
            "s",
            stats_of([wall for _, wall in runs["with"]]),
            stats_of([wall for _, wall in runs["without"]]),
        ),
    ]
    return out


def ps_paddle(raw: dict[str, Any]) -> list[Figure]:
    """bench_ps_paddle.py: training and whole-pass examples/s and last-pass AUC vs Paddle."""
    ours, paddle = _passes(raw.get("ours", [])), _passes(raw.get("paddle", []))
    if not ours or not paddle:
        return []
    out = [
        figure(
            f"{label} examples/s vs Paddle 2.6.2",
            "ex/s",
            stats_of([p[key] for p in ours]),
            stats_of([p[key] for p in paddle]),
        )
        for key, label in (
            ("train_examples_per_s", "training"),
            ("pass_examples_per_s", "whole-pass"),
        )
    ]
    last_ours = [run[-1]["progressive_auc"] for run in raw["ours"] if run]
    last_paddle = [run[-1]["progressive_auc"] for run in raw["paddle"] if run]
    out.append(
        figure(
            "progressive AUC of the stream's last pass vs Paddle 2.6.2",
            "AUC",
            stats_of(last_ours),
            stats_of(last_paddle),
        )
    )
    return out


def data_load(raw: dict[str, Any]) -> list[Figure]:
    """bench_data_load.py: load rate vs Paddle and plain Python, memory vs the payload."""
    st = raw.get("stats_m_lines_per_s", {})
    out = []
    for peer, label in (("paddle", "Paddle's InMemoryDataset"), ("python", "plain Python")):
        if "fleet" in st and peer in st:
            out.append(
                figure(
                    f"load lines/s vs {label}",
                    "M lines/s",
                    as_stats(st["fleet"]),
                    as_stats(st[peer]),
                )
            )
    mem = raw.get("memory", {}).get("fleet")
    payload = raw.get("payload_bytes_per_example")
    if mem and payload:
        out.append(
            figure(
                "RSS growth per example vs the payload",
                "B",
                single(mem["rss_bytes_per_example"]),
                single(payload),
            )
        )
    return out
