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

import yaml

from collective.errors import ConfigError
from collective.typed_config import convert, from_dict, unknown_key_error
from fleet.strategy.configs import (
    AmpConfig,
    ASyncConfig,
    GradientMergeConfig,
    HybridConfig,
    LambConfig,
    LarsConfig,
    PipelineConfig,
    RecomputeConfig,
    ShardingConfig,
    StrategySection,
    TensorParallelConfig,
)


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
        if name == "fuse_grad_size_in_MB" and value < 1:
            raise ConfigError(f"must be >= 1 (MiB), got {value}", key=name)
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
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ---- display -----------------------------------------------------------------------------

    def non_default_settings(self) -> dict[str, Any]:
        """Flattened ``{"section.key": value}`` of the settings that differ from the defaults."""
        mine = _flatten(self.to_dict())
        default = _flatten(DistributedStrategy().to_dict())
        return {k: v for k, v in mine.items() if default.get(k) != v}

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


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, StrategySection)


def _hints() -> dict[str, Any]:
    global _HINTS
    if _HINTS is None:
        names = {f.name for f in dataclasses.fields(DistributedStrategy)}
        _HINTS = {
            k: v for k, v in typing.get_type_hints(DistributedStrategy).items() if k in names
        }
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


__all__ = ["DistributedStrategy"]
