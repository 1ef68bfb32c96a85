"""The one place that turns a strategy into wrappers: :func:`parallelize`.

``fleet.distributed_model`` and ``fleet.distributed_optimizer`` validate their argument and call
:func:`parallelize`, which applies the wrappers the strategy asks for in this fixed order
(torchtitan's ``parallelize()`` habit: model code stays single-device, the order lives here):

model::

    1. features      fleet.parallelize.features.wrap_model_features: SyncBatchNorm over the
                     data-replica group, ASP 2:4 pruning, recompute checkpoints, AMP (O2 cast)
    2. tensor par.   nothing to do: the model is built from fleet.meta_parallel TP layers
    3. pipeline      PipelineLayer -> PipelineParallel (it reduces gradients over dp itself);
                     with stage 3, FSDP2 fully_shard of the stage's module over the sharding
                     (x dp: HSDP) mesh of its pipe coordinate (FSDP2 then reduces over dp)
       or stage 3    FSDP2 fully_shard over the sharding (x dp: HSDP) DeviceMesh, on top of
                     the tensor-parallel layers when mp_degree > 1 (each TP shard is sharded
                     again); AMP O2: MixedPrecisionPolicy(param_dtype=low, reduce_dtype=fp32),
                     the float32 shards are the master weights
    4. data parallel torch DDP over the gradient group: dp x sharding for sharding stage 1 (the
                     all-reduce overlaps backward), dp for stage 2 (the optimizer reduces to the
                     owner), the whole world for pure data parallel; skipped when it has 1 rank.
                     Buckets: fuse_grad_size_in_MB, a first one of last_comm_group_size_MB
                     (fuse_all_reduce_ops=False: one per parameter)
    5. comm hook     fleet.meta_optimizers.comm_hooks: fp16/bf16 compression, post-local SGD or
                     DGC replaces DDP's float32 all-reduce (at most one)

optimizer::

    1. features      fleet.parallelize.features.wrap_optimizer_features: LARS/LAMB, global-norm clipping
    2. sharding      stage 1/2: fleet.meta_optimizers.sharding.ShardedOptimizer over the sharding group
                     (around AMP O2's master-weight optimizer: masters exist for owned
                     parameters only; a global-norm clip sums over the sharding group too)
                     (stage 3: the optimizer must hold FSDP2's sharded parameters)
    3. comm          dgc: fleet.meta_optimizers.dgc.DGCMomentumOptimizer (linked to the model's
                     DGC hook); localsgd / adaptive_localsgd: fleet.meta_optimizers.localsgd
                     (torch's PostLocalSGDOptimizer, averaging over the gradient group)
    4. asp           fleet.meta_optimizers.asp.decorate: masks re-applied after every update
                     (outside 3, so DGC's and local SGD's updates are masked too)
    5. grad merge    fleet.meta_optimizers.gradient_merge.DistributedOptimizer (no_sync shared with the model)

:func:`fleet.strategy.check_composition` refuses the combinations that cannot work, naming both
features and the fix; it runs at ``fleet.init``, at both wrapping calls, and again here. Nothing is
silently switched off.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.distributed as tdist

from collective.errors import ConfigError
from fleet.meta_optimizers import asp
from fleet.meta_optimizers.amp import torch_dtype
from fleet.meta_optimizers.comm_hooks import register_comm_hook
from fleet.meta_optimizers.dgc import DGCMomentumOptimizer, DGCState, find_dgc_optimizer
from fleet.meta_optimizers.gradient_merge import (
    DistributedOptimizer,
    GradientMergeState,
    link_gradient_merge,
)
from fleet.meta_optimizers.localsgd import build_localsgd_optimizer
from fleet.meta_optimizers.sharding import ShardedOptimizer, apply_fsdp
from fleet.meta_parallel.pipeline_layer import PipelineLayer
from fleet.meta_parallel.pipeline_parallel import PipelineParallel
from fleet.parallelize.data_parallel import DataParallel
from fleet.parallelize.features import wrap_model_features, wrap_optimizer_features
from fleet.strategy import DistributedStrategy, check_composition, sharding_stage, uses_pipeline
from fleet.strategy.distributed_strategy import NO_OP_KEYS

logger = logging.getLogger(__name__)

# ---- groups ---------------------------------------------------------------------------------

# Keyed by the topology object itself, weakly: a key of id(hcg) outlived the hcg that fleet.init
# replaced, and when a new hcg reused the address on some ranks only, those ranks skipped the
# collective new_group() the others called (a 4-rank job hung in 1 of ~4 runs).
_GRAD_GROUPS: weakref.WeakKeyDictionary[Any, tuple[list[int], Any]] = weakref.WeakKeyDictionary()


def dp_sharding_group(hcg: Any) -> tuple[list[int], Any]:
    """The ranks that hold the same model shard (same pipe and model coordinates): the
    data-parallel x sharding replicas, and a torch group over them (built once, collectively:
    every rank creates every such group in the same order)."""
    key = hcg
    if key not in _GRAD_GROUPS:
        topo = hcg.topology()
        mine: tuple[list[int], Any] | None = None
        me = tdist.get_rank()
        for pipe in range(topo.get_dim("pipe")):
            for model in range(topo.get_dim("model")):
                ranks = sorted(
                    r
                    for r in range(topo.world_size())
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
        [
            topo.get_rank(data=d, pipe=coord["pipe"], sharding=s, model=coord["model"])
            for s in range(topo.get_dim("sharding"))
        ]
        for d in range(topo.get_dim("data"))
    ]
    return DeviceMesh.from_group(
        [hcg.get_data_parallel_group(), sharding],
        device_type,
        mesh=torch.tensor(mesh),
        mesh_dim_names=("dp", "sharding"),
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
        _apply_process_settings(strategy)
        # 1. features (sync BN over the data replicas, ASP, recompute, AMP) on the plain module.
        sync_bn_group = None
        if strategy.sync_batch_norm and hcg is not None:
            sync_bn_group = dp_sharding_group(hcg)[1]
        model = wrap_model_features(model, strategy, sync_bn_group=sync_bn_group)
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
            if stage == 3:
                # FSDP2 over this stage's module, on the sharding (x dp: HSDP) mesh of this
                # pipe coordinate; after PipelineParallel broadcast the initial parameters.
                device_type = next(model.parameters()).device.type
                apply_fsdp(
                    model,
                    sharding_mesh(hcg, device_type),
                    strategy.sharding_configs.offload,
                    _fsdp_param_dtype(strategy),
                    reshard_after_forward=False,
                )  # gathered once per train_batch
            runtime.models.add(pipe)
            return pipe
        # 3b. sharding stage 3: FSDP2 shards the parameters (and reduce-scatters gradients);
        # over tensor-parallel layers it shards each rank's TP shard over the sharding mesh
        # (torchtitan's FSDP2-on-top-of-TP order).
        if stage == 3:
            device_type = next(model.parameters()).device.type
            model = _apply_stage3(
                model,
                hcg,
                device_type,
                strategy.sharding_configs.offload,
                _fsdp_param_dtype(strategy),
            )
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
        grad_clip = getattr(optimizer, "grad_clip", None)
        if grad_clip is not None:
            # The clip hook sees this rank's partition (its owned, reduced gradients): the
            # squared norms are summed over the sharding group too.
            grad_clip.sharded_partition = True
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
        grad_clip = getattr(optimizer, "grad_clip", None)
        if grad_clip is not None:
            grad_clip.sharded_partition = True  # FSDP2's gradients are sharded
    # 3. communication-efficient data parallel (the model side is DDP's comm hook).
    if strategy.dgc:
        if getattr(optimizer, "grad_clip", None) is not None:
            raise ConfigError(
                "optimizer.grad_clip (global-norm clipping) with strategy.dgc: the clip would see "
                "the exchanged sparse gradient; DGC clips each rank's local gradient instead: "
                "strategy.dgc_configs = {'local_grad_clip_norm': C}",
                key="dgc",
            )
        optimizer = DGCMomentumOptimizer(optimizer)
    elif strategy.localsgd or strategy.adaptive_localsgd:
        optimizer = build_localsgd_optimizer(optimizer, strategy, _grad_group(runtime, stage)[0])
    # 4. ASP: the 2:4 masks re-applied after every update.
    if strategy.asp:
        optimizer = asp.decorate(optimizer)
    # 5. gradient merge (a pass-through wrapper without it).
    gm_cfg = strategy.gradient_merge_configs
    grad_merge = (
        GradientMergeState(k_steps=gm_cfg.k_steps, avg=gm_cfg.avg)
        if strategy.gradient_merge and gm_cfg.k_steps > 1
        else None
    )
    wrapper = DistributedOptimizer(optimizer, grad_merge)
    runtime.optimizers.add(wrapper)
    link_gradient_merge(runtime)
    _link_dgc(runtime)
    return wrapper


def _grad_group(runtime: Any, stage: int) -> tuple[Any, int, str]:
    """``(group, size, what)`` of the ranks DDP averages gradients over (None: the world)."""
    hcg = runtime.hcg
    if hcg is None:
        return None, runtime.env.world_size, "all"
    if stage == 1:
        ranks, group = dp_sharding_group(hcg)
        return group, len(ranks), "dp x sharding"
    return hcg.get_data_parallel_group(), hcg.get_data_parallel_world_size(), "dp"


def _bucket_kwargs(strategy: DistributedStrategy) -> dict[str, Any]:
    """DDP's bucket arguments: fuse_all_reduce_ops, fuse_grad_size_in_MB, last_comm_group_size_MB."""
    if not strategy.fuse_all_reduce_ops:
        return {"bucket_cap_mb": 0}  # one bucket (one all-reduce) per parameter
    fuse, first = strategy.fuse_grad_size_in_MB, strategy.last_comm_group_size_MB
    if first < fuse:
        return {"bucket_cap_mb_list": [first, fuse]}  # the small bucket, then fuse-sized ones
    return {"bucket_cap_mb": fuse}


def _apply_ddp(model: torch.nn.Module, runtime: Any, stage: int) -> torch.nn.Module:
    strategy, hcg = runtime.strategy, runtime.hcg
    device = next(p.device for p in model.parameters() if p.requires_grad)
    device_ids = [device.index] if device.type == "cuda" else None
    group, size, what = _grad_group(runtime, stage)
    if hcg is not None and size == 1:
        # Tensor parallel alone (or stage 2 with dp 1): no replica to average with.
        return model
    buckets = _bucket_kwargs(strategy)
    dp = DataParallel(
        model,
        device_ids=device_ids,
        process_group=group,
        find_unused_parameters=strategy.find_unused_parameters,
        **buckets,
    )
    # 5. the communication hook (fp16/bf16 compression, post-local SGD, DGC), if any.
    register_comm_hook(dp, strategy, group)
    runtime.models.add(dp)
    link_gradient_merge(runtime)
    _link_dgc(runtime)
    logger.debug(
        "distributed_model: DDP over %d rank(s) (%s), buckets %s, find_unused_parameters=%s, "
        "comm hook %s",
        size,
        what,
        buckets,
        strategy.find_unused_parameters,
        type(dp.comm_hook_state).__name__,
    )
    return dp


def _link_dgc(runtime: Any) -> None:
    """Share each DGC model's hook state with the DGC optimizer that updates its parameters
    (whichever of distributed_model / distributed_optimizer came first)."""
    for opt in list(runtime.optimizers):
        dgc_opt = find_dgc_optimizer(opt)
        if dgc_opt is None:
            continue
        ids = {id(p) for g in dgc_opt.param_groups for p in g["params"]}
        for model in list(runtime.models):
            state = getattr(model, "comm_hook_state", None)
            if isinstance(state, DGCState) and any(id(p) in ids for p in model.parameters()):
                dgc_opt.attach(state)


def _apply_process_settings(strategy: DistributedStrategy) -> None:
    """Process-wide settings of the strategy, and a log line for the keys without effect."""
    if strategy.cudnn_exhaustive_search:
        torch.backends.cudnn.benchmark = True
    inert = strategy.no_op_settings()
    if inert and (not tdist.is_initialized() or tdist.get_rank() == 0):
        logger.info(
            "strategy keys with no effect on torch (see fleet.strategy.NO_OP_KEYS): %s",
            ", ".join(f"{k}={v}: {NO_OP_KEYS[k]}" for k, v in inert.items()),
        )


def _fsdp_param_dtype(strategy: DistributedStrategy) -> torch.dtype | None:
    """AMP O2 under stage 3: FSDP2 all-gathers the float32 shards (the master weights,
    partitioned with the optimizer state) as this dtype for compute; None: no cast."""
    if strategy.amp and strategy.amp_configs.use_pure_fp16:
        return torch_dtype(strategy.amp_configs.dtype)
    return None


def _apply_stage3(
    model: torch.nn.Module,
    hcg: Any,
    device_type: str,
    offload: bool,
    param_dtype: torch.dtype | None,
) -> torch.nn.Module:
    model = apply_fsdp(model, sharding_mesh(hcg, device_type), offload, param_dtype)

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
