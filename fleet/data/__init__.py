"""``fleet.data``: datasets for parameter-server and collective training from files.

Owns Paddle's dataset API on torch: slots, MultiSlot text parsing, ``InMemoryDataset`` /
``QueueDataset``, the data generators, global shuffle. May import :mod:`fleet.telemetry` and
:mod:`collective`; nothing else of fleet (the facade exposes its public names).

::

    import fleet
    from fleet.data import InMemoryDataset, Slot

    slots = [Slot("click", dense=True), *(Slot(f"C{i}") for i in range(26)),
             Slot("dense", dtype="float32", dense=True, dim=13)]
    ds = InMemoryDataset()
    ds.init(batch_size=512, thread_num=2, use_var=slots, pipe_command="cat")
    ds.set_filelist(fleet.util.get_file_shard(files))
    ds.load_into_memory()
    ds.global_shuffle(fleet)
    for batch in ds:        # {"click": int64 [B, 1], "C0": SparseBatch, ..., "dense": [B, 13]}
        ...

Modules: :mod:`~fleet.data.slots` (Slot), :mod:`~fleet.data.parser` (+ ``_parser.c``: MultiSlot
text -> columns), :mod:`~fleet.data.sources` (files, globs, fsspec, gzip, pipe_command),
:mod:`~fleet.data.loader` (reader and parser threads), :mod:`~fleet.data.columns` (memory
layout), :mod:`~fleet.data.batch` (Batch, SparseBatch), :mod:`~fleet.data.dataset`
(DatasetBase, QueueDataset), :mod:`~fleet.data.in_memory` (InMemoryDataset),
:mod:`~fleet.data.shuffle` (global shuffle), :mod:`~fleet.data.generator` (Paddle's data
generators), :mod:`~fleet.data.metrics`, :mod:`~fleet.data.tree_index` (TreeIndex: the item tree
of TDM retrieval) and :mod:`~fleet.data.tree_sampler` (LayerWiseSampler, beam_search).

Names are resolved lazily: a reader script (``import fleet.data as dg``, run as a
``pipe_command`` once per file) loads only the generator module, not torch or numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Slot": "fleet.data.slots",
    "SlotDtype": "fleet.data.slots",
    "Batch": "fleet.data.batch",
    "SparseBatch": "fleet.data.batch",
    "DatasetBase": "fleet.data.dataset",
    "QueueDataset": "fleet.data.dataset",
    "OnError": "fleet.data.dataset",
    "InMemoryDataset": "fleet.data.in_memory",
    "DataGenerator": "fleet.data.generator",
    "MultiSlotDataGenerator": "fleet.data.generator",
    "MultiSlotStringDataGenerator": "fleet.data.generator",
    "TreeIndex": "fleet.data.tree_index",
    "UnknownItemError": "fleet.data.tree_index",
    "LayerWiseSampler": "fleet.data.tree_sampler",
    "LayerSample": "fleet.data.tree_sampler",
    "BeamSearchResult": "fleet.data.tree_sampler",
    "beam_search": "fleet.data.tree_sampler",
    "DataSourceError": "fleet.data.errors",
    "DatasetFormatError": "fleet.data.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fleet.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = list(_LAZY)
