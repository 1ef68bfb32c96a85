"""Automatic mixed precision: a loss scaler with Paddle's ``amp_configs`` semantics,
``fleet.distributed_scaler`` (found-inf agreed over every rank), and the autocast pieces that
:func:`fleet.parallelize.features.wrap_model_features` uses.

Why our own scaler: ``torch.amp.GradScaler`` shrinks the scale on *every* overflow and has no
``decr_every_n_nan_or_inf``; Paddle's semantics (``amp_configs``: shrink after N overflowing
steps, grow after M clean ones, never below 1) are part of the strategy contract, and the scaler
must know about gradient merge (micro-steps neither unscale nor update). Its interface is
torch's (``scale``, ``unscale_``, ``step``, ``update``, ``get_scale``, ``state_dict``) plus
Paddle's ``minimize`` and ``get_loss_scaling``; the unscale and the inf check are torch's fused
``_amp_foreach_non_finite_check_and_unscale_``.

Hybrid parallelism: one rank's overflow must make *every* rank skip the step, or the replicas and
shards drift apart. Under sharding stage 1/2 the scaler first has the sharded optimizer reduce
its gradients (:func:`reduce_sharded_gradients`), then unscales this rank's partition and
all-reduces the verdict over the world, as torch's ``ShardedGradScaler`` does for FSDP; under
stage 3 it unscales the local shards of FSDP2's gradients and agrees over the world the same way. :func:`distributed_scaler` makes ``found_inf`` an all-reduce (MAX) over the
default group — every mp/pp/sharding/dp rank at once, one collective — for this scaler and for a
``torch.amp.GradScaler`` (whose ``unscale_`` it wraps, as Paddle wraps ``_unscale``).

Custom op lists (``custom_white_list`` / ``custom_black_list``): torch autocast has fixed op
lists, so the custom ones are applied by a ``TorchFunctionMode`` that runs the named functions
(torch function names as ``func.__name__``: ``"softmax"``, ``"layer_norm"``, ``"matmul"``,
``"linear"``; Paddle's ``matmul_v2`` and ``elementwise_*`` map to torch names) with their floating
inputs cast to the low dtype (white) or float32 (black), autocast off inside.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as tdist
from torch.overrides import TorchFunctionMode

import fleet.telemetry as telemetry
from collective.errors import ConfigError, FleetError
from fleet.base.runtime import get_runtime
from fleet.meta_optimizers.base import DelegatingOptimizer
from fleet.meta_optimizers.sharding import ShardedOptimizer
from fleet.strategy.configs import AmpConfig, AmpDtype

logger = logging.getLogger(__name__)

# Paddle op names -> torch function names, for custom white/black lists.
_PADDLE_OP_ALIASES = {
    "matmul_v2": "matmul",
    "mul": "linear",
    "elementwise_add": "add",
    "elementwise_mul": "mul",
    "elementwise_sub": "sub",
    "elementwise_div": "div",
    "reduce_sum": "sum",
    "reduce_mean": "mean",
    "conv2d": "conv2d",
}


class _Stage(enum.Enum):
    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


class GradScaler:
    """Dynamic loss scaling with Paddle's ``amp_configs`` semantics (see module docstring).

    ``init_loss_scaling``: first scale. ``incr_every_n_steps``: grow by ``incr_ratio`` after this
    many consecutive finite steps. ``decr_every_n_nan_or_inf``: shrink by ``decr_ratio`` after
    this many overflowing steps. ``use_dynamic_loss_scaling``: False keeps the scale fixed (steps
    with inf/nan are still skipped). ``enable``: False makes every method a pass-through.
    """

    def __init__(
        self,
        init_loss_scaling: float = 32768.0,
        incr_ratio: float = 2.0,
        decr_ratio: float = 0.8,
        incr_every_n_steps: int = 1000,
        decr_every_n_nan_or_inf: int = 2,
        use_dynamic_loss_scaling: bool = True,
        enable: bool = True,
    ) -> None:
        # AmpConfig validates every value and names the key when one is impossible.
        self.config = AmpConfig(
            init_loss_scaling=init_loss_scaling,
            incr_ratio=incr_ratio,
            decr_ratio=decr_ratio,
            incr_every_n_steps=incr_every_n_steps,
            decr_every_n_nan_or_inf=decr_every_n_nan_or_inf,
            use_dynamic_loss_scaling=use_dynamic_loss_scaling,
        )
        self._enabled = bool(enable)
        self._scale = float(init_loss_scaling)
        self._incr_count = 0
        self._decr_count = 0
        self._sync_group: Any = None
        self._sync = False
        self._per_opt: dict[int, dict[str, Any]] = {}

    @classmethod
    def from_config(cls, config: AmpConfig, enable: bool = True) -> GradScaler:
        """A scaler with the loss-scaling settings of ``strategy.amp_configs``."""
        return cls(
            config.init_loss_scaling,
            config.incr_ratio,
            config.decr_ratio,
            config.incr_every_n_steps,
            config.decr_every_n_nan_or_inf,
            config.use_dynamic_loss_scaling,
            enable,
        )

    # ---- queries -------------------------------------------------------------------------------

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self._enabled

    def get_scale(self) -> float:
        """The current loss scale (1.0 when disabled)."""
        return self._scale if self._enabled else 1.0

    get_loss_scaling = get_scale  # Paddle's name

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Whether the last unscale of ``optimizer`` saw inf/nan (None: not unscaled yet)."""
        return self._per_opt.get(id(optimizer), {}).get("found_inf")

    # ---- the training-loop calls -----------------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (call ``backward`` on the result)."""
        return loss * self._scale if self._enabled else loss

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer`` by the scale in place and record whether any is
        inf/nan (agreed over all ranks after :func:`distributed_scaler`). At most once per step."""
        if not self._enabled:
            return
        state = self._per_opt.setdefault(id(optimizer), {"stage": _Stage.READY})
        if state["stage"] is not _Stage.READY:
            raise FleetError(
                "GradScaler.unscale_() was already called on this optimizer since the last "
                "update(); call it at most once per step (step() unscales if you did not)"
            )
        sharded = reduce_sharded_gradients(optimizer)
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ConfigError(
                        "sparse gradients cannot be loss-scaled; use dense ones", key="optimizer"
                    )
                grad = p.grad
                if hasattr(grad, "to_local"):
                    # FSDP2 (sharding stage 3): this rank's shard, unscaled in place; the
                    # verdict is agreed over every shard below
                    grad, sharded = grad.to_local(), True
                by_device.setdefault((grad.device, grad.dtype), []).append(grad)
        found = torch.zeros(1, dtype=torch.float32)
        inv = 1.0 / self._scale
        for (device, _), grads in by_device.items():
            f = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, f, torch.full((1,), inv, dtype=torch.float32, device=device)
            )
            found = torch.maximum(found, f.cpu())
        if self._sync or sharded:
            # Sharded: this rank checked only its partition; every partition must agree.
            found = _all_reduce_max(found, self._sync_group)
        state["found_inf"] = bool(found.item() > 0)
        state["stage"] = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done) and step ``optimizer`` unless a gradient is inf/nan.

        With gradient merge (a fleet optimizer whose ``grad_merge`` is set), micro-steps only
        count (the scaled gradients keep adding up at one scale); at the merge boundary an
        overflow drops the merged gradients."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        gm = getattr(optimizer, "grad_merge", None)
        if gm is not None and not gm.sync_this_step():
            return optimizer.step(*args, **kwargs)
        state = self._per_opt.setdefault(id(optimizer), {"stage": _Stage.READY})
        if state["stage"] is _Stage.STEPPED:
            raise FleetError(
                "GradScaler.step() was already called on this optimizer since the "
                "last update(); call update() after each step"
            )
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        state["stage"] = _Stage.STEPPED
        if state["found_inf"]:
            if gm is not None:
                gm.micro_step = 0  # the merged gradients are dropped; zero_grad() clears them
            logger.debug("GradScaler: inf/nan gradients, step skipped (scale %g)", self._scale)
            telemetry.count_amp_skipped_step()
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Adjust the scale after the step(s) of this iteration (no-op on merge micro-steps)."""
        if not self._enabled:
            return
        stepped = [s for s in self._per_opt.values() if s["stage"] is _Stage.STEPPED]
        self._per_opt.clear()
        if not stepped:
            return
        found = any(s["found_inf"] for s in stepped)
        cfg = self.config
        if not cfg.use_dynamic_loss_scaling:
            telemetry.set_amp_loss_scale(self._scale)
            return
        if found:
            self._incr_count = 0
            self._decr_count += 1
            if self._decr_count >= cfg.decr_every_n_nan_or_inf:
                self._scale = max(self._scale * cfg.decr_ratio, 1.0)
                self._decr_count = 0
        else:
            self._decr_count = 0
            self._incr_count += 1
            if self._incr_count >= cfg.incr_every_n_steps:
                grown = self._scale * cfg.incr_ratio
                if grown < float("inf"):
                    self._scale = grown
                self._incr_count = 0
        telemetry.set_amp_loss_scale(self._scale)

    def minimize(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        """Paddle's ``scaler.minimize(optimizer, scaled_loss)``: :meth:`step` then
        :meth:`update` (the loss argument is accepted and unused: backward already ran)."""
        self.step(optimizer)
        self.update()

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Scale and counters (plain Python values)."""
        return {
            "scale": self._scale,
            "incr_count": self._incr_count,
            "decr_count": self._decr_count,
            **self.config.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s scale and counters."""
        self._scale = float(state["scale"])
        self._incr_count = int(state["incr_count"])
        self._decr_count = int(state["decr_count"])

    def __repr__(self) -> str:
        sync = ", distributed" if self._sync else ""
        return f"GradScaler(scale={self._scale:g}, enabled={self._enabled}{sync})"


def reduce_sharded_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """If a sharding stage 1/2 optimizer sits in ``optimizer``'s wrapper chain, reduce its
    gradients now (before they are unscaled; torch's ``ShardedGradScaler`` order) and return
    True: this rank's ``param_groups`` then hold its partition's *reduced* gradients, and the
    inf/nan verdict must be agreed over every partition (an all-reduce over the world)."""
    opt: Any = optimizer
    for _ in range(16):  # wrapper chains are a few deep
        if isinstance(opt, ShardedOptimizer):
            opt.reduce_gradients()
            return True
        opt = opt.__dict__.get("_inner") if isinstance(opt, DelegatingOptimizer) else None
        if opt is None:
            return False
    return False


def _all_reduce_max(value: torch.Tensor, group: Any) -> torch.Tensor:
    if tdist.is_initialized() and tdist.get_world_size(group) > 1:
        backend = tdist.get_backend(group)
        if backend == "nccl" and torch.cuda.is_available():
            value = value.cuda()
        tdist.all_reduce(value, op=tdist.ReduceOp.MAX, group=group)
    return value.cpu()


def distributed_scaler(scaler: Any) -> Any:
    """Make ``scaler``'s found-inf agree across every rank (mp, pp, sharding and dp groups): one
    rank's inf/nan gradient makes all skip the step and change the scale identically.

    Takes a :class:`GradScaler` (this module's) or a ``torch.amp.GradScaler``; returns the same
    object, changed. Every rank must then call ``step``/``unscale_`` in the same iterations
    (a collective). Needs ``fleet.init`` first.
    """
    get_runtime("distributed_scaler()")
    if isinstance(scaler, GradScaler):
        scaler._sync, scaler._sync_group = True, None
        return scaler
    if isinstance(scaler, torch.amp.GradScaler):
        return _patch_torch_scaler(scaler, sync=True)
    raise ConfigError(
        f"expected a fleet.meta_optimizers.amp.GradScaler or torch.amp.GradScaler, got {type(scaler).__name__}",
        key="scaler",
    )


def _patch_torch_scaler(scaler: torch.amp.GradScaler, sync: bool) -> torch.amp.GradScaler:
    """Wrap a torch GradScaler's ``unscale_`` (found-inf all-reduced when ``sync``) and make its
    ``step``/``update`` follow fleet's gradient merge like :class:`GradScaler` does."""
    if not scaler.is_enabled() or getattr(scaler, "_fleet_distributed", False):
        return scaler
    original_unscale, original_step, original_update = scaler.unscale_, scaler.step, scaler.update
    stepped = [False]

    def unscale_(optimizer: torch.optim.Optimizer) -> None:
        sharded = reduce_sharded_gradients(optimizer)
        original_unscale(optimizer)
        if not (sync or sharded):
            return
        per_device = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        total = torch.zeros(1, dtype=torch.float32)
        for v in per_device.values():
            total = torch.maximum(total, v.detach().float().cpu().reshape(1))
        total = _all_reduce_max(total, None)
        if per_device:
            for v in per_device.values():
                v.copy_(total.to(v.device).reshape(v.shape))
        elif total.item() > 0:
            device = torch.device(scaler._device)
            per_device[device] = total.to(device)

    def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        gm = getattr(optimizer, "grad_merge", None)
        if gm is not None and not gm.sync_this_step():
            return optimizer.step(*args, **kwargs)  # a micro-step: only count
        out = original_step(optimizer, *args, **kwargs)
        stepped[0] = True
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        skipped = sum(float(v.item()) for v in found.values()) > 0
        if skipped:
            telemetry.count_amp_skipped_step()
            if gm is not None:
                gm.micro_step = 0  # skipped at the boundary: drop the merged gradients
        return out

    def update(new_scale: Any = None) -> None:
        if not stepped[0] and new_scale is None:
            return  # only merge micro-steps since the last update
        stepped[0] = False
        original_update(new_scale)
        if telemetry.enabled():  # get_scale() syncs with the GPU: only when metrics are on
            telemetry.set_amp_loss_scale(scaler.get_scale())

    scaler.unscale_ = unscale_  # type: ignore[method-assign]
    scaler.step = step  # type: ignore[method-assign]
    scaler.update = update  # type: ignore[method-assign]
    scaler._fleet_distributed = True  # type: ignore[attr-defined]
    return scaler


# ---- autocast -----------------------------------------------------------------------------------


def torch_dtype(dtype: AmpDtype | str) -> torch.dtype:
    """``float16`` / ``bfloat16`` as a torch dtype."""
    return torch.bfloat16 if AmpDtype(dtype) is AmpDtype.BFLOAT16 else torch.float16


def _torch_name(op: str) -> str:
    return _PADDLE_OP_ALIASES.get(op, op)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


class _OpListMode(TorchFunctionMode):
    """Runs the functions named in the custom lists at a fixed precision."""

    def __init__(self, device_type: str, low: torch.dtype, white: set[str], black: set[str]):
        super().__init__()
        self.device_type, self.low, self.white, self.black = device_type, low, white, black

    def __torch_function__(self, func: Callable, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.black or name in self.white:
            dtype = torch.float32 if name in self.black else self.low
            with torch.autocast(self.device_type, enabled=False):
                return func(*_cast_floats(args, dtype), **_cast_floats(kwargs, dtype))
        return func(*args, **kwargs)


@contextlib.contextmanager
def autocast(config: AmpConfig, device_type: str) -> Iterator[None]:
    """``torch.autocast`` with the strategy's dtype, plus its custom white/black op lists."""
    low = torch_dtype(config.dtype)
    white = {_torch_name(op) for op in config.custom_white_list}
    black = {_torch_name(op) for op in config.custom_black_list}
    with torch.autocast(device_type, dtype=low):
        if white or black:
            with _OpListMode(device_type, low, white, black):
                yield
        else:
            yield


# ---- O2 master weights --------------------------------------------------------------------------


class MasterWeightOptimizer(DelegatingOptimizer):
    """AMP O2: the model's parameters are low precision; the wrapped optimizer updates float32
    master copies, which are copied back into the parameters after each step.

    ``param_groups`` are the wrapped optimizer's (holding the *model* parameters, so LR
    schedulers, loss scalers and gradient merge see the model's tensors); during ``step``,
    ``state_dict`` and ``load_state_dict`` the groups hold the masters instead, so optimizer state
    is float32 and keyed by the masters. Masters are made lazily from the parameters as they are
    when first needed; float32 parameters are their own master. Like every fleet optimizer
    wrapper it delegates the rest to the wrapped optimizer
    (:class:`~fleet.meta_optimizers.base.DelegatingOptimizer`: one set of groups).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._masters: dict[int, torch.Tensor] = {}

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The float32 master of parameter ``p`` (created on first use)."""
        m = self._masters.get(id(p))
        if m is None:
            if p.dtype == torch.float32:
                m = p
            else:
                m = p.detach().float().requires_grad_(p.requires_grad)
                for attr in ("is_distributed", "fleet_name"):  # instance marks only
                    if attr in p.__dict__:
                        setattr(m, attr, p.__dict__[attr])
            self._masters[id(p)] = m
        return m

    @contextlib.contextmanager
    def _masters_in_groups(self) -> Iterator[list[list[torch.Tensor]]]:
        model_params = [g["params"] for g in self._inner.param_groups]
        for g in self._inner.param_groups:
            g["params"] = [self.master(p) for p in g["params"]]
        try:
            yield model_params
        finally:
            for g, params in zip(self._inner.param_groups, model_params):
                g["params"] = params

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """Float32 gradients to the masters, step the wrapped optimizer, masters back into the
        model's parameters."""
        if closure is not None:
            raise ConfigError(
                "step(closure) is not supported with AMP O2 master weights", key="closure"
            )
        with torch.no_grad(), self._masters_in_groups() as model_params:
            pairs = [(p, self.master(p)) for params in model_params for p in params]
            for p, m in pairs:
                if m is not p:
                    m.grad = None if p.grad is None else p.grad.float()
            out = self._inner.step()
            for p, m in pairs:
                if m is not p:
                    p.copy_(m)
                    m.grad = None
        return out

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict (float32 state)."""
        with self._masters_in_groups():
            return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load into the wrapped optimizer (state attaches to the masters)."""
        with self._masters_in_groups():
            self._inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({self._inner!r})"


__all__ = [
    "GradScaler",
    "MasterWeightOptimizer",
    "autocast",
    "distributed_scaler",
    "reduce_sharded_gradients",
    "torch_dtype",
]
