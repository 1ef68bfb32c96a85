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
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it ("" = the submodule itself)
_LAZY = {
    "init": "fleet.base",
    "worker_index": "fleet.base",
    "worker_num": "fleet.base",
    "is_first_worker": "fleet.base",
    "local_rank": "fleet.base",
    "worker_endpoints": "fleet.base",
    "barrier_worker": "fleet.base",
    "distributed_model": "fleet.data_parallel",
    "distributed_optimizer": "fleet.optimizer",
    "DistributedStrategy": "fleet.strategy",
    "save_checkpoint": "fleet.checkpoint",
    "load_checkpoint": "fleet.checkpoint",
    "sharding": "",
    "util": "",
    "role_maker": "",
    "metrics": "",
    "report": "fleet.telemetry",
    "telemetry": "",
    "record": "collective.record",
    "is_server": "fleet.ps_runtime",
    "is_worker": "fleet.ps_runtime",
    "server_num": "fleet.ps_runtime",
    "server_index": "fleet.ps_runtime",
    "server_endpoints": "fleet.ps_runtime",
    "init_server": "fleet.ps_runtime",
    "run_server": "fleet.ps_runtime",
    "init_worker": "fleet.ps_runtime",
    "stop_worker": "fleet.ps_runtime",
    "save_persistables": "fleet.ps_runtime",
    "shrink": "fleet.ps_runtime",
    "end_day": "fleet.ps_runtime",
    "DistributedEmbedding": "fleet.embedding",
    "get_hybrid_communicate_group": "fleet.topology",
    "CommunicateTopology": "fleet.topology",
    "meta_parallel": "",
    "utils": "",
    "distributed_scaler": "fleet.amp",
    "clip_grad_norm_": "fleet.clip",
    "ClipGradByGlobalNorm": "fleet.clip",
    "LayerDesc": "fleet.meta_parallel",
    "SharedLayerDesc": "fleet.meta_parallel",
    "PipelineLayer": "fleet.meta_parallel",
}

__all__ = [
    "ClipGradByGlobalNorm",
    "CommunicateTopology",
    "DistributedEmbedding",
    "DistributedStrategy",
    "LayerDesc",
    "PipelineLayer",
    "SharedLayerDesc",
    "barrier_worker",
    "clip_grad_norm_",
    "distributed_model",
    "distributed_optimizer",
    "distributed_scaler",
    "end_day",
    "get_hybrid_communicate_group",
    "init",
    "init_server",
    "init_worker",
    "is_first_worker",
    "is_server",
    "is_worker",
    "load_checkpoint",
    "local_rank",
    "meta_parallel",
    "metrics",
    "record",
    "report",
    "role_maker",
    "run_server",
    "save_checkpoint",
    "save_persistables",
    "server_endpoints",
    "server_index",
    "server_num",
    "sharding",
    "shrink",
    "stop_worker",
    "telemetry",
    "util",
    "utils",
    "worker_endpoints",
    "worker_index",
    "worker_num",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fleet' has no attribute {name!r}")
    value = importlib.import_module(f"fleet.{name}") if module == "" else getattr(
        importlib.import_module(module), name
    )
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
