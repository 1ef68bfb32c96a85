"""The one place that turns a strategy into wrappers: :func:`parallelize`.

``fleet.distributed_model`` and ``fleet.distributed_optimizer`` validate their argument and call
:func:`parallelize`, which applies the wrappers the strategy asks for in this fixed order
(torchtitan's ``parallelize()`` habit: model code stays single-device, the order lives here):

model::

    1. features      fleet.parallelize.features.wrap_model_features: recompute checkpoints, AMP (O2 cast)
    2. tensor par.   nothing to do: the model is built from fleet.meta_parallel TP layers
    3. pipeline      PipelineLayer -> PipelineParallel (it reduces gradients over dp itself)
       or stage 3    FSDP2 fully_shard over the sharding (x dp: HSDP) DeviceMesh
    4. data parallel torch DDP over the gradient group: dp x sharding for sharding stage 1 (the
                     all-reduce overlaps backward), dp for stage 2 (the optimizer reduces to the
                     owner), the whole world for pure data parallel; skipped when it has 1 rank

optimizer::

    1. features      fleet.parallelize.features.wrap_optimizer_features: LARS/LAMB, global-norm clipping
    2. sharding      stage 1/2: fleet.meta_optimizers.sharding.ShardedOptimizer over the sharding group
                     (stage 3: the optimizer must hold FSDP2's sharded parameters)
    3. grad merge    fleet.meta_optimizers.gradient_merge.DistributedOptimizer (no_sync shared with the model)

:func:`fleet.strategy.check_composition` refuses the combinations that cannot work, naming both
features and the fix; it runs at ``fleet.init``, at both wrapping calls, and again here. Nothing is
silently switched off.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as tdist

from collective.errors import ConfigError, FleetNotImplementedError
from fleet.meta_optimizers.gradient_merge import (
    DistributedOptimizer,
    GradientMergeState,
    link_gradient_merge,
)
from fleet.meta_optimizers.sharding import ShardedOptimizer, apply_fsdp
from fleet.meta_parallel.pipeline_layer import PipelineLayer
from fleet.meta_parallel.pipeline_parallel import PipelineParallel
from fleet.parallelize.data_parallel import DataParallel
from fleet.parallelize.features import wrap_model_features, wrap_optimizer_features
from fleet.strategy import DistributedStrategy, check_composition, sharding_stage, uses_pipeline

logger = logging.getLogger(__name__)

# ---- groups ---------------------------------------------------------------------------------

_GRAD_GROUPS: dict[int, tuple[list[int], Any]] = {}


def dp_sharding_group(hcg: Any) -> tuple[list[int], Any]:
    """The ranks that hold the same model shard (same pipe and model coordinates): the
    data-parallel x sharding replicas, and a torch group over them (built once, collectively:
    every rank creates every such group in the same order)."""
    key = id(hcg)
    if key not in _GRAD_GROUPS:
        topo = hcg.topology()
        mine: tuple[list[int], Any] | None = None
        me = tdist.get_rank()
        for pipe in range(topo.get_dim("pipe")):
            for model in range(topo.get_dim("model")):
                ranks = sorted(
                    r for r in range(topo.world_size())
                    if topo.get_coord(r)["pipe"] == pipe and topo.get_coord(r)["model"] == model
                )
                group = tdist.new_group(ranks=ranks)
                if me in ranks:
                    mine = (ranks, group)
        assert mine is not None
        _GRAD_GROUPS[key] = mine
    return _GRAD_GROUPS[key]


def sharding_mesh(hcg: Any, device_type: str) -> Any:
    """FSDP2's DeviceMesh over this rank's sharding group, or the 2-D ``(dp, sharding)`` mesh
    (HSDP) when ``dp_degree > 1`` — built from the hybrid topology's existing groups."""
    from torch.distributed.device_mesh import DeviceMesh

    sharding = hcg.get_sharding_parallel_group()
    if hcg.get_data_parallel_world_size() == 1:
        return DeviceMesh.from_group(sharding, device_type, mesh_dim_names=("sharding",))
    topo, coord = hcg.topology(), hcg.topology().get_coord(tdist.get_rank())
    mesh = [
        [topo.get_rank(data=d, pipe=coord["pipe"], sharding=s, model=coord["model"])
         for s in range(topo.get_dim("sharding"))]
        for d in range(topo.get_dim("data"))
    ]
    return DeviceMesh.from_group(
        [hcg.get_data_parallel_group(), sharding], device_type,
        mesh=torch.tensor(mesh), mesh_dim_names=("dp", "sharding"),
    )


# ---- the one function ------------------------------------------------------------------------

def parallelize(
    runtime: Any,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Wrap ``model`` or ``optimizer`` (exactly one) as ``runtime.strategy`` asks, in the order
    of the module docstring. ``runtime``: :class:`fleet.base.runtime.FleetRuntime`."""
    if (model is None) == (optimizer is None):
        raise ConfigError("parallelize takes exactly one of model= and optimizer=", key="model")
    strategy: DistributedStrategy = runtime.strategy
    check_composition(strategy)
    hcg = runtime.hcg
    stage = sharding_stage(strategy)

    if model is not None:
        # 1. features (recompute, AMP) on the plain module.
        model = wrap_model_features(model, strategy)
        # 2. tensor parallel: the TP layers already hold their shards (fleet.meta_parallel).
        # 3a. pipeline: PipelineParallel runs the schedule and averages gradients over dp itself.
        if uses_pipeline(strategy):
            if not isinstance(model, PipelineLayer):
                raise ConfigError(
                    f"hybrid_configs.pp_degree={strategy.hybrid_configs.pp_degree} needs the "
                    f"model described as a fleet.meta_parallel.PipelineLayer, got "
                    f"{type(model).__name__}",
                    key="model",
                )
            pipe = PipelineParallel(model, hcg, strategy)
            runtime.models.add(pipe)
            return pipe
        # 3b. sharding stage 3: FSDP2 shards the parameters (and reduce-scatters gradients).
        if stage == 3:
            device_type = next(model.parameters()).device.type
            model = _apply_stage3(model, hcg, device_type, strategy.sharding_configs.offload)
            runtime.models.add(model)
            link_gradient_merge(runtime)
            return model
        # 4. data parallel over the gradient group.
        return _apply_ddp(model, runtime, stage)

    assert optimizer is not None
    # 1. features (LARS/LAMB, clipping) on the user's optimizer.
    optimizer = wrap_optimizer_features(optimizer, strategy)
    # 2. sharding.
    if stage in (1, 2):
        if getattr(optimizer, "grad_clip", None) is not None:
            raise FleetNotImplementedError(
                f"optimizer.grad_clip (global-norm clipping) with sharding stage {stage}",
                hint="the clip hook would see only this rank's parameter partition; with stage "
                "1 call fleet.clip_grad_norm_(model.parameters(), max_norm) before opt.step() "
                "instead (every gradient is reduced there), or use stage 3",
            )

        optimizer = ShardedOptimizer(
            optimizer,
            stage=stage,
            group=hcg.get_sharding_parallel_group(),
            group_ranks=hcg.get_group_ranks("sharding"),
            # Stage 1 without pipeline: DDP over dp x sharding already averaged the gradients.
            reduce_grads=uses_pipeline(strategy),
            offload=strategy.sharding_configs.offload,
            segment_MB=strategy.sharding_configs.segment_broadcast_MB,
        )
    elif stage == 3:
        _check_fsdp_params(optimizer)
    # 3. gradient merge (a pass-through wrapper without it).
    gm_cfg = strategy.gradient_merge_configs
    grad_merge = (
        GradientMergeState(k_steps=gm_cfg.k_steps, avg=gm_cfg.avg)
        if strategy.gradient_merge and gm_cfg.k_steps > 1
        else None
    )
    wrapper = DistributedOptimizer(optimizer, grad_merge)
    runtime.optimizers.add(wrapper)
    link_gradient_merge(runtime)
    return wrapper


def _apply_ddp(model: torch.nn.Module, runtime: Any, stage: int) -> torch.nn.Module:
    strategy, hcg = runtime.strategy, runtime.hcg
    device = next(p.device for p in model.parameters() if p.requires_grad)
    device_ids = [device.index] if device.type == "cuda" else None
    if hcg is None:
        group, size, what = None, runtime.env.world_size, "all"
    elif stage == 1:
        ranks, group = dp_sharding_group(hcg)
        size, what = len(ranks), "dp x sharding"
    else:
        group, size, what = (hcg.get_data_parallel_group(), hcg.get_data_parallel_world_size(),
                             "dp")
    if hcg is not None and size == 1:
        # Tensor parallel alone (or stage 2 with dp 1): no replica to average with.
        return model
    dp = DataParallel(
        model,
        device_ids=device_ids,
        process_group=group,
        find_unused_parameters=strategy.find_unused_parameters,
        bucket_cap_mb=strategy.fuse_grad_size_in_MB,
    )
    runtime.models.add(dp)
    link_gradient_merge(runtime)
    logger.debug(
        "distributed_model: DDP over %d rank(s) (%s), bucket %d MiB, find_unused_parameters=%s",
        size, what, strategy.fuse_grad_size_in_MB, strategy.find_unused_parameters,
    )
    return dp


def _apply_stage3(model: torch.nn.Module, hcg: Any, device_type: str, offload: bool
                  ) -> torch.nn.Module:
    model = apply_fsdp(model, sharding_mesh(hcg, device_type), offload)

    def _sync_hook(module: Any, args: Any) -> None:
        # Gradient merge: FSDP2 reduce-scatters only on the last micro-step of a cycle.
        gm = getattr(module, "grad_merge", None)
        if gm is not None:
            module.set_requires_gradient_sync(gm.sync_this_step())

    model.grad_merge = None
    model.register_forward_pre_hook(_sync_hook)
    return model


def _check_fsdp_params(optimizer: torch.optim.Optimizer) -> None:
    from torch.distributed.tensor import DTensor

    plain = [p for g in optimizer.param_groups for p in g["params"] if not isinstance(p, DTensor)]
    if plain:
        raise ConfigError(
            f"sharding stage 3 replaces the model's parameters with sharded ones, but this "
            f"optimizer holds {len(plain)} plain tensor(s); call model = "
            f"fleet.distributed_model(model) first and build the optimizer on "
            f"model.parameters() after it",
            key="optimizer",
        )


__all__ = [
    "check_composition",
    "dp_sharding_group",
    "parallelize",
    "sharding_mesh",
    "sharding_stage",
    "uses_pipeline",
]
