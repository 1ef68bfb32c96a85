"""The extractor of ``bench/bench_ps_files.py``: per variant of ours (``fleet.train_from_dataset``,
the guide's loop) and per epoch, examples/s and AUC against PaddlePaddle 2.6.2's
``train_from_dataset`` (the peer is None when the Paddle column was skipped). Nothing here
imports torch."""

from __future__ import annotations

from typing import Any

from bench.extract import Figure, figure, stats_of

VARIANTS = {"tfd": "train_from_dataset", "loop": "the guide's loop"}


def _epoch_values(runs: list[list[dict[str, Any]]], epoch: int, key: str) -> list[float]:
    """``key`` of epoch ``epoch`` (1-based) of every job that finished."""
    return [run[epoch - 1][key] for run in runs if len(run) >= epoch]


def ps_files(raw: dict[str, Any]) -> list[Figure]:
    """bench_ps_files.py: ``epoch E examples/s, VARIANT vs Paddle 2.6.2`` and ``epoch E AUC,
    VARIANT vs Paddle 2.6.2`` for every variant and epoch that has a finished job."""
    runs = raw.get("runs", {})
    paddle = runs.get("paddle", [])
    out: list[Figure] = []
    for key, unit, what in (("examples_per_s", "ex/s", "examples/s"), ("auc", "AUC", "AUC")):
        for variant, name in VARIANTS.items():
            for epoch in range(1, int(raw.get("setup", {}).get("epochs", 2)) + 1):
                ours = _epoch_values(runs.get(variant, []), epoch, key)
                if not ours:
                    continue
                peer = _epoch_values(paddle, epoch, key)
                out.append(
                    figure(
                        f"epoch {epoch} {what}, {name} vs Paddle 2.6.2",
                        unit,
                        stats_of(ours),
                        stats_of(peer) if peer else None,
                    )
                )
    return out


__all__ = ["ps_files"]
