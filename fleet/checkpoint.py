"""Hybrid checkpoints: ``fleet.save_checkpoint(path, model, optimizer)`` and
``fleet.load_checkpoint(path, model, optimizer)``.

Every rank writes what it holds — its model parameters (its tensor-parallel shard; its FSDP2
shard under sharding stage 3) and the optimizer state of the parameters it owns (its ZeRO
shard under sharding stages 1/2) — with ``torch.distributed.checkpoint`` (DCP), and rank 0
writes ``fleet_manifest.json``: the degrees, every saved parameter's name, shape and dtype, the
optimizer class, hyper-parameter groups, which state keys each parameter has and the sharding
layout (owner rank per parameter for stages 1/2, FSDP2 dim-0 shards for stage 3).

Loading with a **different data-parallel or sharding degree** (or stage) works: the state is
keyed by parameter name, not by rank, so each rank asks DCP for exactly the entries it needs
under the new layout (DCP reads them from whichever rank's file holds them, and reassembles
FSDP2 DTensor shards into plain tensors or into a different sharding). Loading with a different
``mp_degree`` or ``pp_degree`` raises FleetNotImplementedError (tensor-parallel shards would need
re-slicing along each layer's split dimension; that is the stretch goal of issue #4).

Why DCP and not ``torch.save`` per rank: DCP already does the deduplication of replicated
tensors (stage 1/2 parameters are identical on every rank: written once), the resharding of
DTensors (stage 3) and the "read any key from any file" planning a different degree needs.
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` is not used because it
expects every rank's optimizer to hold every (or its FSDP-sharded) parameter; a stage 1/2
optimizer holds a subset, so fleet names the state itself (``optim.<param>.<key>``).

Key layout in DCP: ``model.[mp<r>.]<param or buffer name>``, ``optim.[mp<r>.]<param>.<state
key>``; the hyper-parameters of every parameter group (JSON-representable values: lr, betas,
weight decay, ...) are in the manifest. The ``mp<r>.`` prefix appears only with
``mp_degree > 1``. Gradient-merge micro-step counters and AMP loss
scalers are not saved: save at an update boundary, and save a GradScaler's ``state_dict``
yourself.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp

from collective.errors import ConfigError, FleetNotImplementedError
from fleet.base import get_runtime

logger = logging.getLogger(__name__)

MANIFEST = "fleet_manifest.json"
"""Name of the manifest file in a checkpoint directory."""
FORMAT_VERSION = 1
"""Manifest format; bumped on incompatible changes."""


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameter names are the model's own (through DDP and the pipeline)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "PipelineParallel" and hasattr(model, "layers"):
            model = model.layers
        else:
            return model


def _sharded_optimizer(optimizer: Any) -> Any:
    """The :class:`~fleet.sharding.ShardedOptimizer` in the wrapper chain, or None."""
    from fleet.sharding import ShardedOptimizer

    seen = 0
    while optimizer is not None and seen < 16:
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer
        optimizer = optimizer.__dict__.get("_inner") or optimizer.__dict__.get("optimizer")
        seen += 1
    return None


def _degrees() -> dict[str, int]:
    runtime = get_runtime("save_checkpoint()")
    hcg = runtime.hcg
    if hcg is None:
        return {"dp_degree": runtime.env.world_size, "mp_degree": 1, "pp_degree": 1,
                "sharding_degree": 1}
    return {
        "dp_degree": hcg.get_data_parallel_world_size(),
        "mp_degree": hcg.get_model_parallel_world_size(),
        "pp_degree": hcg.get_pipe_parallel_world_size(),
        "sharding_degree": hcg.get_sharding_parallel_world_size(),
    }


def _prefix() -> str:
    hcg = get_runtime("save_checkpoint()").hcg
    if hcg is None or hcg.get_model_parallel_world_size() == 1:
        return ""
    return f"mp{hcg.get_model_parallel_rank()}."


class _OptimizerView:
    """The parameters whose state this rank saves/loads, by name, and where the state lives."""

    def __init__(self, module: torch.nn.Module, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.sharded = _sharded_optimizer(optimizer)
        names = {id(p): n for n, p in module.named_parameters()}
        params = self.sharded.owned_params() if self.sharded is not None else [
            p for g in optimizer.param_groups for p in g["params"]
        ]
        unnamed = [tuple(p.shape) for p in params if id(p) not in names]
        if unnamed:
            raise ConfigError(
                f"the optimizer updates {len(unnamed)} tensor(s) that are not parameters of the "
                f"model (shapes {unnamed[:4]}); save the model the optimizer was built on",
                key="optimizer",
            )
        self.params = [(names[id(p)], p) for p in params]
        self.all_params = self.sharded.all_params() if self.sharded is not None else [
            p for _, p in self.params
        ]
        self.names = {id(p): n for p, n in ((p, names.get(id(p))) for p in self.all_params)}

    def state_key(self, p: torch.Tensor) -> torch.Tensor:
        return self.sharded.state_param(p) if self.sharded is not None else p

    def groups(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"}
                for g in self.optimizer.param_groups]

    def owners(self) -> dict[str, int]:
        if self.sharded is None:
            return {}
        return {self.names[id(p)]: self.sharded.owner_of(p) for p in self.all_params}


def save_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: Any = None) -> None:
    """Write this job's model (and optimizer) state under directory ``path`` (collective: every
    rank calls it). ``model``/``optimizer``: what ``fleet.distributed_model`` /
    ``fleet.distributed_optimizer`` returned (or the plain ones)."""
    path = Path(path)
    degrees = _degrees()
    prefix = _prefix()
    module = _unwrap(model)
    state: dict[str, Any] = {f"model.{prefix}{k}": v for k, v in module.state_dict().items()}
    params_meta = {
        f"{prefix}{n}": {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
        for n, p in module.named_parameters()
    }
    optim_meta: dict[str, Any] | None = None
    if optimizer is not None:
        view = _OptimizerView(module, optimizer)
        state_keys: dict[str, list[str]] = {}
        for name, p in view.params:
            entries = optimizer.state.get(view.state_key(p), {})
            state_keys[f"{prefix}{name}"] = sorted(entries)
            for key, value in entries.items():
                state[f"optim.{prefix}{name}.{key}"] = value
        gathered: list[Any] = [None] * tdist.get_world_size()
        tdist.all_gather_object(gathered, state_keys)
        merged: dict[str, list[str]] = {}
        for part in gathered:
            merged.update(part)
        optim_meta = {
            "class": type(view.sharded.inner_optimizer if view.sharded else
                          getattr(optimizer, "inner_optimizer", optimizer)).__name__,
            "sharding_stage": view.sharded.stage if view.sharded is not None else 0,
            "owners": {f"{prefix}{n}": o for n, o in view.owners().items()},
            "state_keys": merged,
            "param_groups": [{k: v for k, v in g.items() if _jsonable(v)} for g in view.groups()],
        }
    all_params: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(all_params, params_meta)
    dcp.save(state, checkpoint_id=str(path))
    if tdist.get_rank() == 0:
        manifest = {
            "format": FORMAT_VERSION,
            "world_size": tdist.get_world_size(),
            "degrees": degrees,
            "fsdp_stage3": any(_is_dtensor(p) for p in module.parameters()),
            "params": {k: v for part in all_params for k, v in part.items()},
            "optimizer": optim_meta,
        }
        (path / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    tdist.barrier()
    logger.info("saved checkpoint %s (%s)", path, degrees)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` (ConfigError when it is not a fleet checkpoint)."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except OSError as err:
        raise ConfigError(f"{str(path)!r} is not a fleet checkpoint (cannot read {MANIFEST}: "
                          f"{err}); pass the directory fleet.save_checkpoint wrote",
                          key="path") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint format {manifest.get('format')} is not "
                          f"{FORMAT_VERSION}", key="path")
    return manifest


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: Any = None) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``),
    in place (collective). The data-parallel and sharding degrees (and the sharding stage) may
    differ from the saving job's; the tensor- and pipeline-parallel degrees may not."""
    manifest = read_manifest(path)
    degrees = _degrees()
    saved = manifest["degrees"]
    if (saved["mp_degree"], saved["pp_degree"]) != (degrees["mp_degree"], degrees["pp_degree"]):
        raise FleetNotImplementedError(
            f"loading a checkpoint saved at mp_degree={saved['mp_degree']}, "
            f"pp_degree={saved['pp_degree']} into mp_degree={degrees['mp_degree']}, "
            f"pp_degree={degrees['pp_degree']}",
            hint="load with the same mp_degree and pp_degree (dp_degree, sharding_degree and "
            "the sharding stage may differ)",
        )
    prefix = _prefix()
    module = _unwrap(model)
    names = [f"{prefix}{n}" for n, _ in module.named_parameters()]
    missing = [n for n in names if n not in manifest["params"]]
    if missing:
        raise ConfigError(
            f"the checkpoint has no parameter(s) {missing[:8]} (it has "
            f"{sorted(manifest['params'])[:8]}...); load into the model it was saved from",
            key="model",
        )
    state: dict[str, Any] = {f"model.{prefix}{k}": v for k, v in module.state_dict().items()}
    slots: list[tuple[Any, str, str]] = []
    view = None
    if optimizer is not None:
        optim_meta = manifest.get("optimizer")
        if optim_meta is None:
            raise ConfigError(f"checkpoint {str(path)!r} holds no optimizer state; load without "
                              "optimizer=", key="optimizer")
        view = _OptimizerView(module, optimizer)
        if len(optim_meta["param_groups"]) != len(optimizer.param_groups):
            raise ConfigError(
                f"the checkpoint's optimizer has {len(optim_meta['param_groups'])} parameter "
                f"group(s), this one {len(optimizer.param_groups)}; build it the same way",
                key="optimizer",
            )
        meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for name, p in view.params:
            target = view.state_key(p)
            for key in optim_meta["state_keys"].get(f"{prefix}{name}", []):
                fqn = f"optim.{prefix}{name}.{key}"
                info = meta[fqn]
                if isinstance(info, dcp.TensorStorageMetadata):
                    dtype = info.properties.dtype
                    if tuple(info.size) == tuple(target.shape):
                        state[fqn] = torch.zeros_like(target, dtype=dtype)
                    else:
                        state[fqn] = torch.zeros(tuple(info.size), dtype=dtype,
                                                 device=_local(target).device)
                else:
                    state[fqn] = 0  # a non-tensor value; DCP replaces it
                slots.append((target, key, fqn))
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is not None and view is not None:
        for target, key, fqn in slots:
            optimizer.state.setdefault(target, {})[key] = state[fqn]
        for group, saved_group in zip(optimizer.param_groups, optim_meta["param_groups"]):
            for key, value in saved_group.items():
                # JSON has no tuples (Adam's betas): keep the type the optimizer uses.
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        if view.sharded is not None:
            view.sharded.refresh_masters()
    tdist.barrier()
    logger.info("loaded checkpoint %s (saved at %s, now %s)", path, saved, degrees)


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


__all__ = ["MANIFEST", "load_checkpoint", "read_manifest", "save_checkpoint"]
