"""``fleet.DistributedStrategy``: every distributed-training switch, typed, loadable from YAML.

Paddle's key names, Paddle's way of setting them, but checked::

    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 4, "avg": True}   # merged into the section
    strategy.hybrid_configs = {"dp_degre": 2}   # ConfigError: hybrid_configs.dp_degre: unknown key

Switches (``amp``, ``recompute``, ...) are booleans; their settings live in a frozen section
dataclass (``amp_configs`` → :class:`~fleet.strategy.configs.AmpConfig`). Assigning a dict to a
section merges it into the current section; assigning an unknown attribute, a wrong type or an
impossible value raises :class:`~collective.errors.ConfigError` naming the key path.

Whether a switch is *implemented* is not this module's business: :mod:`fleet.base.runtime` refuses
strategies that ask for features that have not landed. Standard library + PyYAML only.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collective.errors import ConfigError
from collective.typed_config import convert, from_dict, unknown_key_error
from fleet.strategy.configs import (
    AdaptiveLocalSGDConfig,
    AmpConfig,
    ASyncConfig,
    AutoConfig,
    DGCConfig,
    FP16AllReduceConfig,
    GradientMergeConfig,
    HybridConfig,
    LambConfig,
    LarsConfig,
    LocalSGDConfig,
    PipelineConfig,
    RecomputeConfig,
    ShardingConfig,
    StrategySection,
    TensorParallelConfig,
)
from fleet.strategy.heter_config import HeterConfig


@dataclass(repr=False)
class DistributedStrategy:
    """All distributed-training settings of a job (Paddle's ``fleet.DistributedStrategy``).

    Construct with keywords (``DistributedStrategy(gradient_merge=True)``), set attributes, or load
    with :meth:`from_dict` / :meth:`from_yaml`. ``str(strategy)`` is a table of the settings that
    differ from the defaults.
    """

    amp: bool = False
    """Automatic mixed precision; settings in ``amp_configs``."""
    amp_configs: AmpConfig = field(default_factory=AmpConfig)
    """Loss scaling and op lists of AMP."""
    recompute: bool = False
    """Recompute activations in backward instead of keeping them; see ``recompute_configs``."""
    recompute_configs: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Which sub-modules are recomputed."""
    gradient_merge: bool = False
    """Accumulate gradients over ``gradient_merge_configs.k_steps`` steps before each update."""
    gradient_merge_configs: GradientMergeConfig = field(default_factory=GradientMergeConfig)
    """Micro-steps per update and whether to average."""
    sharding: bool = False
    """ZeRO-style sharding of optimizer state/gradients/parameters; see ``sharding_configs``."""
    sharding_configs: ShardingConfig = field(default_factory=ShardingConfig)
    """Sharding degree, stage and offload."""
    pipeline: bool = False
    """Pipeline parallelism; settings in ``pipeline_configs``."""
    pipeline_configs: PipelineConfig = field(default_factory=PipelineConfig)
    """Micro-batching and schedule of the pipeline."""
    tensor_parallel: bool = False
    """Tensor (model) parallelism; settings in ``tensor_parallel_configs``."""
    tensor_parallel_configs: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    """Tensor-parallel degree and seed."""
    hybrid_configs: HybridConfig = field(default_factory=HybridConfig)
    """Degrees of the data/tensor/pipeline/sharding axes (product = world size)."""
    a_sync: bool = False
    """Asynchronous parameter-server training (PS mode only). Paddle defaults this to True, but
    it only has meaning in PS mode; here it is off unless asked for."""
    a_sync_configs: ASyncConfig = field(default_factory=ASyncConfig)
    """Async/GEO settings of PS training."""
    heter_configs: HeterConfig = field(default_factory=HeterConfig)
    """Heterogeneous PS jobs (CPU trainers + heter workers): the staleness bound and the
    recovery window (:mod:`fleet.heter`)."""
    lars: bool = False
    """Wrap a Momentum optimizer into LARS; settings in ``lars_configs``."""
    lars_configs: LarsConfig = field(default_factory=LarsConfig)
    """LARS coefficients."""
    lamb: bool = False
    """Wrap an Adam optimizer into LAMB; settings in ``lamb_configs``."""
    lamb_configs: LambConfig = field(default_factory=LambConfig)
    """LAMB weight decay."""
    find_unused_parameters: bool = False
    """Let data parallel handle parameters that get no gradient in some steps (costs a graph walk
    per step; torch DDP's ``find_unused_parameters``)."""
    fuse_grad_size_in_MB: int = 32
    """Gradients are all-reduced in buckets of this many MiB (DDP's ``bucket_cap_mb``, >= 1)."""
    fuse_all_reduce_ops: bool = True
    """Fuse gradients into buckets for the all-reduce; False all-reduces every gradient on its
    own (DDP with ``bucket_cap_mb=0``: one bucket per parameter)."""
    last_comm_group_size_MB: float = 1.0
    """Size in MiB of the small extra bucket (> 0): DDP's first bucket (``bucket_cap_mb_list =
    [last_comm_group_size_MB, fuse_grad_size_in_MB]``). Paddle puts the small group at the end
    of backward; torch, after its first-iteration bucket rebuild, at the start (the gradients
    ready first), so communication begins sooner — the same aim, the other end."""
    sync_batch_norm: bool = False
    """Batch-norm statistics over every data-parallel replica: BatchNorm layers become
    ``SyncBatchNorm`` over the data-parallel group."""
    fp16_allreduce: bool = False
    """All-reduce gradients in half precision and apply them in float32 (torch DDP's
    ``fp16_compress_hook`` / ``bf16_compress_hook``); dtype in ``fp16_allreduce_configs``."""
    fp16_allreduce_configs: FP16AllReduceConfig = field(default_factory=FP16AllReduceConfig)
    """The half-precision dtype gradients travel in (ours; Paddle's is float16 only)."""
    localsgd: bool = False
    """Local SGD: ranks step on local gradients and average the models every ``k_steps`` steps
    (torch's ``post_localSGD_hook`` + ``PostLocalSGDOptimizer``); see ``localsgd_configs``."""
    localsgd_configs: LocalSGDConfig = field(default_factory=LocalSGDConfig)
    """Averaging interval and warm-up of local SGD."""
    adaptive_localsgd: bool = False
    """Local SGD whose averaging interval follows the training loss (Paddle's rule); the loss
    reaches the optimizer by ``opt.step(closure)`` or ``opt.set_loss(loss)``."""
    adaptive_localsgd_configs: AdaptiveLocalSGDConfig = field(
        default_factory=AdaptiveLocalSGDConfig
    )
    """Initial interval and warm-up of adaptive local SGD."""
    dgc: bool = False
    """Deep Gradient Compression: momentum-corrected top-k gradients exchanged sparsely (momentum
    SGD only); see ``dgc_configs``."""
    dgc_configs: DGCConfig = field(default_factory=DGCConfig)
    """Warm-up and sparsity schedule of DGC."""
    asp: bool = False
    """Automatic 2:4 structured sparsity: eligible Linear/Conv weights pruned to 2 of every 4
    along the input dimension at ``distributed_model``, kept sparse after every optimizer step."""
    cudnn_exhaustive_search: bool = False
    """Benchmark the cuDNN convolution algorithms and keep the fastest (True sets
    ``torch.backends.cudnn.benchmark``; False leaves torch's setting alone)."""
    auto: bool = False
    """Let the planner choose the hybrid configuration at ``fleet.init`` (degrees, sharding
    stage, micro-batching, recompute) from ``auto_configs``: the plan ``fleetrun plan`` cached
    for the same model and job shape, else a calibration and search on the spot. Refused with
    hybrid degrees set by hand."""
    auto_configs: AutoConfig = field(default_factory=AutoConfig)
    """The model, sample and global batch ``auto`` plans for."""
    # ---- accepted for Paddle scripts, no effect on torch (reasons in NO_OP_KEYS) ----
    sync_nccl_allreduce: bool = True
    """No effect (see :data:`NO_OP_KEYS`)."""
    nccl_comm_num: int = 1
    """No effect (see :data:`NO_OP_KEYS`); >= 1."""
    use_hierarchical_allreduce: bool = False
    """No effect (see :data:`NO_OP_KEYS`)."""
    hierarchical_allreduce_inter_nranks: int = 1
    """No effect (see :data:`NO_OP_KEYS`); >= 1."""
    without_graph_optimization: bool = False
    """No effect (see :data:`NO_OP_KEYS`)."""
    fuse_grad_size_in_num: int = 8
    """No effect (see :data:`NO_OP_KEYS`); >= 1."""
    fuse_grad_merge: bool = False
    """No effect (see :data:`NO_OP_KEYS`)."""
    conv_workspace_size_limit: int = 512
    """No effect (see :data:`NO_OP_KEYS`); MiB, >= 0."""
    cudnn_batchnorm_spatial_persistent: bool = False
    """No effect (see :data:`NO_OP_KEYS`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        hints = _hints()
        if name not in hints:
            owners = [k for k, tp in hints.items() if _is_section(tp) and name in tp.allowed_keys()]
            if owners:
                raise ConfigError(
                    f"unknown key; it belongs to {owners[0]}: strategy.{owners[0]} = "
                    f"{{{name!r}: {value!r}}}",
                    key=name,
                )
            raise unknown_key_error(name, list(hints), "")
        tp = hints[name]
        if _is_section(tp):
            if isinstance(value, tp):
                pass
            elif isinstance(value, Mapping):
                # Paddle semantics: a dict updates the given keys of the current section.
                current = self.__dict__.get(name) or tp()
                value = current.merged(value)
            else:
                raise ConfigError(
                    f"expected a dict of {', '.join(tp.allowed_keys())} (or a {tp.__name__}), "
                    f"got {type(value).__name__} {value!r}",
                    key=name,
                )
        else:
            value = convert(value, tp, name)
        check = _SCALAR_CHECKS.get(name)
        if check is not None and not check[0](value):
            raise ConfigError(f"{check[1]}, got {value}", key=name)
        object.__setattr__(self, name, value)

    # ---- construction and export -------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> DistributedStrategy:
        """Build a strategy from plain data (the shape :meth:`to_dict` returns); missing keys keep
        their defaults. Unknown keys and bad values raise ConfigError with the key path."""
        return from_dict(cls, data or {})

    @classmethod
    def from_yaml(cls, path: str | Path) -> DistributedStrategy:
        """Load a strategy from a YAML file: the mapping of :meth:`to_dict`, optionally nested under
        a top-level ``strategy:`` key (so a job spec's strategy section can be shared)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"cannot read strategy file {str(path)!r}: {err}") from None
        import yaml  # lazy: `import fleet` stays light; only strategy files need YAML

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"strategy file {str(path)!r} is not valid YAML: {err}") from None
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"strategy file {str(path)!r} must hold a mapping of strategy keys, "
                f"got {type(data).__name__}"
            )
        if set(data) == {"strategy"}:
            data = data["strategy"] or {}
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Every setting as plain data (sections as dicts, enums as strings)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, StrategySection) else value
        return out

    def to_yaml(self) -> str:
        """:meth:`to_dict` as a YAML document (loadable by :meth:`from_yaml`)."""
        import yaml  # lazy, as in from_yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ---- display -----------------------------------------------------------------------------

    def non_default_settings(self) -> dict[str, Any]:
        """Flattened ``{"section.key": value}`` of the settings that differ from the defaults."""
        mine = _flatten(self.to_dict())
        default = _flatten(DistributedStrategy().to_dict())
        return {k: v for k, v in mine.items() if default.get(k) != v}

    def no_op_settings(self) -> dict[str, Any]:
        """``{key: value}`` of the keys of :data:`NO_OP_KEYS` set to something other than their
        default (accepted, no effect on torch; ``fleet.distributed_model`` logs them once)."""
        default = DistributedStrategy()
        return {k: getattr(self, k) for k in NO_OP_KEYS if getattr(self, k) != getattr(default, k)}

    def __str__(self) -> str:
        rows = self.non_default_settings()
        if not rows:
            return "DistributedStrategy: all settings at their defaults (pure data parallel)"
        width = max(len("setting"), *(len(k) for k in rows))
        lines = [
            "DistributedStrategy (settings that differ from the defaults):",
            f"  {'setting':<{width}}  value",
            f"  {'-' * width}  {'-' * 5}",
        ]
        lines += [f"  {k:<{width}}  {_fmt(v)}" for k, v in rows.items()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={_fmt(v)}" for k, v in self.non_default_settings().items())
        return f"DistributedStrategy({items})"


NO_OP_KEYS: dict[str, str] = {
    "sync_nccl_allreduce": "Paddle synchronises its compute stream after each all-reduce; torch "
    "DDP orders its communication stream against the compute stream itself",
    "nccl_comm_num": "Paddle opens several NCCL communicators per group; torch keeps one per "
    "process group and NCCL picks its own channels",
    "use_hierarchical_allreduce": "NCCL already runs a topology-aware (intra-node, then "
    "inter-node) all-reduce; torch has no separate hierarchical mode for DDP",
    "hierarchical_allreduce_inter_nranks": "only read with use_hierarchical_allreduce (no "
    "effect, above)",
    "without_graph_optimization": "switches off Paddle's static-graph passes; fleet runs torch "
    "eager modules, there is no graph to optimise",
    "fuse_grad_size_in_num": "Paddle fuses gradients by count in its static graph; DDP buckets "
    "by size (fuse_grad_size_in_MB)",
    "fuse_grad_merge": "Paddle fuses the gradient-merge buffers of its static graph; DDP already "
    "accumulates into its buckets' gradient tensors",
    "conv_workspace_size_limit": "torch chooses cuDNN workspaces itself and has no limit knob",
    "cudnn_batchnorm_spatial_persistent": "torch picks cuDNN's persistent batch-norm mode "
    "itself where it applies",
}
"""Paddle strategy keys accepted (so Paddle scripts and YAML run unchanged) that have no effect
on torch, each with the reason. An unknown key is still an error."""

_SCALAR_CHECKS: dict[str, tuple[Any, str]] = {
    "fuse_grad_size_in_MB": (lambda v: v >= 1, "must be >= 1 (MiB)"),
    "last_comm_group_size_MB": (lambda v: v > 0, "must be > 0 (MiB)"),
    "nccl_comm_num": (lambda v: v >= 1, "must be >= 1"),
    "hierarchical_allreduce_inter_nranks": (lambda v: v >= 1, "must be >= 1"),
    "fuse_grad_size_in_num": (lambda v: v >= 1, "must be >= 1"),
    "conv_workspace_size_limit": (lambda v: v >= 0, "must be >= 0 (MiB)"),
}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, StrategySection)


def _hints() -> dict[str, Any]:
    global _HINTS
    if _HINTS is None:
        names = {f.name for f in dataclasses.fields(DistributedStrategy)}
        _HINTS = {k: v for k, v in typing.get_type_hints(DistributedStrategy).items() if k in names}
    return _HINTS


_HINTS: dict[str, Any] | None = None


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


__all__ = ["NO_OP_KEYS", "DistributedStrategy"]
