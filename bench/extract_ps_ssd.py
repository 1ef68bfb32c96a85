"""The extractor of ``bench/bench_ps_ssd.py``: :func:`~bench.extract.report_rows` with each
row's own unit (``row_units`` in the script's JSON: keys/s, bytes per row and rows/s share one
report). Nothing here imports torch."""

from __future__ import annotations

from typing import Any

from bench.extract import Figure, report_rows


def ps_ssd(raw: dict[str, Any]) -> list[Figure]:
    """bench_ps_ssd.py: its rows, each in the unit ``row_units`` gives it."""
    out = report_rows(raw)
    for f, unit in zip(out, raw.get("row_units", []), strict=False):
        f["unit"] = unit
    return out


__all__ = ["ps_ssd"]
