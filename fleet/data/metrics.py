"""Prometheus metrics of :mod:`fleet.data` (prometheus_client's default registry, as
:mod:`fleet.telemetry`: a trainer's ``/metrics`` endpoint serves them with the rest).

Counted at the end of each pass over the files (a load of an ``InMemoryDataset``, an iteration
of a ``QueueDataset``), labelled by ``dataset`` (``inmemory`` | ``queue``).
"""

from __future__ import annotations

from prometheus_client import Counter

DATASET_KINDS = ("inmemory", "queue")

# -- metric definitions -----------------------------------------------------------------------
SKIPPED_LINES = Counter(
    "fleet_data_skipped_lines", "Malformed data lines skipped (on_error='skip')", ["dataset"]
)
EXAMPLES_READ = Counter("fleet_data_examples_read", "Examples parsed from data files", ["dataset"])
for _kind in DATASET_KINDS:  # expose 0 before the first pass
    SKIPPED_LINES.labels(dataset=_kind)
    EXAMPLES_READ.labels(dataset=_kind)


def record_pass(kind: str, examples: int, skipped: int) -> None:
    """Count one pass's examples and skipped lines."""
    if kind not in DATASET_KINDS:
        raise ValueError(f"dataset kind must be one of {DATASET_KINDS}, got {kind!r}")
    EXAMPLES_READ.labels(dataset=kind).inc(examples)
    SKIPPED_LINES.labels(dataset=kind).inc(skipped)


__all__ = ["EXAMPLES_READ", "SKIPPED_LINES", "record_pass"]
