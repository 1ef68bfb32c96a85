"""fleetrun's collective layer: env contract, process groups, communication API, topology.

The env contract is :mod:`collective.env` (its parser and a collective job's layout), with
:mod:`collective.env_base` (the variable names and enums) and :mod:`collective.env_ps` (a PS
job's layout) behind it; ``collective.env`` re-exports both.

``import collective as dist`` gives a paddle.distributed-style API over torch.distributed::

    dist.init_parallel_env()
    t = torch.ones(4)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)

Names are resolved lazily so that ``collective.env`` (used by the launcher at CLI start) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_LAZY = {
    "init_parallel_env": "collective.group",
    "is_initialized": "collective.group",
    "destroy_process_group": "collective.group",
    "get_rank": "collective.group",
    "get_world_size": "collective.group",
    "get_backend": "collective.group",
    "new_group": "collective.group",
    "ReduceOp": "collective.comm",
    "broadcast": "collective.comm",
    "all_reduce": "collective.comm",
    "reduce": "collective.comm",
    "all_gather": "collective.comm",
    "all_gather_object": "collective.comm",
    "scatter": "collective.comm",
    "barrier": "collective.comm",
    "send": "collective.comm",
    "recv": "collective.comm",
    "isend": "collective.comm",
    "irecv": "collective.comm",
    "wait": "collective.comm",
    "spawn": "collective.spawn",
    "WorkerEnv": "collective.env",
    "read_worker_env": "collective.env",
    "record": "collective.record",
    "shutdown": "collective.clean_exit",
    "register_shutdown": "collective.clean_exit",
    "unregister_shutdown": "collective.clean_exit",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'collective' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
