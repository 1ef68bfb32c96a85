"""``fleet.ps``: the trainer and server side of parameter-server training.

Owns the PS runtime (roles, starting servers, the trainer's client:
:mod:`fleet.ps.runtime`, behind ``fleet.is_server`` / ``init_worker`` / ``save_persistables`` ...),
the communicators of the four modes (sync, async, half-async, GEO: :mod:`fleet.ps.communicator`),
:class:`~fleet.ps.embedding.DistributedEmbedding` and the dense-parameter optimizer
(:mod:`fleet.ps.optimizer`), the per-pass trainer cache (:mod:`fleet.ps.pass_cache`: a pass's
keys from its dataset in :mod:`fleet.ps.pass_keys`, its rows in :mod:`fleet.ps.pass_store`, the
rules' torch form in :mod:`fleet.ps.pass_rules`, ``fleet.begin_pass`` / ``end_pass`` in
:mod:`fleet.ps.pass_api`), job checkpoints (:mod:`fleet.ps.recovery`), the automatic
checkpoints and resume of a fleetrun job (:mod:`fleet.ps.auto_checkpoint`) and serving
(:mod:`fleet.ps.serving`). Imports :mod:`fleet.base`, :mod:`fleet.strategy`,
:mod:`fleet.telemetry`, :mod:`collective` and :mod:`ps_server`; never the collective wrappers.
``ps_server``'s gRPC side is imported only when a server or client starts, so a collective job
that asks ``in_ps_mode()`` never loads gRPC.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "checkpoint": "fleet.ps.recovery",
    "load_latest": "fleet.ps.recovery",
    "export_serving": "fleet.ps.serving",
    "ServingModel": "fleet.ps.serving",
}
"""Job checkpoints (:mod:`fleet.ps.recovery`) and serving (:mod:`fleet.ps.serving`), imported
on first use: ``fleet.ps.checkpoint(...)``, ``fleet.ps.load_latest(...)``,
``fleet.ps.export_serving(...)``, ``fleet.ps.ServingModel(...)``."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fleet.ps' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["ServingModel", "checkpoint", "export_serving", "load_latest"]
