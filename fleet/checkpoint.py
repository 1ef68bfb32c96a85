"""Hybrid checkpoints: ``fleet.save_checkpoint(path, model, optimizer)`` and
``fleet.load_checkpoint(path, model, optimizer)``.

Every rank writes what it holds — its model parameters (its tensor-parallel shard; its FSDP2
shard under sharding stage 3) and the optimizer state of the parameters it owns (its ZeRO
shard under sharding stages 1/2) — with ``torch.distributed.checkpoint`` (DCP), and rank 0
writes ``fleet_manifest.json``: the degrees, every saved parameter's name, shape and dtype, the
optimizer class, hyper-parameter groups, which state keys each parameter has and the sharding
layout (owner rank per parameter for stages 1/2, FSDP2 dim-0 shards for stage 3).

Loading with **any other dp, sharding (stage), mp or pp degree** works: the state is keyed by
parameter name, not by rank, so each rank asks DCP for exactly the entries it needs under the new
layout (DCP reads them from whichever rank's file holds them, and reassembles FSDP2 DTensor
shards into plain tensors or into a different sharding).

* Tensor parallelism: a tensor-parallel shard (a parameter the layers of
  :mod:`fleet.meta_parallel.tensor_parallel` mark with ``is_distributed`` and ``split_axis``, as
  Paddle does) and every optimizer state tensor of the shard's shape (Adam's moments) are saved
  as a DTensor over a 1-D DeviceMesh of the model-parallel group with placement
  ``Shard(split_axis)``, so DCP records the *global* shape and each rank's chunk offset. Loading
  wraps the live parameter (and a fresh state tensor) the same way over the new mp group, or
  uses the plain full tensor at ``mp_degree == 1``, and DCP reads exactly the overlapping slices
  into that storage. Replicated tensors (RowParallelLinear's bias, layers outside TP) stay plain
  tensors, written once. Shards split evenly in mp-rank order (the layers require sizes that
  divide by the degree), which is what ``Shard(d)`` means.
* Pipeline parallelism: a PipelineLayer names its layers by global index and its tied layers
  ``shared_layers.<key>.<name>`` on every stage, so a stage's state is a subset of the whole
  model's; each stage saves its subset (a tied weight held by several stages is written once;
  a shared layer's other parameters, which the holders do not keep in sync, are saved by the
  first holder only) and a stage of another pp degree loads its own subset.

Before reading, loading checks every parameter's global shape against the manifest
(ConfigError naming the parameters and both shapes).

Why DCP and not ``torch.save`` per rank: DCP already does the deduplication of replicated
tensors (stage 1/2 parameters are identical on every rank: written once), the resharding of
DTensors (stage 3) and the "read any key from any file" planning a different degree needs.
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` is not used because it
expects every rank's optimizer to hold every (or its FSDP-sharded) parameter; a stage 1/2
optimizer holds a subset, so fleet names the state itself (``optim.<param>.<key>``).

Key layout in DCP (format 2): ``model.<param or buffer name>``, ``optim.<param>.<state key>``,
the same at every degree; the manifest records each parameter's global shape (and its
``split_axis`` when saved as tensor-parallel shards) and the hyper-parameters of every parameter
group (JSON-representable values: lr, betas, weight decay, ...). Format 1 (per-mp-rank
``mp<r>.`` keys) is refused with a ConfigError. Gradient-merge micro-step counters and AMP loss
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
from fleet.base.runtime import get_runtime
from fleet.meta_optimizers.sharding import ShardedOptimizer

logger = logging.getLogger(__name__)

MANIFEST = "fleet_manifest.json"
"""Name of the manifest file in a checkpoint directory."""
FORMAT_VERSION = 2
"""Manifest format; bumped on incompatible changes (2: tensor-parallel shards as DTensors under
prefix-free names, instead of 1's per-mp-rank ``mp<r>.`` keys)."""


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
    """The :class:`~fleet.meta_optimizers.sharding.ShardedOptimizer` in the wrapper chain, or None."""
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
        return {
            "dp_degree": runtime.env.world_size,
            "mp_degree": 1,
            "pp_degree": 1,
            "sharding_degree": 1,
        }
    return {
        "dp_degree": hcg.get_data_parallel_world_size(),
        "mp_degree": hcg.get_model_parallel_world_size(),
        "pp_degree": hcg.get_pipe_parallel_world_size(),
        "sharding_degree": hcg.get_sharding_parallel_world_size(),
    }


class _TensorParallel:
    """This rank's tensor-parallel layout: which parameters are shards (name -> split axis) and
    how to view a shard as a DTensor of the global tensor over the model-parallel group."""

    def __init__(self, module: torch.nn.Module) -> None:
        hcg = get_runtime("save_checkpoint()").hcg
        self.degree = 1 if hcg is None else hcg.get_model_parallel_world_size()
        self.axes: dict[str, int] = {}
        self.mesh: Any = None
        if self.degree == 1:
            return
        named = list(module.named_parameters(remove_duplicate=False))
        self.axes = {
            n: int(p.split_axis) for n, p in named if getattr(p, "split_axis", None) is not None
        }
        unknown = [
            n for n, p in named if p.__dict__.get("is_distributed") is True and n not in self.axes
        ]
        if unknown:
            # saved plain, every mp rank's different shard would share one key (DCP keeps one)
            raise ConfigError(
                f"parameter(s) {unknown[:4]} are marked is_distributed (one mp rank's shard) but "
                "have no split_axis; set param.split_axis = <the dimension the full tensor is "
                "split along, in mp-rank order> (fleet's tensor-parallel layers set it)",
                key="split_axis",
            )
        if self.axes and any(_is_dtensor(p) for _, p in named):
            # FSDP2 over the TP layers: each parameter is a TP shard sharded again over the
            # sharding mesh (a 2-D layout this module does not describe to DCP yet)
            raise FleetNotImplementedError(
                "fleet.save_checkpoint / load_checkpoint of sharding stage 3 with tensor "
                "parallelism (mp_degree > 1)",
                hint="checkpoint that layout with sharding stage 1 or 2 (same optimizer "
                "partition semantics), or save each rank's model.state_dict() / "
                "optimizer.state_dict() with torch.distributed.checkpoint yourself; stage 3 "
                "alone and stage 3 with pipeline parallelism are supported",
            )
        if self.axes:
            from torch.distributed.device_mesh import DeviceMesh

            device = next(_local(p).device.type for _, p in named)
            self.mesh = DeviceMesh.from_group(hcg.get_model_parallel_group(), device)

    def global_shape(self, name: str, local: torch.Size) -> list[int]:
        shape = list(local)
        if name in self.axes:
            shape[self.axes[name]] *= self.degree
        return shape

    def wrap(self, name: str, local: torch.Tensor) -> Any:
        """``local`` (this rank's shard of parameter ``name``, or a state tensor of its shape) as
        a DTensor sharing its storage; ``local`` itself when ``name`` is not a shard."""
        if name not in self.axes:
            return local
        from torch.distributed.tensor import DTensor, Shard

        shape = torch.Size(self.global_shape(name, local.shape))
        return DTensor.from_local(
            local,
            self.mesh,
            [Shard(self.axes[name])],
            run_check=False,
            shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )


class _OptimizerView:
    """The parameters whose state this rank saves/loads, by name, and where the state lives."""

    def __init__(self, module: torch.nn.Module, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.sharded = _sharded_optimizer(optimizer)
        names = {id(p): n for n, p in module.named_parameters()}
        params = (
            self.sharded.owned_params()
            if self.sharded is not None
            else [p for g in optimizer.param_groups for p in g["params"]]
        )
        unnamed = [tuple(p.shape) for p in params if id(p) not in names]
        if unnamed:
            raise ConfigError(
                f"the optimizer updates {len(unnamed)} tensor(s) that are not parameters of the "
                f"model (shapes {unnamed[:4]}); save the model the optimizer was built on",
                key="optimizer",
            )
        self.params = [(names[id(p)], p) for p in params]
        self.all_params = (
            self.sharded.all_params() if self.sharded is not None else [p for _, p in self.params]
        )
        self.names = {id(p): n for p, n in ((p, names.get(id(p))) for p in self.all_params)}

    def state_key(self, p: torch.Tensor) -> torch.Tensor:
        return self.sharded.state_param(p) if self.sharded is not None else p

    def groups(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def owners(self) -> dict[str, int]:
        if self.sharded is None:
            return {}
        return {self.names[id(p)]: self.sharded.owner_of(p) for p in self.all_params}

    def is_shard_state(self, p: torch.Tensor, value: Any) -> bool:
        """Whether optimizer state ``value`` of parameter ``p`` is laid out like ``p`` itself."""
        return (
            isinstance(value, torch.Tensor)
            and value.dim() > 0
            and tuple(_local(value).shape) == tuple(_local(self.state_key(p)).shape)
        )


def save_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: Any = None, *, single_writer: bool = False
) -> None:
    """Write this job's model (and optimizer) state under directory ``path`` (collective: every
    rank calls it). ``model``/``optimizer``: what ``fleet.distributed_model`` /
    ``fleet.distributed_optimizer`` returned (or the plain ones). ``single_writer``: rank 0
    writes every tensor that several ranks hold (DCP's ``dedup_save_to_lowest_rank``; by
    default DCP spreads them over the ranks), so a data-parallel job's checkpoint is written by
    rank 0 alone; state only some ranks hold (a sharding owner's optimizer state, a
    tensor-parallel shard) is still written by its holders."""
    path = Path(path)
    degrees = _degrees()
    module = _unwrap(model)
    tp = _TensorParallel(module)
    skip = _later_holders(module)
    state: dict[str, Any] = {
        f"model.{k}": tp.wrap(k, v)
        for k, v in module.state_dict().items()
        if not k.startswith(skip)
    }
    params_meta: dict[str, Any] = {}
    for n, p in module.named_parameters():
        if n.startswith(skip):
            continue
        params_meta[n] = {
            "shape": tp.global_shape(n, p.shape),
            "dtype": str(p.dtype).replace("torch.", ""),
        }
        if n in tp.axes:
            params_meta[n]["split_axis"] = tp.axes[n]
    local: dict[str, Any] = {"params": params_meta, "state_keys": {}, "owners": {}}
    view = None
    if optimizer is not None:
        view = _OptimizerView(module, optimizer)
        for name, p in view.params:
            if name.startswith(skip):
                continue
            entries = optimizer.state.get(view.state_key(p), {})
            local["state_keys"][name] = sorted(entries)
            for key, value in entries.items():
                shard = view.is_shard_state(p, value)
                state[f"optim.{name}.{key}"] = tp.wrap(name, value) if shard else value
        local["owners"] = view.owners()
    # Every rank's part: a pipeline stage (or a sharding rank) knows only its own parameters.
    gathered: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, local)
    merged: dict[str, dict[str, Any]] = {"params": {}, "state_keys": {}, "owners": {}}
    for part in gathered:
        for section, entries in part.items():
            merged[section].update(entries)
    for part in gathered:  # a parameter's state keys: whichever rank has any
        for name, keys in part["state_keys"].items():
            merged["state_keys"][name] = sorted(set(merged["state_keys"][name]) | set(keys))
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True) if single_writer else None
    dcp.save(state, checkpoint_id=str(path), planner=planner)
    if tdist.get_rank() == 0:
        optim_meta: dict[str, Any] | None = None
        if view is not None:
            optim_meta = {
                "class": type(
                    view.sharded.inner_optimizer
                    if view.sharded
                    else getattr(optimizer, "inner_optimizer", optimizer)
                ).__name__,
                "sharding_stage": view.sharded.stage if view.sharded is not None else 0,
                "owners": merged["owners"],
                "state_keys": merged["state_keys"],
                "param_groups": [
                    {k: v for k, v in g.items() if _jsonable(v)} for g in view.groups()
                ],
            }
        manifest = {
            "format": FORMAT_VERSION,
            "world_size": tdist.get_world_size(),
            "degrees": degrees,
            "fsdp_stage3": any(_is_dtensor(p) for p in module.parameters()),
            "params": merged["params"],
            "optimizer": optim_meta,
        }
        (path / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    tdist.barrier()
    logger.info("saved checkpoint %s (%s)", path, degrees)


def _later_holders(module: torch.nn.Module) -> tuple[str, ...]:
    """Name prefixes of the pipeline shared layers this stage holds but is not the first holder
    of: only the first holder saves them. The tied parameter is equal on every holder, but the
    shared layer's other parameters (a tied Linear's bias) are not kept in sync (each holder
    trains its own copy, if it uses it), so the checkpoint keeps the first holder's copy, the
    one Paddle marks ``is_firstly_shared``."""
    if not (hasattr(module, "shared_stage_map") and hasattr(module, "stage_id")):
        return ()
    return tuple(
        f"shared_layers.{key}."
        for key, stages in module.shared_stage_map().items()
        if stages and stages[0] != module.stage_id
    )


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` (ConfigError when it is not a fleet checkpoint)."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except OSError as err:
        raise ConfigError(
            f"{str(path)!r} is not a fleet checkpoint (cannot read {MANIFEST}: "
            f"{err}); pass the directory fleet.save_checkpoint wrote",
            key="path",
        ) from None
    if manifest.get("format") != FORMAT_VERSION:
        raise ConfigError(
            f"checkpoint {str(path)!r} has format {manifest.get('format')}, this fleet reads "
            f"format {FORMAT_VERSION} (format 1 keyed tensor-parallel shards per mp rank); load "
            "it with the fleet version that wrote it and save it again with this one",
            key="path",
        )
    return manifest


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: Any = None) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``),
    in place (collective). Any of the dp, sharding (and stage), mp and pp degrees may differ
    from the saving job's: tensor-parallel shards are re-sliced, pipeline stages load their
    own layers."""
    manifest = read_manifest(path)
    degrees = _degrees()
    saved = manifest["degrees"]
    module = _unwrap(model)
    tp = _TensorParallel(module)
    named = list(module.named_parameters())
    missing = [n for n, _ in named if n not in manifest["params"]]
    if missing:
        raise ConfigError(
            f"the checkpoint has no parameter(s) {missing[:8]} (it has "
            f"{sorted(manifest['params'])[:8]}...); load into the model it was saved from",
            key="model",
        )
    # (a DTensor's shape, FSDP2's, is already the global one)
    wrong = [
        f"{n}: saved {manifest['params'][n]['shape']}, here {tp.global_shape(n, p.shape)}"
        for n, p in named
        if manifest["params"][n]["shape"] != tp.global_shape(n, p.shape)
    ]
    if wrong:
        raise ConfigError(
            f"the checkpoint's global shapes differ from this model's ({'; '.join(wrong[:4])}); "
            "build the same model (with the same layer sizes; a tensor-parallel layer must be "
            "one here too, or a dense layer with the full shape)",
            key="model",
        )
    state: dict[str, Any] = {f"model.{k}": tp.wrap(k, v) for k, v in module.state_dict().items()}
    slots: list[tuple[Any, str, str, Any]] = []
    view = None
    if optimizer is not None:
        optim_meta = manifest.get("optimizer")
        if optim_meta is None:
            raise ConfigError(
                f"checkpoint {str(path)!r} holds no optimizer state; load without optimizer=",
                key="optimizer",
            )
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
            for key in optim_meta["state_keys"].get(name, []):
                fqn = f"optim.{name}.{key}"
                info = meta[fqn]
                local = None
                if isinstance(info, dcp.TensorStorageMetadata):
                    dtype = info.properties.dtype
                    size = list(info.size)
                    if name in tp.axes and size == tp.global_shape(name, _local(target).shape):
                        local = torch.zeros_like(_local(target), dtype=dtype)
                        state[fqn] = tp.wrap(name, local)  # DCP reads this rank's slice
                    elif tuple(size) == tuple(target.shape):
                        state[fqn] = torch.zeros_like(target, dtype=dtype)
                    else:
                        state[fqn] = torch.zeros(
                            tuple(size), dtype=dtype, device=_local(target).device
                        )
                else:
                    state[fqn] = 0  # a non-tensor value; DCP replaces it
                slots.append((target, key, fqn, local))
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is not None and view is not None:
        for target, key, fqn, local in slots:
            optimizer.state.setdefault(target, {})[key] = state[fqn] if local is None else local
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
