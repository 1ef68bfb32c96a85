"""A pass's keys, read from its dataset (:mod:`fleet.ps.pass_cache` builds the pass from them).

:func:`collect_keys` takes the loaded columns of an InMemoryDataset (or the sparse slots of any
iterable of batches), vectorised: per table the sorted unique keys of its slots, each key's show
count (occurrences) and click count (occurrences in examples whose label is positive). Tables
reading the same slots share one pass over the data and one sort. A streamed dataset is refused:
reading it would use it up before the pass trains on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from collective.errors import ConfigError

LABEL_SLOTS = ("click", "label")
"""Dense slots taken as the click label when ``begin_pass`` is given none."""


def _sparse_columns(dataset: Any, label: str | None) -> Iterable[tuple[str, np.ndarray, Any]]:
    """(slot, values int64, positive label per value or None) of every sparse int64 slot."""
    chunks = getattr(dataset, "_chunks", None)
    if chunks is not None:  # an InMemoryDataset: its loaded columns
        for cols in chunks:
            names = [s.name for s in cols.slots]
            labels = _labels(names, cols.data, label)
            for slot, col in zip(cols.slots, cols.data):
                if slot.dense or np.dtype(slot.dtype.numpy) != np.int64:  # type: ignore[union-attr]
                    continue
                values, offsets = col
                vals = values[offsets[0] : offsets[-1]]
                per_value = None
                if labels is not None:
                    per_value = np.repeat(labels, np.diff(offsets))
                yield slot.name, vals, per_value
        return
    if hasattr(dataset, "set_filelist"):  # a streamed dataset: reading it would use it up
        raise ConfigError(
            f"a pass is built from a loaded InMemoryDataset; got a {type(dataset).__name__}, "
            "which streams its files: use fleet.InMemoryDataset and load_into_memory()",
            key="pass_cache",
        )
    for batch in dataset:  # any iterable of batches: slot -> tensor or sparse slot
        names = list(batch)
        dense = [batch[n] for n in names]
        labels = _labels(names, [getattr(d, "numpy", lambda: None)() for d in dense], label)
        for name, value in batch.items():
            if not (hasattr(value, "values") and hasattr(value, "offsets")):
                continue
            vals = value.values.detach().cpu().numpy()
            if vals.dtype != np.int64:
                continue
            offsets = value.offsets.cpu().numpy()
            per_value = np.repeat(labels, np.diff(offsets)) if labels is not None else None
            yield name, vals, per_value


def _labels(names: list[str], data: list[Any], label: str | None) -> np.ndarray | None:
    """True for a positive example, from the label slot (None: no label slot)."""
    wanted = [label] if label else [n for n in LABEL_SLOTS if n in names]
    for name in wanted:
        if name in names:
            col = data[names.index(name)]
            if isinstance(col, np.ndarray):
                return col.reshape(col.shape[0], -1)[:, 0] > 0
    return None


def collect_keys(
    dataset: Any, slots_of: Mapping[str, Sequence[str] | None], label: str | None = None
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per table: (sorted unique keys, show, click) of its slots (None: every sparse slot).
    Tables reading the same slots share one pass over the data and one sort."""
    groups: dict[tuple[str, ...] | None, list[str]] = {}
    for table, slots in slots_of.items():
        groups.setdefault(None if slots is None else tuple(sorted(slots)), []).append(table)
    values: dict[Any, list[np.ndarray]] = {g: [] for g in groups}
    positives: dict[Any, list[np.ndarray]] = {g: [] for g in groups}
    for slot, vals, positive in _sparse_columns(dataset, label):
        for group in groups:
            if group is None or slot in group:
                values[group].append(vals)
                if positive is not None:
                    positives[group].append(vals[positive])
    out = {}
    for group, tables in groups.items():
        flat = np.concatenate(values[group]) if values[group] else np.zeros(0, np.int64)
        keys, show = np.unique(flat, return_counts=True)
        click = np.zeros(keys.shape[0], np.int64)
        if positives[group]:
            pos_keys, pos_counts = np.unique(np.concatenate(positives[group]), return_counts=True)
            click[np.searchsorted(keys, pos_keys)] = pos_counts
        for table in tables:
            out[table] = (keys.astype(np.int64, copy=False), show.astype(np.int64), click)
    return out


__all__ = ["LABEL_SLOTS", "collect_keys"]
