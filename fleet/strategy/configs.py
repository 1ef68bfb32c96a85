"""The typed sections of ``fleet.DistributedStrategy`` (``amp_configs``, ``hybrid_configs``, ...).

Each section is a frozen dataclass whose field names are Paddle's ``*_configs`` keys, so a Paddle
script's ``strategy.hybrid_configs = {"dp_degree": 2}`` keeps working, but a typo or a wrong type
is a :class:`~collective.errors.ConfigError` naming the key path instead of a silently ignored
dict entry. Values are checked in ``__post_init__``; defaults are Paddle's.

Sections are immutable: :meth:`StrategySection.merged` returns a new section with some keys
changed (what ``DistributedStrategy.__setattr__`` uses). Reading ``section["key"]`` works for
Paddle familiarity; writing ``section["key"] = v`` raises and says what to do instead.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from collective.env_base import StrEnum
from collective.errors import ConfigError
from collective.typed_config import convert, require, to_dict, unknown_key_error

S = TypeVar("S", bound="StrategySection")


class AmpDtype(StrEnum):
    """Low-precision dtype of automatic mixed precision."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class PipelineSchedule(StrEnum):
    """Pipeline-parallel schedule (Paddle's ``schedule_mode``)."""

    ONE_F_ONE_B = "1F1B"
    F_THEN_B = "FThenB"


class StrategySection:
    """Behaviour shared by every section: merge, dict access, plain-data view."""

    SECTION: ClassVar[str] = ""
    """The strategy attribute this section is stored under (``"hybrid_configs"``)."""

    @classmethod
    def allowed_keys(cls) -> list[str]:
        """The section's key names, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    def merged(self: S, updates: Mapping[str, Any]) -> S:  # noqa: PYI019 - py3.10 has no Self
        """A copy with the keys of ``updates`` changed (converted and validated).

        Unknown keys, wrong types and impossible values raise ConfigError naming
        ``<section>.<key>``; keys not in ``updates`` keep their current values.
        """
        if not isinstance(updates, Mapping):
            raise ConfigError(
                f"expected a mapping of {', '.join(self.allowed_keys())}, got {updates!r}",
                key=self.SECTION,
            )
        hints = typing.get_type_hints(type(self))
        allowed = self.allowed_keys()
        changes: dict[str, Any] = {}
        for key, value in updates.items():
            if key not in allowed:
                raise unknown_key_error(str(key), allowed, self.SECTION)
            changes[key] = convert(value, hints[key], f"{self.SECTION}.{key}")
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (enums as strings, tuples as lists), ready for YAML."""
        return to_dict(self)

    def __getitem__(self, key: str) -> Any:
        if key not in self.allowed_keys():
            raise unknown_key_error(str(key), self.allowed_keys(), self.SECTION)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        raise ConfigError(
            f"strategy sections are read-only; assign a dict instead: "
            f"strategy.{self.SECTION} = {{{key!r}: {value!r}}}",
            key=f"{self.SECTION}.{key}",
        )


def _is_str_list(values: tuple[str, ...]) -> bool:
    return all(isinstance(v, str) and v for v in values)


@dataclass(frozen=True)
class AmpConfig(StrategySection):
    """``amp_configs``: automatic mixed precision and dynamic loss scaling."""

    SECTION: ClassVar[str] = "amp_configs"

    init_loss_scaling: float = 32768.0
    """Initial loss scale (> 0)."""
    incr_every_n_steps: int = 1000
    """Grow the loss scale after this many consecutive steps with finite gradients (>= 1)."""
    decr_every_n_nan_or_inf: int = 2
    """Shrink the loss scale after this many steps with inf/nan gradients (>= 1)."""
    incr_ratio: float = 2.0
    """Factor the loss scale grows by (> 1)."""
    decr_ratio: float = 0.8
    """Factor the loss scale shrinks by (strictly between 0 and 1)."""
    use_dynamic_loss_scaling: bool = True
    """Adapt the loss scale to overflows; False keeps ``init_loss_scaling`` fixed."""
    custom_white_list: tuple[str, ...] = ()
    """Op names always run in low precision (in addition to the built-in list)."""
    custom_black_list: tuple[str, ...] = ()
    """Op names always run in float32 (in addition to the built-in list)."""
    use_pure_fp16: bool = False
    """Keep the parameters themselves in low precision (O2) instead of autocasting ops (O1)."""
    dtype: AmpDtype = AmpDtype.FLOAT16
    """Low-precision dtype: ``float16`` or ``bfloat16``."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(
            self.init_loss_scaling > 0,
            f"{p}.init_loss_scaling",
            f"must be > 0, got {self.init_loss_scaling}",
        )
        require(
            self.incr_every_n_steps >= 1,
            f"{p}.incr_every_n_steps",
            f"must be >= 1, got {self.incr_every_n_steps}",
        )
        require(
            self.decr_every_n_nan_or_inf >= 1,
            f"{p}.decr_every_n_nan_or_inf",
            f"must be >= 1, got {self.decr_every_n_nan_or_inf}",
        )
        require(self.incr_ratio > 1.0, f"{p}.incr_ratio", f"must be > 1, got {self.incr_ratio}")
        require(
            0.0 < self.decr_ratio < 1.0,
            f"{p}.decr_ratio",
            f"must be strictly between 0 and 1, got {self.decr_ratio}",
        )
        require(
            _is_str_list(self.custom_white_list),
            f"{p}.custom_white_list",
            f"must be a list of op names, got {list(self.custom_white_list)}",
        )
        require(
            _is_str_list(self.custom_black_list),
            f"{p}.custom_black_list",
            f"must be a list of op names, got {list(self.custom_black_list)}",
        )
        both = sorted(set(self.custom_white_list) & set(self.custom_black_list))
        require(
            not both,
            f"{p}.custom_white_list",
            f"ops {both} are in both custom_white_list and custom_black_list; keep each in one",
        )


@dataclass(frozen=True)
class RecomputeConfig(StrategySection):
    """``recompute_configs``: activation recomputation (checkpointing)."""

    SECTION: ClassVar[str] = "recompute_configs"

    checkpoints: tuple[str, ...] = ()
    """Names of the sub-modules whose activations are recomputed in backward."""
    enable_offload: bool = False
    """Offload the kept checkpoints to host memory."""

    def __post_init__(self) -> None:
        require(
            _is_str_list(self.checkpoints),
            f"{self.SECTION}.checkpoints",
            f"must be a list of module names, got {list(self.checkpoints)}",
        )


@dataclass(frozen=True)
class GradientMergeConfig(StrategySection):
    """``gradient_merge_configs``: accumulate gradients over micro-steps before updating."""

    SECTION: ClassVar[str] = "gradient_merge_configs"

    k_steps: int = 1
    """Micro-steps per optimizer update (>= 1); 1 updates every step."""
    avg: bool = True
    """Divide the accumulated gradient by ``k_steps`` (mean) instead of keeping the sum."""

    def __post_init__(self) -> None:
        require(self.k_steps >= 1, f"{self.SECTION}.k_steps", f"must be >= 1, got {self.k_steps}")


@dataclass(frozen=True)
class ShardingConfig(StrategySection):
    """``sharding_configs``: ZeRO-style sharding of optimizer state, gradients, parameters."""

    SECTION: ClassVar[str] = "sharding_configs"

    sharding_degree: int = 8
    """Number of ranks that share one copy of the sharded state (>= 1)."""
    stage: int = 1
    """1: optimizer state, 2: + gradients, 3: + parameters."""
    offload: bool = False
    """Keep the sharded optimizer state in host memory."""
    segment_broadcast_MB: float = 32.0
    """Size of the parameter broadcast segments in MiB (> 0)."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(
            self.sharding_degree >= 1,
            f"{p}.sharding_degree",
            f"must be >= 1, got {self.sharding_degree}",
        )
        require(self.stage in (1, 2, 3), f"{p}.stage", f"must be 1, 2 or 3, got {self.stage}")
        require(
            self.segment_broadcast_MB > 0,
            f"{p}.segment_broadcast_MB",
            f"must be > 0, got {self.segment_broadcast_MB}",
        )


@dataclass(frozen=True)
class PipelineConfig(StrategySection):
    """``pipeline_configs``: pipeline parallelism."""

    SECTION: ClassVar[str] = "pipeline_configs"

    micro_batch_size: int = 1
    """Samples per micro-batch (>= 1)."""
    accumulate_steps: int = 1
    """Micro-batches per optimizer step (>= 1)."""
    schedule_mode: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    """``1F1B`` (interleave forward and backward) or ``FThenB`` (all forwards first)."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(
            self.micro_batch_size >= 1,
            f"{p}.micro_batch_size",
            f"must be >= 1, got {self.micro_batch_size}",
        )
        require(
            self.accumulate_steps >= 1,
            f"{p}.accumulate_steps",
            f"must be >= 1, got {self.accumulate_steps}",
        )


@dataclass(frozen=True)
class TensorParallelConfig(StrategySection):
    """``tensor_parallel_configs``: tensor (model) parallelism."""

    SECTION: ClassVar[str] = "tensor_parallel_configs"

    tensor_parallel_degree: int = 1
    """Ranks that split each layer (>= 1)."""
    tensor_init_seed: int = -1
    """Seed for initialising split parameters; -1 picks one."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(
            self.tensor_parallel_degree >= 1,
            f"{p}.tensor_parallel_degree",
            f"must be >= 1, got {self.tensor_parallel_degree}",
        )
        require(
            self.tensor_init_seed >= -1,
            f"{p}.tensor_init_seed",
            f"must be -1 or a seed >= 0, got {self.tensor_init_seed}",
        )


@dataclass(frozen=True)
class AutoConfig(StrategySection):
    """``auto_configs``: what ``strategy.auto`` plans for (:mod:`fleet.planner.auto`): the
    model, its sample batch and the global batch, as ``fleetrun plan`` takes them."""

    SECTION: ClassVar[str] = "auto_configs"

    model: str = ""
    """``pkg.module:function`` building the model (a layer list, an ``nn.Module``, or either
    paired with the loss); ``fleetrun plan --model``."""
    sample: str = ""
    """``pkg.module:function(batch_size)`` returning ``(inputs, labels)``; ``--sample``."""
    loss: str = ""
    """``pkg.module:function`` returning the loss, when the model function returns none
    (empty: the model function's)."""
    global_batch_size: int = 0
    """Samples per optimizer step over the whole job (>= 1 when ``auto`` is on)."""
    optimizer: str = "adamw"
    """``adamw``, ``adam``, ``momentum`` or ``sgd``: its state counts in the memory."""
    lr: float = 1e-3
    """Learning rate of the optimizer the planner's trials use (> 0)."""
    memory_per_device_MB: int = 0
    """Memory budget of one rank in MiB; 0 = the GPU's memory, or on CPU the machine's memory
    divided by the ranks of a node."""
    top: int = 1
    """Rows of the ranked table rank 0 logs at ``fleet.init`` (>= 1; 1 = the pick only)."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(
            self.global_batch_size >= 0,
            f"{p}.global_batch_size",
            f"must be >= 1 (0 = not set), got {self.global_batch_size}",
        )
        require(
            self.optimizer in ("adamw", "adam", "momentum", "sgd"),
            f"{p}.optimizer",
            f"must be adamw, adam, momentum or sgd, got {self.optimizer!r}",
        )
        require(self.lr > 0, f"{p}.lr", f"must be > 0, got {self.lr}")
        require(
            self.memory_per_device_MB >= 0,
            f"{p}.memory_per_device_MB",
            f"must be >= 0 (0 = detect), got {self.memory_per_device_MB}",
        )
        require(self.top >= 1, f"{p}.top", f"must be >= 1, got {self.top}")


@dataclass(frozen=True)
class HybridConfig(StrategySection):
    """``hybrid_configs``: the degree of every parallel axis; their product is the world size."""

    SECTION: ClassVar[str] = "hybrid_configs"

    dp_degree: int = -1
    """Data-parallel degree; -1 = whatever the other degrees leave of the world size."""
    mp_degree: int = 1
    """Tensor (model) parallel degree (>= 1)."""
    pp_degree: int = 1
    """Pipeline-parallel degree (>= 1)."""
    sharding_degree: int = 1
    """Sharding-parallel degree (>= 1)."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(
            self.dp_degree == -1 or self.dp_degree >= 1,
            f"{p}.dp_degree",
            f"must be -1 (derive from the world size) or >= 1, got {self.dp_degree}",
        )
        for name in ("mp_degree", "pp_degree", "sharding_degree"):
            value = getattr(self, name)
            require(value >= 1, f"{p}.{name}", f"must be >= 1, got {value}")

    def resolve_dp_degree(self, world_size: int) -> int:
        """The data-parallel degree for ``world_size`` ranks; ConfigError if they do not fit."""
        others = self.mp_degree * self.pp_degree * self.sharding_degree
        dp = self.dp_degree if self.dp_degree != -1 else world_size // others
        if dp < 1 or dp * others != world_size:
            raise ConfigError(
                f"dp_degree({self.dp_degree}) * mp_degree({self.mp_degree}) * "
                f"pp_degree({self.pp_degree}) * sharding_degree({self.sharding_degree}) must "
                f"equal the world size {world_size}; set dp_degree to -1 or "
                f"{max(world_size // others, 1)}",
                key=self.SECTION,
            )
        return dp


@dataclass(frozen=True)
class ASyncConfig(StrategySection):
    """``a_sync_configs``: asynchronous parameter-server training."""

    SECTION: ClassVar[str] = "a_sync_configs"

    k_steps: int = -1
    """With ``a_sync``: <= 0 asynchronous, > 0 GEO (exchange deltas every ``k_steps`` steps).
    ``a_sync=False`` is synchronous whatever this says."""
    barrier_interval: int = 0
    """Half-async: with ``a_sync`` and ``k_steps <= 0``, drain the send queue and meet the other
    trainers every this many steps (0 = fully asynchronous)."""
    max_merge_var_num: int = 1
    """Gradients merged per variable before a send (>= 1)."""
    send_queue_size: int = 16
    """Gradients queued per variable before the trainer blocks (>= 1)."""
    thread_pool_size: int = 1
    """Threads sending gradients to the servers (>= 1)."""
    launch_barrier: bool = True
    """Wait for every server to be up before training starts."""
    prefetch: bool = True
    """Async and half-async: while a batch trains, pull the sparse rows of the next one
    (``fleet.data`` iterators and ``fleet.train_from_dataset`` read one batch ahead). Sync and
    GEO ignore it. Not a Paddle key (Paddle overlaps through its ``thread_num`` workers)."""
    use_ps_gpu: bool = False
    """PS-GPU mode: every ``DistributedEmbedding`` trains each pass against a trainer-local
    copy of the pass's rows, on CUDA when available (:mod:`fleet.ps.pass_cache`)."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(
            self.k_steps >= -1,
            f"{p}.k_steps",
            f"must be -1 or 0 (async) or > 0 (GEO), got {self.k_steps}",
        )
        require(
            self.barrier_interval >= 0,
            f"{p}.barrier_interval",
            f"must be >= 0, got {self.barrier_interval}",
        )
        for name in ("max_merge_var_num", "send_queue_size", "thread_pool_size"):
            value = getattr(self, name)
            require(value >= 1, f"{p}.{name}", f"must be >= 1, got {value}")


@dataclass(frozen=True)
class LarsConfig(StrategySection):
    """``lars_configs``: layer-wise adaptive rate scaling (LARS) momentum."""

    SECTION: ClassVar[str] = "lars_configs"

    lars_coeff: float = 0.001
    """Trust coefficient (> 0)."""
    lars_weight_decay: float = 0.0005
    """Weight decay applied inside LARS (>= 0)."""
    epsilon: float = 0.0
    """Added to the denominator of the trust ratio (>= 0)."""
    exclude_from_weight_decay: tuple[str, ...] = ()
    """Parameter-name substrings exempt from weight decay (e.g. ``bias``, ``norm``)."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(self.lars_coeff > 0, f"{p}.lars_coeff", f"must be > 0, got {self.lars_coeff}")
        require(
            self.lars_weight_decay >= 0,
            f"{p}.lars_weight_decay",
            f"must be >= 0, got {self.lars_weight_decay}",
        )
        require(self.epsilon >= 0, f"{p}.epsilon", f"must be >= 0, got {self.epsilon}")


@dataclass(frozen=True)
class LambConfig(StrategySection):
    """``lamb_configs``: the LAMB optimizer."""

    SECTION: ClassVar[str] = "lamb_configs"

    lamb_weight_decay: float = 0.01
    """Decoupled weight decay (>= 0)."""
    exclude_from_weight_decay: tuple[str, ...] = ()
    """Parameter-name substrings exempt from weight decay."""

    def __post_init__(self) -> None:
        require(
            self.lamb_weight_decay >= 0,
            f"{self.SECTION}.lamb_weight_decay",
            f"must be >= 0, got {self.lamb_weight_decay}",
        )


@dataclass(frozen=True)
class FP16AllReduceConfig(StrategySection):
    """``fp16_allreduce_configs``: the dtype gradients travel in under ``fp16_allreduce``.

    Not a Paddle section: Paddle's ``fp16_allreduce`` is float16 only. One switch with a dtype
    (as ``amp_configs.dtype``) rather than a second ``bf16_allreduce`` key, so the two can never
    both be on."""

    SECTION: ClassVar[str] = "fp16_allreduce_configs"

    dtype: AmpDtype = AmpDtype.FLOAT16
    """``float16`` (torch's ``fp16_compress_hook``) or ``bfloat16`` (``bf16_compress_hook``: the
    float32 exponent range, so no overflow of large gradients; NCCL >= 2.9.6 on GPUs)."""


@dataclass(frozen=True)
class LocalSGDConfig(StrategySection):
    """``localsgd_configs``: local SGD — every rank steps on its own gradients and the models are
    averaged every ``k_steps`` steps."""

    SECTION: ClassVar[str] = "localsgd_configs"

    k_steps: int = 1
    """Steps between two parameter averagings after the warm-up (>= 1)."""
    begin_step: int = 1
    """Steps of ordinary data parallel (gradients all-reduced every step) before local SGD starts
    (>= 0)."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(
            self.k_steps >= 1,
            f"{p}.k_steps",
            f"must be >= 1 (steps between averagings), got {self.k_steps}",
        )
        require(
            self.begin_step >= 0,
            f"{p}.begin_step",
            f"must be >= 0 (warm-up steps), got {self.begin_step}",
        )


ADAPTIVE_LOCALSGD_MAX_K_STEPS = 16
"""Upper bound of the adaptive averaging interval (Paddle's ``max_local_steps``)."""


@dataclass(frozen=True)
class AdaptiveLocalSGDConfig(StrategySection):
    """``adaptive_localsgd_configs``: local SGD whose averaging interval follows the loss."""

    SECTION: ClassVar[str] = "adaptive_localsgd_configs"

    init_k_steps: int = 1
    """The interval the rule scales from (1 .. 16)."""
    begin_step: int = 1
    """Steps of ordinary data parallel before local SGD starts (>= 0)."""

    def __post_init__(self) -> None:
        p = self.SECTION
        top = ADAPTIVE_LOCALSGD_MAX_K_STEPS
        require(
            1 <= self.init_k_steps <= top,
            f"{p}.init_k_steps",
            f"must be between 1 and {top}, got {self.init_k_steps}",
        )
        require(
            self.begin_step >= 0,
            f"{p}.begin_step",
            f"must be >= 0 (warm-up steps), got {self.begin_step}",
        )


@dataclass(frozen=True)
class DGCConfig(StrategySection):
    """``dgc_configs``: Deep Gradient Compression (Lin et al., 2018)."""

    SECTION: ClassVar[str] = "dgc_configs"

    rampup_begin_step: int = 0
    """Steps of dense all-reduce (with the optimizer's own momentum) before compression starts
    (>= 0)."""
    rampup_step: int = 1
    """Steps over which ``sparsity`` is walked through once compression started (>= 1): step
    ``t`` after the start uses ``sparsity[min(t * len(sparsity) // rampup_step, len - 1)]``."""
    sparsity: tuple[float, ...] = (0.999,)
    """The sparsity warm-up schedule: fraction of each gradient *not* sent, each in [0, 1)
    (Paddle's example: ``[0.75, 0.9375, 0.984375, 0.996, 0.999]``)."""
    local_grad_clip_norm: float = 0.0
    """Not in Paddle's ``dgc_configs`` (Paddle takes it from the optimizer's
    ``GradientClipByNorm``): clip each compressed tensor's local gradient to
    ``local_grad_clip_norm * sqrt(world_size)`` before accumulation (the paper's local gradient
    clipping for averaged gradients); 0 = off."""

    def __post_init__(self) -> None:
        p = self.SECTION
        require(
            self.rampup_begin_step >= 0,
            f"{p}.rampup_begin_step",
            f"must be >= 0, got {self.rampup_begin_step}",
        )
        require(self.rampup_step >= 1, f"{p}.rampup_step", f"must be >= 1, got {self.rampup_step}")
        require(
            len(self.sparsity) > 0, f"{p}.sparsity", "must list at least one sparsity, e.g. [0.999]"
        )
        bad = [s for s in self.sparsity if not 0.0 <= s < 1.0]
        require(
            not bad,
            f"{p}.sparsity",
            f"every value must be in [0, 1) (the fraction not sent), got {bad}",
        )
        require(
            self.local_grad_clip_norm >= 0,
            f"{p}.local_grad_clip_norm",
            f"must be >= 0 (0 = no clipping), got {self.local_grad_clip_norm}",
        )


__all__ = [
    "ADAPTIVE_LOCALSGD_MAX_K_STEPS",
    "ASyncConfig",
    "AdaptiveLocalSGDConfig",
    "AmpConfig",
    "AmpDtype",
    "AutoConfig",
    "DGCConfig",
    "FP16AllReduceConfig",
    "GradientMergeConfig",
    "HybridConfig",
    "LambConfig",
    "LarsConfig",
    "LocalSGDConfig",
    "PipelineConfig",
    "PipelineSchedule",
    "RecomputeConfig",
    "ShardingConfig",
    "StrategySection",
    "TensorParallelConfig",
]
