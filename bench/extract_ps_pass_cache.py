"""``bench/bench_ps_pass_cache.py``'s entry (:data:`BENCHMARK`, listed in
:mod:`bench.catalog_ps`) and extractor: its two examples/s rows, the test AUC of the pass cache
against the async RPC path, and the sparse RPCs of a pass. Nothing here imports torch."""

from __future__ import annotations

from typing import Any

from bench.extract import Figure, as_stats, figure, report_rows
from bench.spec import Benchmark, ge, le
from bench.spec import claim as _c


def ps_pass_cache(raw: dict[str, Any]) -> list[Figure]:
    """bench_ps_pass_cache.py: examples/s rows, AUC (pass cache vs async, 1 and 2 trainers),
    RPCs per pass."""
    out = report_rows(raw)
    for label, kind, suffix in (
        ("test AUC, pass cache vs async", "pass", ""),
        ("test AUC with 2 trainers, pass cache vs async", "pass", "_2_trainers"),
        ("test AUC, pass cache (dense GEO) vs async", "passgeo", ""),
        ("test AUC with 2 trainers, pass cache (dense GEO) vs async", "passgeo", "_2_trainers"),
    ):
        if f"auc_{kind}{suffix}" in raw:
            ours = as_stats(raw[f"auc_{kind}{suffix}"])
            peer = as_stats(raw[f"auc_async{suffix}"])
            out.append(figure(label, "AUC", ours, peer))
    if "sparse_rpcs_per_pass" in raw:
        out.append(figure("sparse RPCs per pass", "RPCs", as_stats(raw["sparse_rpcs_per_pass"])))
    return out


BENCHMARK = Benchmark(
    "ps_pass_cache",
    "ps",
    "CTR training with the pass cache",
    "bench/bench_ps_pass_cache.py",
    ("--reps", "5"),
    None,
    (
        _c(
            "pass_vs_baseline",
            "CTR examples/s, pass cache, the dense part local (GEO k_steps 50; 1 server + 1 "
            "trainer)",
            r"^pass cache \(dense GEO\) examples/s vs baseline",
            "higher",
            "single-process torch (sparse nn.Embedding + sparse Adagrad)",
            ge(1.0),
            needs_full=True,
        ),
        _c(
            "pass_async_dense_vs_baseline",
            "CTR examples/s, pass cache, the dense part through the servers every step (async)",
            "^pass cache examples/s vs baseline",
            "higher",
            "single-process torch (sparse nn.Embedding + sparse Adagrad)",
        ),
        _c(
            "pass_vs_async",
            "CTR examples/s, pass cache vs the async RPC path",
            "vs async$",
            "higher",
            "async PS with prefetch",
        ),
        _c(
            "pass_auc",
            "Test AUC, pass cache vs async",
            "^test AUC, pass cache vs async",
            "higher",
            "async PS",
            le(0.003, "absdiff"),
            goal_text="within 0.003",
        ),
        _c(
            "pass_auc_2",
            "Test AUC with 2 trainers, pass cache vs async",
            "^test AUC with 2 trainers, pass cache vs async",
            "higher",
            "async PS, 2 trainers",
            le(0.005, "absdiff"),
            goal_text="within 0.005",
        ),
        _c(
            "pass_geo_auc",
            "Test AUC, pass cache (dense GEO) vs async",
            r"^test AUC, pass cache \(dense GEO\)",
            "higher",
            "async PS",
            le(0.003, "absdiff"),
            goal_text="within 0.003",
        ),
        _c(
            "pass_geo_auc_2",
            "Test AUC with 2 trainers, pass cache (dense GEO) vs async",
            r"^test AUC with 2 trainers, pass cache \(dense GEO\)",
            "higher",
            "async PS, 2 trainers",
            le(0.005, "absdiff"),
            goal_text="within 0.005",
        ),
        _c(
            "pass_rpcs",
            "Sparse RPCs per pass (2 tables)",
            "^sparse RPCs",
            "lower",
            "",
            le(4, "ours"),
            goal_text="≤ 2 per table",
        ),
    ),
    extract=ps_pass_cache,
    not_quick="thirty-five PS and single-process jobs, about 5 minutes on a quiet 2-core machine",
)


def ps_pass_cache_gpu(raw: dict[str, Any]) -> list[Figure]:
    """bench_ps_pass_cache.py --gpu: its rows, each in the unit ``row_units`` gives it."""
    out = report_rows(raw)
    for f, unit in zip(out, raw.get("row_units", []), strict=False):
        f["unit"] = unit
    return out


GPU_BENCHMARK = Benchmark(
    "ps_pass_cache_gpu",
    "ps",
    "CTR training on a GPU trainer: the pass cache vs pulling per step",
    "bench/bench_ps_pass_cache.py",
    ("--reps", "5", "--gpu"),
    ("--reps", "5", "--gpu", "--train", "40000", "--test", "5000"),
    (
        _c(
            "gpu_pass_vs_per_step",
            "GPU trainer examples/s, pass cache vs per-step pulls",
            "^GPU trainer examples/s",
            "higher",
            "the same GPU trainer pulling per step (async, prefetched)",
            ge(3.0),
            goal_text="≥ 3x",
        ),
        _c(
            "gpu_pass_auc",
            "GPU trainer test AUC, pass cache vs per-step pulls",
            "^GPU trainer test AUC",
            "higher",
            "per-step pulls",
            le(0.003, "absdiff"),
            goal_text="within 0.003",
        ),
    ),
    extract=ps_pass_cache_gpu,
    requires=("cuda",),
)


__all__ = ["BENCHMARK", "GPU_BENCHMARK", "ps_pass_cache", "ps_pass_cache_gpu"]
