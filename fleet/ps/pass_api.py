"""``fleet.begin_pass`` / ``fleet.end_pass``: the trainer's calls of the pass cache
(:mod:`fleet.ps.pass_cache`, which holds the pass itself and imports nothing of the trainer's
runtime), and the hook ``fleet.train_from_dataset`` opens a pass with."""

from __future__ import annotations

from typing import Any

import torch

from fleet.ps import pass_cache, runtime
from fleet.ps.pass_cache import PassStats


def cached_modules(all_tables: bool = False) -> list[Any]:
    """The trainer's DistributedEmbeddings that a pass caches: ``cache="pass"`` ones, every one
    under ``a_sync_configs.use_ps_gpu`` (or ``all_tables``)."""
    st = runtime._state
    if st is None:
        return []
    modules = [st.tables[name] for name in sorted(st.tables.keys())]
    if all_tables or st.strategy.a_sync_configs.use_ps_gpu:
        return modules
    return [m for m in modules if getattr(m, "cache", None) == "pass"]


def begin_pass(
    dataset: Any,
    *,
    label: str | None = None,
    device: str | torch.device | None = None,
    max_memory_fraction: float | None = None,
    memory_budget_bytes: int | None = None,
) -> None:
    """Build the pass of ``dataset`` (a loaded InMemoryDataset, or any iterable of batches)
    into this trainer's device memory (:mod:`fleet.ps.pass_cache`). Caches the ``cache="pass"``
    DistributedEmbeddings (all of them when none is marked). ``label``: the dense slot whose
    positive values count as clicks (default ``click`` / ``label``). ``device``: default CUDA
    when available. The memory check uses ``memory_budget_bytes``, else
    ``max_memory_fraction`` of the free device memory (CPU: of the available RAM)."""
    modules = cached_modules() or cached_modules(all_tables=True)
    pass_cache.start(
        modules,
        dataset,
        runtime.get_client(),
        runtime.get_communicator(),
        label=label,
        device=device,
        max_memory_fraction=max_memory_fraction,
        memory_budget_bytes=memory_budget_bytes,
    )


def end_pass() -> PassStats:
    """Push the pass's deltas (one push per table) and close it (:mod:`fleet.ps.pass_cache`)."""
    return pass_cache.finish()


def auto_begin(dataset: Any, label: str | None) -> bool:
    """``train_from_dataset``'s hook: open a pass over ``dataset`` when this PS trainer has
    pass-cached embeddings and none is open. Returns whether it opened one."""
    if pass_cache.in_pass() or not runtime.in_ps_mode() or runtime.current_communicator() is None:
        return False
    modules = cached_modules()
    if not modules:
        return False
    pass_cache.start(
        modules, dataset, runtime.get_client(), runtime.get_communicator(), label=label
    )
    return True


__all__ = ["auto_begin", "begin_pass", "cached_modules", "end_pass"]
