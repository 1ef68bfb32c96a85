"""A model described as a list of layers, cut into pipeline stages: Paddle's ``LayerDesc``,
``SharedLayerDesc`` and ``PipelineLayer``.

::

    descs = [
        SharedLayerDesc("embed", nn.Embedding, None, "weight", vocab, hidden),
        *[LayerDesc(Block, hidden) for _ in range(8)],
        SharedLayerDesc("embed", nn.Embedding, tied_logits, "weight", vocab, hidden),
    ]
    pipe = PipelineLayer(descs, num_stages=2, loss_fn=nn.CrossEntropyLoss())

Every entry of ``layers`` is a :class:`LayerDesc` (built lazily: a stage constructs only the
layers it runs, so a model too large for one process is never materialised anywhere), a
:class:`SharedLayerDesc` (one module per ``key`` per stage; stages that hold the same key keep
its ``shared_weight_attr`` equal: broadcast from the first holder at construction, gradients
summed over the holders by :class:`~fleet.meta_parallel.pipeline_parallel.PipelineParallel`;
the parameter's ``is_firstly_shared`` is True only on the first holder, as in Paddle),
a ready ``nn.Module`` (it exists on every stage; only the owning stage registers and runs it),
or any callable (e.g. ``lambda x: x.flatten(1)``).

Segmentation (``seg_method``): ``"uniform"`` gives every stage the same number of entries (the
first ``n % num_stages`` stages one more); ``"layer:<Regex>"`` balances the entries whose class
name matches the regex (e.g. ``"layer:Block"``): stage ``i`` starts at the matching entry
``i * k / num_stages`` (the first stage at entry 0, the last runs to the end), so embeddings and
heads stay with their neighbouring blocks.

Parameter names are ``<global index>.<name>`` (``"3.weight"``) and
``shared_layers.<key>.<name>``, the same on every stage and in a single-stage PipelineLayer, so
a stage's ``state_dict`` is a subset of the whole model's (which is how the parity tests load
the reference weights).

``recompute_interval = N > 0`` runs every N consecutive entries of a stage under activation
checkpointing (:func:`fleet.meta_parallel.recompute.recompute`, torch's non-reentrant checkpoint
that also keeps the tensor-parallel RNG tracker's states).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from collective.errors import ConfigError
from fleet.base.runtime import current_runtime
from fleet.meta_parallel.recompute import recompute

logger = logging.getLogger(__name__)


class LayerDesc:
    """A layer to build later: ``layer_cls(*args, **kwargs)`` on the stage that runs it."""

    def __init__(self, layer_cls: type[nn.Module], *args: Any, **kwargs: Any) -> None:
        if not (isinstance(layer_cls, type) and issubclass(layer_cls, nn.Module)):
            raise ConfigError(
                f"LayerDesc needs an nn.Module subclass, got {layer_cls!r}; wrap functions "
                "directly in the layer list instead",
                key="layer_cls",
            )
        self.layer_cls = layer_cls
        self.args = args
        self.kwargs = kwargs

    def build_layer(self) -> nn.Module:
        """Construct the module (uses torch's global RNG as the class's own init does)."""
        return self.layer_cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layer_cls.__name__})"


class SharedLayerDesc(LayerDesc):
    """A layer whose ``shared_weight_attr`` parameter is tied across every entry with ``key``.

    On one stage all entries with the same key are one module; ``forward_func(module, x)``
    (default: ``module(x)``) lets an entry use the module differently, e.g. the unembedding
    ``lambda emb, h: h @ emb.weight.t()``.
    """

    def __init__(
        self,
        key: str,
        layer_cls: type[nn.Module],
        forward_func: Callable[..., Any] | None = None,
        shared_weight_attr: str = "weight",
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(layer_cls, *args, **kwargs)
        if not isinstance(key, str) or not key:
            raise ConfigError(
                f"SharedLayerDesc needs a non-empty string key, got {key!r}", key="key"
            )
        self.layer_name = key
        self.forward_func = forward_func
        self.shared_weight_attr = shared_weight_attr

    def __repr__(self) -> str:
        return f"SharedLayerDesc({self.layer_name!r}, {self.layer_cls.__name__})"


def _entry_name(entry: Any) -> str:
    if isinstance(entry, LayerDesc):
        return entry.layer_cls.__name__
    if isinstance(entry, nn.Module):
        return type(entry).__name__
    return getattr(entry, "__name__", type(entry).__name__)


def segment_layers(entries: Sequence[Any], num_stages: int, seg_method: str) -> list[int]:
    """Stage boundaries: ``num_stages + 1`` indices, stage ``i`` runs ``[b[i], b[i+1])``."""
    n = len(entries)
    if n < num_stages:
        raise ConfigError(
            f"{n} layer(s) cannot fill {num_stages} pipeline stages; give at least one layer per "
            "stage or lower pp_degree",
            key="layers",
        )
    if seg_method == "uniform":
        base, extra = divmod(n, num_stages)
        bounds = [0]
        for stage in range(num_stages):
            bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
        return bounds
    if seg_method.startswith("layer:"):
        pattern = seg_method[len("layer:") :]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise ConfigError(
                f"seg_method regex {pattern!r} is invalid: {exc}", key="seg_method"
            ) from exc
        hits = [i for i, e in enumerate(entries) if regex.search(_entry_name(e))]
        if len(hits) < num_stages:
            names = sorted({_entry_name(e) for e in entries})
            raise ConfigError(
                f"seg_method {seg_method!r} matches {len(hits)} layer(s) but there are "
                f"{num_stages} stages; layer class names are {names}",
                key="seg_method",
            )
        bounds = [0]
        for stage in range(1, num_stages):
            bounds.append(hits[stage * len(hits) // num_stages])
        bounds.append(n)
        return bounds
    raise ConfigError(
        f"seg_method {seg_method!r} is unknown; use 'uniform' or 'layer:<Regex>' (a class-name "
        "pattern such as 'layer:Block')",
        key="seg_method",
    )


def _stage_from_context(num_stages: int | None, topology: Any) -> tuple[int, int, Any]:
    """(num_stages, stage_id, topology) from the topology, fleet's hybrid group or the world."""
    if topology is None:
        runtime = current_runtime()
        if runtime is not None and runtime.hcg is not None:
            topology = runtime.hcg.topology()
    if topology is not None:
        stages = topology.get_dim("pipe")
        if num_stages is not None and num_stages != stages:
            raise ConfigError(
                f"num_stages={num_stages} but the topology has pp_degree={stages}; leave "
                "num_stages unset or make them agree",
                key="num_stages",
            )
        rank = tdist.get_rank() if tdist.is_initialized() else 0
        return stages, topology.get_coord(rank)["pipe"], topology
    if num_stages is None:
        raise ConfigError(
            "PipelineLayer needs num_stages= or topology= (or fleet.init with "
            "hybrid_configs.pp_degree)",
            key="num_stages",
        )
    if num_stages == 1:
        return 1, 0, None
    if not tdist.is_initialized() or tdist.get_world_size() != num_stages:
        raise ConfigError(
            f"num_stages={num_stages} without a topology needs a process group of exactly "
            f"{num_stages} ranks (one per stage); pass topology=hcg.topology() or stage_id=",
            key="num_stages",
        )
    return num_stages, tdist.get_rank(), None


class PipelineLayer(nn.Module):
    """This stage's share of a layer-list model (see the module docstring).

    ``loss_fn(output, label)`` is applied on the last stage by the pipeline engine (and by
    :meth:`forward` callers themselves). ``stage_id`` overrides the stage this process builds
    (tests, tools); normally it comes from ``topology`` (a
    :class:`~fleet.base.topology.CommunicateTopology`), fleet's hybrid group, or the rank.
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seg_method: str = "uniform",
        recompute_interval: int = 0,
        stage_id: int | None = None,
    ) -> None:
        super().__init__()
        entries = list(layers)
        for i, entry in enumerate(entries):
            if not (isinstance(entry, (LayerDesc, nn.Module)) or callable(entry)):
                raise ConfigError(
                    f"layers[{i}] is {entry!r}; entries must be LayerDesc, SharedLayerDesc, "
                    "nn.Module or a callable",
                    key="layers",
                )
        if recompute_interval < 0:
            raise ConfigError(
                f"recompute_interval must be >= 0, got {recompute_interval}",
                key="recompute_interval",
            )
        if stage_id is None:
            num_stages, stage_id, topology = _stage_from_context(num_stages, topology)
        elif num_stages is None or not 0 <= stage_id < num_stages:
            raise ConfigError(
                f"stage_id={stage_id} needs num_stages > stage_id, got num_stages={num_stages}",
                key="stage_id",
            )
        self._topo = topology
        self._num_stages = num_stages
        self._stage_id = stage_id
        self._loss_fn = loss_fn
        self._recompute_interval = recompute_interval
        self._entries = entries
        self.segment_parts = segment_layers(entries, num_stages, seg_method)
        self._start = self.segment_parts[stage_id]
        self._end = self.segment_parts[stage_id + 1]
        self.shared_layers = nn.ModuleDict()
        self.shared_weight_attrs: dict[str, str] = {}
        self.run_function: list[Callable[..., Any]] = []
        self._build()
        holders = self.shared_stage_map()
        for key in self.shared_layers:
            # Paddle's flag: False on the stages holding a copy of a tied weight after the first,
            # so norms (gradient clipping) can count each tied weight once.
            self.shared_parameter(key).is_firstly_shared = holders[key][0] == stage_id
        logger.debug(
            "pipeline stage %d/%d runs layers [%d, %d)",
            stage_id,
            num_stages,
            self._start,
            self._end,
        )

    # construction ----------------------------------------------------------------------------
    def _build(self) -> None:
        for index in range(self._start, self._end):
            entry = self._entries[index]
            if isinstance(entry, SharedLayerDesc):
                key = entry.layer_name
                if key not in self.shared_layers:
                    self.shared_layers[key] = entry.build_layer()
                    self.shared_weight_attrs[key] = entry.shared_weight_attr
                module = self.shared_layers[key]
                if entry.forward_func is None:
                    self.run_function.append(module)
                else:
                    self.run_function.append(_bind(entry.forward_func, module))
            elif isinstance(entry, LayerDesc):
                module = entry.build_layer()
                self.add_module(str(index), module)
                self.run_function.append(module)
            elif isinstance(entry, nn.Module):
                self.add_module(str(index), entry)
                self.run_function.append(entry)
            else:
                self.run_function.append(entry)

    def shared_stage_map(self) -> dict[str, list[int]]:
        """For every SharedLayerDesc key: the stages that hold it (ascending)."""
        stages: dict[str, list[int]] = {}
        for stage in range(self._num_stages):
            lo, hi = self.segment_parts[stage], self.segment_parts[stage + 1]
            for entry in self._entries[lo:hi]:
                if isinstance(entry, SharedLayerDesc):
                    held = stages.setdefault(entry.layer_name, [])
                    if stage not in held:
                        held.append(stage)
        return stages

    def shared_parameter(self, key: str) -> nn.Parameter:
        """The tied parameter of shared layer ``key`` on this stage."""
        return getattr(self.shared_layers[key], self.shared_weight_attrs[key])

    # queries -----------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return self._num_stages

    @property
    def stage_id(self) -> int:
        """The stage this process runs."""
        return self._stage_id

    @property
    def loss_fn(self) -> Callable[..., torch.Tensor] | None:
        """The loss the last stage applies (``loss_fn(output, label)``)."""
        return self._loss_fn

    def topology(self) -> Any:
        """The CommunicateTopology this layer was cut for (None without one)."""
        return self._topo

    def stage_layer_range(self) -> tuple[int, int]:
        """``[start, end)`` of the global entry indices this stage runs."""
        return self._start, self._end

    def is_first_stage(self) -> bool:
        """True on stage 0."""
        return self._stage_id == 0

    def is_last_stage(self) -> bool:
        """True on the last stage."""
        return self._stage_id == self._num_stages - 1

    @property
    def recompute_interval(self) -> int:
        """Entries run under one activation checkpoint (0: none); ``strategy.recompute``
        without ``checkpoints`` sets 0 to 1 at ``fleet.distributed_model``."""
        return self._recompute_interval

    @recompute_interval.setter
    def recompute_interval(self, value: int) -> None:
        if value < 0:
            raise ConfigError(
                f"recompute_interval must be >= 0, got {value}", key="recompute_interval"
            )
        self._recompute_interval = value

    # forward -----------------------------------------------------------------------------------
    def forward(self, x: Any) -> Any:
        """Run this stage's entries in order (tuples are passed on as one argument)."""
        funcs = self.run_function
        interval = self._recompute_interval
        if interval <= 0 or not torch.is_grad_enabled():
            return _run(funcs, x)
        checkpoint = _checkpoint_fn()
        for lo in range(0, len(funcs), interval):
            chunk = funcs[lo : lo + interval]
            if isinstance(x, tuple):
                x = checkpoint(lambda *xs, c=chunk: _run(c, xs), *x)
            else:
                x = checkpoint(lambda t, c=chunk: _run(c, t), x)
        return x

    def extra_repr(self) -> str:
        return (
            f"stage={self._stage_id}/{self._num_stages}, layers=[{self._start}, {self._end}), "
            f"recompute_interval={self._recompute_interval}"
        )


def _bind(func: Callable[..., Any], module: nn.Module) -> Callable[[Any], Any]:
    def shared_forward(x: Any) -> Any:
        return func(module, x)

    return shared_forward


def _run(funcs: Sequence[Callable[..., Any]], x: Any) -> Any:
    for func in funcs:
        x = func(x)
    return x


def _checkpoint_fn() -> Callable[..., Any]:
    """The checkpoint function of recomputed segments: fleet's TP-RNG-aware recompute."""
    return recompute


__all__ = ["LayerDesc", "PipelineLayer", "SharedLayerDesc", "segment_layers"]
