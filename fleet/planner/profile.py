"""Per-entry measurements of the user's model at one tensor-parallel degree.

:func:`profile_model` builds the model with a real model-parallel group (size 1 included) as a
single-stage :class:`~fleet.meta_parallel.PipelineLayer` and times every entry of its
``run_function`` list on its own: the input of entry ``i`` is the detached output of entry
``i - 1`` (requiring grad when floating); the forward, then the backward with a random gradient
of the output's shape (the last entry includes the loss's forward and backward). Each figure is
the median of a few repetitions after one warm-up (two for an entry slower than
:data:`SLOW_ENTRY_S`); the warm-up runs under
:class:`~fleet.meta_parallel.pp_memory.SavedActivationMeter`, which gives the bytes autograd
keeps for the entry's backward (parameters excluded). Entries built from the same
``LayerDesc`` class with equal arguments, given inputs of the same shapes, are measured once:
their figures and output are reused (the repeated blocks of a transformer cost one).

AMP (``amp``): ``"O0"`` profiles in float32. ``"O1"`` runs every forward (and the loss) under
fleet's autocast (:func:`fleet.meta_optimizers.amp.autocast`, the strategy's dtype and op
lists), as the job does; the backward follows autocast's casts. ``"O2"`` additionally keeps the
parameters in the low dtype (the model is cast before timing, as pure-fp16 training holds it),
so parameter bytes are those of the low-precision parameters; the optimizer step is still
timed on float32 tensors (the master weights it updates).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from collective.errors import ConfigError
from fleet.meta_optimizers.amp import autocast, torch_dtype
from fleet.meta_parallel import (
    ColumnParallelLinear,
    LayerDesc,
    PipelineLayer,
    RowParallelLinear,
    SharedLayerDesc,
    VocabParallelEmbedding,
)
from fleet.meta_parallel.pp_memory import SavedActivationMeter
from fleet.planner.spec import BuiltModel, PlannerModelError, build_model, sample_batch
from fleet.planner.types import ModelSpec
from fleet.strategy.configs import AmpConfig

AMP_LEVELS = ("O0", "O1", "O2")

SLOW_ENTRY_S = 0.05
"""An entry whose warm-up forward and backward take longer than this is timed twice, not
``reps`` times."""


@dataclass
class EntryFigures:
    """One entry at one tensor-parallel degree; per-micro-batch-size dicts keyed by ``b``."""

    name: str
    param_bytes: int
    """Bytes of its parameters unsplit (what mp = 1 holds)."""
    tp_param_bytes: int
    """The unsplit bytes of the parameters tensor parallelism splits."""
    shared_key: str | None
    param_count: int = 0
    """Parameter tensors it holds."""
    fwd_s: dict[int, float] = field(default_factory=dict)
    bwd_s: dict[int, float] = field(default_factory=dict)
    act_bytes: dict[int, float] = field(default_factory=dict)
    out_bytes: dict[int, float] = field(default_factory=dict)


@dataclass
class MpProfile:
    """What :func:`profile_model` measured at one tensor-parallel degree."""

    mp_degree: int
    entries: list[EntryFigures]
    layer_list: bool
    block_class: str | None
    optimizer_step_s_per_byte: float
    input_bytes: dict[int, float]
    whole_pass_s: dict[int, float] = field(default_factory=dict)
    """Micro-batch size -> seconds of one whole forward + loss + backward on this rank (the
    median of :data:`WHOLE_PASS_REPS`): what the entries' figures at that size add up to."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def nbytes(x: Any) -> int:
    """Bytes of every tensor in ``x`` (a tensor or nested tuples/lists/dicts of them)."""
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def _signature(x: Any) -> tuple[Any, ...]:
    """The shapes and dtypes of the tensors in ``x``."""
    return (type(x).__name__, *((tuple(t.shape), t.dtype) for t in _tensors(x)))


def _detach(x: Any, device: torch.device) -> Any:
    """A fresh leaf copy of ``x`` on ``device`` (floating tensors require grad)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().to(device)
        return t.requires_grad_(True) if t.is_floating_point() else t
    if isinstance(x, tuple):
        return tuple(_detach(i, device) for i in x)
    if isinstance(x, list):
        return [_detach(i, device) for i in x]
    return x


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(i, device) for i in x)
    return x


def tp_param_bytes_local(module: nn.Module) -> int:
    """Bytes of this rank's shards of tensor-parallel parameters in ``module``: the parameters
    of ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding (and subclasses),
    except a RowParallelLinear's bias, which every mp rank holds whole."""
    total = 0
    for sub in module.modules():
        if not isinstance(sub, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            continue
        for name, p in sub.named_parameters(recurse=False):
            if isinstance(sub, RowParallelLinear) and name == "bias":
                continue
            total += p.numel() * p.element_size()
    return total


def build_stage(spec: ModelSpec, built: BuiltModel, mp_degree: int) -> PipelineLayer:
    """The whole model as one pipeline stage (its layers constructed now: a LayerDesc's class
    runs here, so a failure in it is a :class:`~fleet.planner.spec.PlannerModelError` naming
    the model function and the degree)."""
    try:
        return PipelineLayer(built.entries, num_stages=1, stage_id=0, loss_fn=built.loss_fn)
    except Exception as exc:
        raise PlannerModelError(
            f"the layers of the model function {spec.model} failed while the planner built them "
            f"at mp_degree={mp_degree}:\n{traceback.format_exc()}",
            key="--model",
        ) from exc


def _param_bytes(module: nn.Module | None) -> int:
    if module is None:
        return 0
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _entry_modules(pipe: PipelineLayer, entries: list[Any]) -> list[nn.Module | None]:
    """The module holding each entry's parameters (None for a plain function)."""
    out: list[nn.Module | None] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, SharedLayerDesc):
            out.append(pipe.shared_layers[entry.layer_name])
        elif isinstance(entry, LayerDesc):
            out.append(getattr(pipe, str(i)))
        elif isinstance(entry, nn.Module):
            out.append(entry)
        else:
            out.append(None)
    return out


def _reuse_key(entries: list[Any], i: int) -> str | None:
    """Entries with equal keys are the same computation (measured once)."""
    entry = entries[i]
    if i == 0 or i == len(entries) - 1:
        return None
    if not isinstance(entry, LayerDesc) or isinstance(entry, SharedLayerDesc):
        return None
    kwargs = sorted(entry.kwargs.items())
    cls = f"{entry.layer_cls.__module__}.{entry.layer_cls.__qualname__}"
    return f"{cls}|{entry.args!r}|{kwargs!r}"


class _InjectGrad(torch.autograd.Function):
    """A zero scalar whose backward hands ``g`` to ``t``: ``_InjectGrad.apply(t, g)
    .backward()`` backpropagates the gradient ``g`` through ``t``'s graph at no extra cost
    (and with an implicit scalar gradient, which keeps autograd from importing its
    symbolic-shape checker, seconds once per process)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        ctx.g = g
        return t.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.g, None


def _output_grads(out: Any) -> list[torch.Tensor]:
    """A random gradient for every output tensor that needs one."""
    return [torch.randn_like(t) for t in _tensors(out) if t.requires_grad]


def _backward(out: Any, loss: torch.Tensor | None, grads: list[torch.Tensor]) -> None:
    if loss is not None:
        loss.backward()
        return
    outs = [t for t in _tensors(out) if t.requires_grad]
    if outs:
        total = _InjectGrad.apply(outs[0], grads[0])
        for t, g in zip(outs[1:], grads[1:]):
            total = total + _InjectGrad.apply(t, g)
        total.backward()


def _amp_context(amp: str, amp_config: AmpConfig, device: torch.device) -> Any:
    if amp == "O0":
        return contextlib.nullcontext()
    return autocast(amp_config, device.type)


@contextlib.contextmanager
def _meter(params: list[torch.Tensor], on: bool) -> Iterator[SavedActivationMeter | None]:
    if not on:
        yield None
        return
    with SavedActivationMeter(params) as m:
        yield m


def _time_entry(
    func: Callable[[Any], Any],
    x: Any,
    loss: tuple[Callable[..., Any], Any] | None,
    params: list[torch.Tensor],
    reps: int,
    amp_ctx: Callable[[], Any],
    device: torch.device,
    agree: Callable[[float], float],
) -> tuple[float, float, float, Any]:
    """(fwd seconds, bwd seconds, saved activation bytes, output) of one entry; ``agree``
    makes the ranks of the mp group take the same number of runs (their layers communicate)."""
    fwd: list[float] = []
    bwd: list[float] = []
    act = 0.0
    out: Any = None
    grads: list[torch.Tensor] = []
    runs = reps + 1
    rep = 0
    while rep < runs:
        with _meter(params, rep == 0) as meter:
            _sync(device)
            t0 = time.perf_counter()
            with amp_ctx():
                out = func(x)
                value = loss[0](out, loss[1]) if loss is not None else None
            _sync(device)
            t1 = time.perf_counter()
            if meter is not None:
                act = float(meter.live_bytes)
        if rep == 0:
            grads = _output_grads(out) if value is None else []
        _backward(out, value, grads)
        _sync(device)
        t2 = time.perf_counter()
        for t in _tensors(x):
            t.grad = None
        if rep > 0:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        elif reps > 2 and agree(t2 - t0) > SLOW_ENTRY_S:
            runs = 3  # a slow entry: two timed runs are enough (and keep calibration short)
        rep += 1
    return statistics.median(fwd), statistics.median(bwd), act, out


WHOLE_PASS_REPS = 3
"""Timed whole forward + backward passes per micro-batch size (after one untimed)."""


def time_whole_pass(
    pipe: PipelineLayer,
    loss_fn: Callable[..., Any],
    inputs: Any,
    labels: Any,
    amp_ctx: Callable[[], Any],
    device: torch.device,
    reps: int = WHOLE_PASS_REPS,
    warmup: int = 1,
) -> float:
    """Median seconds of ``reps`` whole forward + loss + backward passes of ``pipe`` (after
    ``warmup`` untimed ones); the gradients are dropped after each."""
    x = _to(inputs, device)
    times = []
    for rep in range(reps + warmup):
        _sync(device)
        t0 = time.perf_counter()
        with amp_ctx():
            loss = loss_fn(pipe(x), labels)
        loss.backward()
        _sync(device)
        if rep >= warmup:
            times.append(time.perf_counter() - t0)
        pipe.zero_grad(set_to_none=True)
    return statistics.median(times)


def time_alone(
    spec: ModelSpec,
    built: BuiltModel,
    pipe: PipelineLayer,
    b: int,
    amp: str = "O0",
    amp_config: AmpConfig | None = None,
    device: torch.device | None = None,
    reps: int = 2,
) -> float:
    """Median seconds of ``reps`` whole passes at micro-batch size ``b`` of a model
    :func:`profile_model` has just measured (so warm: nothing untimed first). The calibration
    runs it on one model-parallel group while the other ranks wait."""
    device = device or torch.device("cpu")
    amp_config = amp_config or AmpConfig()
    inputs, labels = sample_batch(spec, b)
    labels = _to(labels, device)

    def ctx() -> Any:
        return _amp_context(amp, amp_config, device)

    return time_whole_pass(pipe, built.loss_fn, inputs, labels, ctx, device, reps, warmup=0)


def _rescale_to_whole_pass(
    pipe: PipelineLayer,
    loss_fn: Callable[..., Any],
    inputs: Any,
    labels: Any,
    figures: list[EntryFigures],
    b: int,
    amp_ctx: Callable[[], Any],
    device: torch.device,
) -> float:
    """Scale the entries' forward and backward seconds at micro-batch size ``b`` so that they
    add up to a whole forward + loss + backward of the stage timed in one pass, and return that
    pass's seconds: timing entry by entry adds a synchronisation and a detach per entry that
    the job does not pay (measured 10-20 % too slow for tensor-parallel stacks on a crowded
    CPU), while the per-entry figures keep how the time divides among the entries (where
    pipeline stages cut)."""
    per_entry = sum(f.fwd_s[b] + f.bwd_s[b] for f in figures)
    # every entry has just run at this size, so no untimed pass first on a CPU (where the
    # allocator keeps nothing warm between passes anyway): the median of three discards a
    # slow first pass; a GPU's caching allocator grows in the first pass, which stays untimed
    warmup = 1 if device.type == "cuda" else 0
    whole = time_whole_pass(pipe, loss_fn, inputs, labels, amp_ctx, device, warmup=warmup)
    if per_entry <= 0:
        return whole
    ratio = whole / per_entry
    for f in figures:
        f.fwd_s[b] *= ratio
        f.bwd_s[b] *= ratio
    return whole


def _step_function(optimizer: str, params: list[torch.Tensor], lr: float) -> Callable[[], None]:
    """One step of ``optimizer`` over ``params`` (their ``.grad`` set) through torch's
    functional optimizers: the arithmetic of ``torch.optim.AdamW`` & co. with their default
    implementation choice, without constructing the class (whose first construction imports
    torch's compiler stack, seconds that would land in every calibration)."""
    grads = [p.grad for p in params]
    if optimizer in ("adamw", "adam"):
        from torch.optim.adam import adam
        from torch.optim.adamw import adamw

        func = adamw if optimizer == "adamw" else adam
        m = [torch.zeros_like(p) for p in params]
        v = [torch.zeros_like(p) for p in params]
        steps = [torch.tensor(0.0) for _ in params]
        decay = 0.01 if optimizer == "adamw" else 0.0

        def adam_step() -> None:
            func(
                params, grads, m, v, [], steps, amsgrad=False, beta1=0.9, beta2=0.999,
                lr=lr, weight_decay=decay, eps=1e-8, maximize=False,
            )  # fmt: skip

        return adam_step
    if optimizer in ("momentum", "sgd"):
        from torch.optim.sgd import sgd

        momentum = 0.9 if optimizer == "momentum" else 0.0
        buffers: list[torch.Tensor | None] = [None] * len(params)

        def sgd_step() -> None:
            sgd(
                params, grads, buffers, weight_decay=0.0, momentum=momentum, lr=lr,
                dampening=0.0, nesterov=False, maximize=False,
            )  # fmt: skip

        return sgd_step
    raise ConfigError(
        f"optimizer {optimizer!r} is unknown; use adamw, adam, momentum or sgd",
        key="--optimizer",
    )


def optimizer_step_s_per_byte(
    params: list[torch.Tensor],
    optimizer: str,
    lr: float = 1e-3,
    reps: int = 3,
    share: float = 1.0,
) -> float:
    """Seconds of one optimizer step over ``params`` (float32 copies with gradients set) per
    parameter byte: median of ``reps`` steps after one that creates the state. ``share`` < 1
    steps over the leading parameters up to that fraction of the bytes (at least one tensor):
    the part of a model one rank updates once the model is split, whose bytes stay in the
    caches a whole model's would not."""
    live = [p for p in params if p.numel()]
    if share < 1.0 and live:
        budget = share * sum(p.numel() * 4 for p in live)
        kept, size = [], 0
        for p in live:
            if kept and size >= budget:
                break
            kept.append(p)
            size += p.numel() * 4
        live = kept
    copies = [p.detach().float().clone() for p in live]
    if not copies:
        return 0.0
    for p in copies:
        p.grad = torch.randn_like(p) * 1e-3
    step = _step_function(optimizer, copies, lr)
    device = copies[0].device
    times = []
    with torch.no_grad():
        for rep in range(reps + 1):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            if rep:
                times.append(time.perf_counter() - t0)
    total = sum(p.numel() * p.element_size() for p in copies)
    return statistics.median(times) / total


def profile_model(
    spec: ModelSpec,
    mp_group: Any,
    micro_batch_sizes: list[int] | tuple[int, ...],
    amp: str = "O0",
    amp_config: AmpConfig | None = None,
    reps: int = 3,
    device: torch.device | None = None,
    built: BuiltModel | None = None,
    pipe: PipelineLayer | None = None,
    time_optimizer: bool = True,
) -> MpProfile:
    """Measure every entry of the model built with ``mp_group`` (see the module docstring).

    ``mp_group``: the real model-parallel process group this rank belongs to (size 1 allowed);
    every rank of it must call this at the same time (the tensor-parallel layers communicate).
    ``built``: the model already built with ``mp_group`` (else :func:`build_model` is called);
    ``pipe``: its single-stage PipelineLayer (else :func:`build_stage` makes it).
    ``time_optimizer``: False leaves ``optimizer_step_s_per_byte`` at 0 (the caller times the
    step itself, e.g. with every rank starting together).
    """
    if amp not in AMP_LEVELS:
        raise ConfigError(f"amp level {amp!r} is unknown; use one of {AMP_LEVELS}", key="amp")
    amp_config = amp_config or AmpConfig()
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    k = tdist.get_world_size(mp_group) if mp_group is not None else 1
    built = built or build_model(spec, mp_group)
    entries = built.entries
    pipe = pipe or build_stage(spec, built, k)
    pipe.to(device)
    if amp == "O2":
        pipe.to(torch_dtype(amp_config.dtype))
    modules = _entry_modules(pipe, entries)
    params = list(pipe.parameters())
    figures = []
    for i, module in enumerate(modules):
        local = _param_bytes(module)
        tp_local = tp_param_bytes_local(module) if module is not None else 0
        shared = entries[i].layer_name if isinstance(entries[i], SharedLayerDesc) else None
        name = _entry_name(entries[i])
        count = sum(1 for _ in module.parameters()) if module is not None else 0
        figures.append(
            EntryFigures(name, local - tp_local + tp_local * k, tp_local * k, shared, count)
        )

    def agree(value: float) -> float:
        if k == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=mp_group)
        return float(t.item())

    def amp_ctx() -> Any:
        return _amp_context(amp, amp_config, device)

    input_bytes: dict[int, float] = {}
    whole_pass: dict[int, float] = {}
    for b in micro_batch_sizes:
        inputs, labels = sample_batch(spec, b)
        input_bytes[b] = float(nbytes(inputs) + nbytes(labels))
        labels = _to(labels, device)
        x = _detach(inputs, device)
        done: dict[tuple[str, Any], tuple[int, Any]] = {}
        for i, func in enumerate(pipe.run_function):
            last = i == len(pipe.run_function) - 1
            key = _reuse_key(entries, i)
            seen = (key, _signature(x)) if key is not None else None
            fig = figures[i]
            if seen is not None and seen in done:
                # the same layer on an input of the same shape: its figures and its output
                src_index, out = done[seen]
                src = figures[src_index]
                fig.fwd_s[b], fig.bwd_s[b] = src.fwd_s[b], src.bwd_s[b]
                fig.act_bytes[b] = src.act_bytes[b]
            else:
                loss = (built.loss_fn, labels) if last else None
                f, bw, act, out = _time_entry(func, x, loss, params, reps, amp_ctx, device, agree)
                fig.fwd_s[b], fig.bwd_s[b], fig.act_bytes[b] = f, bw, act
                if seen is not None:
                    done[seen] = (i, out)
            fig.out_bytes[b] = float(nbytes(out))
            x = _detach(out, device)
        pipe.zero_grad(set_to_none=True)
        whole_pass[b] = _rescale_to_whole_pass(
            pipe, built.loss_fn, inputs, labels, figures, b, amp_ctx, device
        )
    step = optimizer_step_s_per_byte(params, spec.optimizer, spec.lr) if time_optimizer else 0.0
    return MpProfile(
        mp_degree=k,
        entries=figures,
        layer_list=built.layer_list,
        block_class=built.block_class,
        optimizer_step_s_per_byte=step,
        input_bytes=input_bytes,
        whole_pass_s=whole_pass,
    )


def _entry_name(entry: Any) -> str:
    if isinstance(entry, LayerDesc):
        return entry.layer_cls.__name__
    if isinstance(entry, nn.Module):
        return type(entry).__name__
    return getattr(entry, "__name__", type(entry).__name__)


__all__ = [
    "AMP_LEVELS",
    "EntryFigures",
    "MpProfile",
    "nbytes",
    "optimizer_step_s_per_byte",
    "build_stage",
    "profile_model",
    "time_alone",
    "time_whole_pass",
    "tp_param_bytes_local",
]
