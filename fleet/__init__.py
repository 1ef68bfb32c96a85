"""``fleet``: the training-script API of fleetrun (PaddlePaddle Fleet's, on PyTorch).

::

    import fleet
    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy.from_yaml("s.yaml"))
    model = fleet.distributed_model(model)              # torch DDP
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    files = fleet.util.get_file_shard(all_files)        # this trainer's share
    if fleet.is_first_worker(): ...

Names are resolved lazily: ``fleet.DistributedStrategy`` (and its YAML loading) does not import
torch; the first call that needs the process group does.

The facade is the top of fleet's one-way layers (docs/architecture.md; kept by import-linter)::

    fleet (this facade), fleet.streaming (the day/pass loop over train_loop)
      -> fleet.api, fleet.util, fleet.utils, fleet.train_loop, fleet.elastic
      -> fleet.parallelize, fleet.checkpoint, fleet.heter
      -> fleet.meta_parallel | fleet.meta_optimizers | fleet.ps | fleet.data | fleet.metrics
      -> fleet.base
      -> fleet.strategy | fleet.telemetry
      -> collective (and ps_server, from fleet.ps)

Nothing inside fleet imports this facade; names users imported from a module that moved
(``fleet.amp``, ``fleet.embedding``, ...) still import, see :data:`MOVED_MODULES`.
"""

from __future__ import annotations

import importlib
from typing import Any

from collective.moved_modules import install_moved_modules

# public name -> module that defines it; a value ending in "." names a module itself.
_LAZY = {
    "init": "fleet.api",
    "worker_index": "fleet.base.runtime",
    "worker_num": "fleet.base.runtime",
    "is_first_worker": "fleet.base.runtime",
    "local_rank": "fleet.base.runtime",
    "worker_endpoints": "fleet.base.runtime",
    "barrier_worker": "fleet.base.runtime",
    "get_hybrid_communicate_group": "fleet.base.runtime",
    "CommunicateTopology": "fleet.base.topology",
    "distributed_model": "fleet.parallelize.model",
    "distributed_optimizer": "fleet.parallelize.optimizer",
    "DistributedStrategy": "fleet.strategy.distributed_strategy",
    "save_checkpoint": "fleet.checkpoint",
    "load_checkpoint": "fleet.checkpoint",
    "report": "fleet.telemetry",
    "record": "collective.record",
    "shutdown": "collective.clean_exit",
    "is_server": "fleet.ps.runtime",
    "is_worker": "fleet.ps.runtime",
    "is_heter_worker": "fleet.ps.runtime",
    "heter_worker_num": "fleet.ps.runtime",
    "run_heter_worker": "fleet.heter.worker",
    "server_num": "fleet.ps.runtime",
    "server_index": "fleet.ps.runtime",
    "server_endpoints": "fleet.ps.runtime",
    "init_server": "fleet.ps.runtime",
    "run_server": "fleet.ps.runtime",
    "init_worker": "fleet.ps.runtime",
    "stop_worker": "fleet.ps.runtime",
    "save_persistables": "fleet.ps.runtime",
    "shrink": "fleet.ps.runtime",
    "end_day": "fleet.ps.runtime",
    "begin_pass": "fleet.ps.pass_api",
    "end_pass": "fleet.ps.pass_api",
    "DistributedEmbedding": "fleet.ps.embedding",
    "train_from_dataset": "fleet.train_loop",
    "train_days": "fleet.streaming",
    "StreamingTrainer": "fleet.streaming",
    "StreamingConfig": "fleet.streaming",
    "PassResult": "fleet.streaming",
    "load_model": "fleet.streaming",
    "save_cache_model": "fleet.streaming",
    "InMemoryDataset": "fleet.data.in_memory",
    "QueueDataset": "fleet.data.dataset",
    "MultiSlotDataGenerator": "fleet.data.generator",
    "MultiSlotStringDataGenerator": "fleet.data.generator",
    "distributed_scaler": "fleet.meta_optimizers.amp",
    "clip_grad_norm_": "fleet.meta_optimizers.clip",
    "ClipGradByGlobalNorm": "fleet.meta_optimizers.clip",
    "LayerDesc": "fleet.meta_parallel",
    "SharedLayerDesc": "fleet.meta_parallel",
    "PipelineLayer": "fleet.meta_parallel",
    # modules
    "sharding": "fleet.meta_optimizers.sharding.",
    "asp": "fleet.meta_optimizers.asp.",
    "util": "fleet.util.",
    "utils": "fleet.utils.",
    "role_maker": "fleet.base.role_maker.",
    "metrics": "fleet.metrics.",
    "telemetry": "fleet.telemetry.",
    "meta_parallel": "fleet.meta_parallel.",
    "data": "fleet.data.",
    "ps": "fleet.ps.",
    "heter": "fleet.heter.",
    "elastic": "fleet.elastic.",
}

# Module paths from before fleet was grouped into subpackages (fleet.amp, fleet.embedding, ...):
# they import the module at its new home, with a DeprecationWarning (collective.moved_modules).
MOVED_MODULES = {
    "fleet.amp": "fleet.meta_optimizers.amp",
    "fleet.clip": "fleet.meta_optimizers.clip",
    "fleet.data_parallel": "fleet.parallelize.data_parallel",
    "fleet.embedding": "fleet.ps.embedding",
    "fleet.optimizer": "fleet.meta_optimizers.gradient_merge",
    "fleet.optimizer_base": "fleet.meta_optimizers.base",
    "fleet.optimizers": "fleet.meta_optimizers.lars_lamb",
    "fleet.ps_communicator": "fleet.ps.communicator",
    "fleet.ps_optimizer": "fleet.ps.optimizer",
    "fleet.ps_runtime": "fleet.ps.runtime",
    "fleet.recompute": "fleet.meta_parallel.recompute",
    "fleet.role_maker": "fleet.base.role_maker",
    "fleet.sharding": "fleet.meta_optimizers.sharding",
    "fleet.strategy_configs": "fleet.strategy.configs",
    "fleet.strategy_features": "fleet.parallelize.features",
    "fleet.topology": "fleet.base.topology",
}

install_moved_modules("fleet", MOVED_MODULES)

__all__ = [
    "InMemoryDataset",
    "MultiSlotDataGenerator",
    "MultiSlotStringDataGenerator",
    "QueueDataset",
    "ClipGradByGlobalNorm",
    "CommunicateTopology",
    "DistributedEmbedding",
    "DistributedStrategy",
    "PassResult",
    "LayerDesc",
    "PipelineLayer",
    "SharedLayerDesc",
    "StreamingConfig",
    "StreamingTrainer",
    "asp",
    "barrier_worker",
    "begin_pass",
    "clip_grad_norm_",
    "data",
    "distributed_model",
    "distributed_optimizer",
    "distributed_scaler",
    "elastic",
    "end_day",
    "end_pass",
    "get_hybrid_communicate_group",
    "heter",
    "heter_worker_num",
    "init",
    "init_server",
    "init_worker",
    "is_first_worker",
    "is_heter_worker",
    "is_server",
    "is_worker",
    "load_checkpoint",
    "load_model",
    "local_rank",
    "meta_parallel",
    "metrics",
    "ps",
    "record",
    "report",
    "role_maker",
    "run_heter_worker",
    "run_server",
    "save_cache_model",
    "save_checkpoint",
    "save_persistables",
    "server_endpoints",
    "server_index",
    "server_num",
    "sharding",
    "shrink",
    "shutdown",
    "stop_worker",
    "telemetry",
    "train_days",
    "train_from_dataset",
    "util",
    "utils",
    "worker_endpoints",
    "worker_index",
    "worker_num",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None and f"fleet.{name}" in MOVED_MODULES:
        module = f"fleet.{name}."  # ``fleet.amp`` as an attribute: the alias, with its warning
    if module is None:
        raise AttributeError(f"module 'fleet' has no attribute {name!r}")
    if module.endswith("."):
        value: Any = importlib.import_module(module[:-1])
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
