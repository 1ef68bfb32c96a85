"""The user's model, sample batch and loss, loaded from their ``pkg.module:function`` names.

:func:`build_model` calls the model function (with ``mp_group`` and/or ``hcg`` when it declares
them) and normalises what it returns into a :class:`BuiltModel`: the entries of a
:class:`~fleet.meta_parallel.PipelineLayer` (a layer list, or the children of an
``nn.Sequential``, or one plain ``nn.Module``), the loss, and the class of the repeated block
(what ``seg_method="layer:<it>"`` cuts pipeline stages at). A failure inside the user's code is
a :class:`PlannerModelError` carrying their traceback and what the planner was doing.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from collective.errors import ConfigError
from fleet.meta_parallel import LayerDesc, SharedLayerDesc
from fleet.planner.types import ModelSpec


class PlannerModelError(ConfigError):
    """The user's model, sample or loss function failed while the planner called it; the
    message holds their traceback and the planner's context (which function, at which
    tensor-parallel degree)."""


@dataclass
class BuiltModel:
    """The model as the planner works with it."""

    entries: list[Any]
    """PipelineLayer entries (LayerDesc, SharedLayerDesc, nn.Module, callables)."""
    loss_fn: Callable[..., Any]
    """``loss_fn(output, labels)``."""
    layer_list: bool
    """True when pipeline stages can cut ``entries`` (a layer list or an nn.Sequential)."""
    block_class: str | None
    """The most repeated entry class (a plain nn.Module: its longest run of same-class
    children), or None when nothing repeats."""


def _flag(what: str) -> str:
    return f"--{what}"


def load_function(ref: str, what: str, path: Sequence[str] = ()) -> Callable[..., Any]:
    """Import ``pkg.module:function``; ``what`` is the flag that named it (``model``,
    ``sample``, ``loss``). ``path`` entries go first on ``sys.path``. A missing module or
    function is a ConfigError naming the flag; a module that fails while importing is a
    :class:`PlannerModelError` with its traceback."""
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")):
        raise ConfigError(
            f"{ref!r} is not of the form pkg.module:function (e.g. examples.planner.gpt:{what})",
            key=_flag(what),
        )
    module_name, func_name = ref.split(":")
    for entry in reversed([str(p) for p in path]):
        if entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(
                f"module {module_name!r} of {ref} was not found (sys.path starts with "
                f"{sys.path[:3]}); run from the directory that holds it or fix the name",
                key=_flag(what),
            ) from exc
        raise PlannerModelError(
            f"importing {module_name} (for {_flag(what)} {ref}) failed:\n{traceback.format_exc()}",
            key=_flag(what),
        ) from exc
    except Exception as exc:
        raise PlannerModelError(
            f"importing {module_name} (for {_flag(what)} {ref}) failed:\n{traceback.format_exc()}",
            key=_flag(what),
        ) from exc
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        public = sorted(n for n in vars(module) if callable(vars(module)[n]) and n[:1] != "_")
        raise ConfigError(
            f"module {module_name} has no function {func_name!r} (its functions: {public[:12]})",
            key=_flag(what),
        )
    return func


def _declared(func: Callable[..., Any]) -> set[str]:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {"mp_group", "hcg"}
    return set(params)


def _call_user(
    func: Callable[..., Any], ref: str, what: str, context: str, *args: Any, **kwargs: Any
) -> Any:
    declared = _declared(func)
    kwargs = {k: v for k, v in kwargs.items() if k in declared}
    try:
        return func(*args, **kwargs)
    except Exception as exc:
        raise PlannerModelError(
            f"the {what} function {ref} failed while the planner {context}:\n"
            f"{traceback.format_exc()}",
            key=_flag(what),
        ) from exc


def _entry_class(entry: Any) -> str:
    if isinstance(entry, LayerDesc):
        return entry.layer_cls.__name__
    if isinstance(entry, nn.Module):
        return type(entry).__name__
    return getattr(entry, "__name__", type(entry).__name__)


def repeated_class(entries: Sequence[Any]) -> str | None:
    """The entry class that repeats most (at least twice; SharedLayerDesc entries, one module
    used at several places, do not count; a tie goes to the longer consecutive run), else
    None."""
    counts: Counter[str] = Counter()
    runs: dict[str, int] = {}
    run, prev = 0, None
    for entry in entries:
        if isinstance(entry, SharedLayerDesc):
            run, prev = 0, None
            continue
        name = _entry_class(entry)
        counts[name] += 1
        run = run + 1 if name == prev else 1
        prev = name
        runs[name] = max(runs.get(name, 0), run)
    if not counts:
        return None
    name = max(counts, key=lambda n: (counts[n], runs[n]))
    return name if counts[name] >= 2 else None


def longest_run_class(module: nn.Module) -> str | None:
    """The class of the longest run of consecutive same-class children anywhere in
    ``module`` (a ModuleList of blocks, say), or None when no class runs twice."""
    best: tuple[int, str | None] = (1, None)
    for sub in module.modules():
        run, prev = 0, None
        for child in sub.children():
            name = type(child).__name__
            run = run + 1 if name == prev else 1
            prev = name
            if run > best[0]:
                best = (run, name)
    return best[1]


def build_model(spec: ModelSpec, mp_group: Any, hcg: Any = None) -> BuiltModel:
    """Call the model function at the tensor-parallel degree of ``mp_group`` and normalise it
    (see the module docstring). The loss comes from the model function (``(model, loss)``) or
    from ``spec.loss``."""
    size = mp_group.size() if mp_group is not None and hasattr(mp_group, "size") else 1
    context = f"built it at mp_degree={size}"
    func = load_function(spec.model, "model", spec.path)
    out = _call_user(func, spec.model, "model", context, mp_group=mp_group, hcg=hcg)
    loss_fn = None
    if isinstance(out, tuple) and len(out) == 2:
        out, loss_fn = out
    if spec.loss:
        loss_func = load_function(spec.loss, "loss", spec.path)
        loss_fn = _call_user(loss_func, spec.loss, "loss", context, mp_group=mp_group, hcg=hcg)
    if loss_fn is None:
        raise ConfigError(
            f"the model function {spec.model} returned no loss and no --loss was given; return "
            "(layers, loss_fn) from it or pass --loss pkg.module:function",
            key="--loss",
        )
    if not callable(loss_fn):
        raise ConfigError(
            f"the loss of {spec.model} is {type(loss_fn).__name__}, not a callable "
            "loss_fn(output, labels)",
            key="--loss",
        )
    if isinstance(out, nn.Sequential):
        entries = list(out.children())
        return BuiltModel(entries, loss_fn, True, repeated_class(entries))
    if isinstance(out, nn.Module):
        return BuiltModel([out], loss_fn, False, longest_run_class(out))
    if isinstance(out, (list, tuple)) and out:
        entries = list(out)
        for i, entry in enumerate(entries):
            if not (isinstance(entry, (LayerDesc, nn.Module)) or callable(entry)):
                raise ConfigError(
                    f"entry {i} of the layer list from {spec.model} is {entry!r}; entries must "
                    "be LayerDesc, SharedLayerDesc, nn.Module or callables",
                    key="--model",
                )
        return BuiltModel(entries, loss_fn, True, repeated_class(entries))
    raise ConfigError(
        f"the model function {spec.model} returned {type(out).__name__}; return a layer list "
        "(LayerDesc entries), an nn.Module, or (either of them, loss_fn)",
        key="--model",
    )


def sample_batch(spec: ModelSpec, batch_size: int) -> tuple[Any, ...]:
    """``(inputs, labels)`` of ``batch_size`` from the sample function."""
    func = load_function(spec.sample, "sample", spec.path)
    out = _call_user(
        func, spec.sample, "sample", f"asked it for a batch of {batch_size}", batch_size
    )
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ConfigError(
            f"the sample function {spec.sample} returned {type(out).__name__}; return "
            "(inputs, labels)",
            key="--sample",
        )
    return tuple(out)


OPTIMIZERS = ("adamw", "adam", "momentum", "sgd")


def make_optimizer(kind: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """The torch optimizer named by ``ModelSpec.optimizer``."""
    params = list(params)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ConfigError(f"optimizer {kind!r} is unknown; use one of {OPTIMIZERS}", key="optimizer")


__all__ = [
    "BuiltModel",
    "PlannerModelError",
    "build_model",
    "load_function",
    "longest_run_class",
    "OPTIMIZERS",
    "make_optimizer",
    "repeated_class",
    "sample_batch",
]
