"""Server-side optimizer rules: SGD, Adagrad and Adam with ``torch.optim`` semantics, per row.

A rule updates a batch of rows at once: ``weights`` ``float32[n, dim]``, its optimizer ``state``
``float32[n, state_dim(dim)]`` and the (duplicate-summed) ``grads`` ``float32[n, dim]``, all
gathered copies that the table scatters back afterwards. Sparse tables keep state per row (Adam's
step count is per row: a row's bias correction advances only when that row is pushed, exactly like
a torch parameter that receives a gradient only at some steps); dense tables call the same rules
with one "row" per block.

Adding a rule — subclass, register, done (tables, configs, checkpoints pick it up by name)::

    from dataclasses import dataclass
    from typing import ClassVar
    from ps_server import OptimizerRule

    @OptimizerRule.register
    @dataclass(frozen=True)
    class SignSGD(OptimizerRule):
        TYPE: ClassVar[str] = "sign_sgd"
        lr: float

        def apply(self, weights, state, grads, rows_meta):
            weights -= np.float32(self.lr) * np.sign(grads)

    SparseTableConfig("emb", 8, optimizer={"type": "sign_sgd", "lr": 0.1}, ...)

State layouts (float32 columns per row): SGD none; Adagrad ``[g2sum(dim)]``; Adam
``[m(dim) | v(dim) | step]`` (the step is a float32 integer: exact up to 2**24 pushes of a row,
beyond which both bias corrections are 1.0 in float64 anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from collective.typed_config import require
from ps_server.core.registry import Registered


@dataclass(frozen=True)
class RowsMeta:
    """Per-row metadata of the rows being updated (sparse tables; ``None`` for dense blocks)."""

    count: np.ndarray
    """uint32[n]: pushes seen by each row, including the current one."""
    unseen_days: np.ndarray
    """uint16[n]: days since each row was last pushed (0 for rows pushed today)."""


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass(frozen=True)
class OptimizerRule(Registered):
    """Base of the server-side optimizer rules (see the module docstring for how to add one).

    Subclasses are frozen dataclasses with ``TYPE`` set, override :meth:`apply` (and
    :meth:`state_dim` / :meth:`init_state` when they keep state), and are registered with
    ``@OptimizerRule.register``. Tables call :meth:`update`, which applies the rule and then clips
    to ``weight_bounds``.
    """

    FAMILY: ClassVar[str] = "optimizer"
    _REGISTRY: ClassVar[dict[str, type]] = {}

    weight_bounds: tuple[float, float] | None = field(default=None, kw_only=True)
    """Optional ``(low, high)``: weights are clipped into it after every update."""

    def __post_init__(self) -> None:
        if self.weight_bounds is not None:
            wb = tuple(self.weight_bounds)
            require(
                len(wb) == 2 and all(_finite(b) for b in wb) and wb[0] <= wb[1],
                "weight_bounds",
                f"must be [low, high] with low <= high, got {list(wb)}",
            )
            object.__setattr__(self, "weight_bounds", (float(wb[0]), float(wb[1])))

    def state_dim(self, dim: int) -> int:
        """float32 state columns per row of ``dim`` weights (0: stateless)."""
        return 0

    def init_state(self, state: np.ndarray) -> None:
        """Fill fresh state rows ``float32[n, state_dim]`` in place (zeros by default)."""
        state.fill(0.0)

    def add_state_delta(self, state: np.ndarray, delta: np.ndarray) -> None:
        """Merge a trainer's state change ``delta`` (``[n, state_dim]``: its state at the end of
        a pass minus the state it pulled) into ``state`` in place, as :meth:`SparseTable.add_delta`
        adds value deltas. Additive by default: exact for accumulators such as Adagrad's
        ``g2sum`` (several trainers' deltas sum to every gradient's square); a rule whose state
        must stay in a range clamps it here."""
        state += delta

    def apply(
        self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray, rows_meta: RowsMeta | None
    ) -> None:
        """Update ``weights`` and ``state`` in place from ``grads`` (all ``[n, ...]`` float32)."""
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def update(
        self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray, rows_meta: RowsMeta | None
    ) -> None:
        """:meth:`apply`, then clip the weights to ``weight_bounds`` (what tables call)."""
        self.apply(weights, state, grads, rows_meta)
        if self.weight_bounds is not None:
            np.clip(weights, self.weight_bounds[0], self.weight_bounds[1], out=weights)


def _check_lr(lr: float) -> None:
    require(_finite(lr) and lr >= 0.0, "lr", f"must be a finite number >= 0, got {lr!r}")


@OptimizerRule.register
@dataclass(frozen=True)
class SGD(OptimizerRule):
    """Plain SGD, ``torch.optim.SGD(lr)`` without momentum: ``w -= lr * g``."""

    TYPE: ClassVar[str] = "sgd"
    lr: float
    """Learning rate (>= 0)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_lr(self.lr)

    def apply(self, weights, state, grads, rows_meta) -> None:
        weights -= np.float32(self.lr) * grads


@OptimizerRule.register
@dataclass(frozen=True)
class Adagrad(OptimizerRule):
    """``torch.optim.Adagrad(lr, initial_accumulator_value, eps)`` (no lr decay, no weight decay).

    ``g2sum += g * g; w -= lr * g / (sqrt(g2sum) + eps)``, with ``g2sum`` per weight.
    """

    TYPE: ClassVar[str] = "adagrad"
    lr: float
    """Learning rate (>= 0)."""
    initial_accumulator_value: float = 0.0
    """Starting value of every ``g2sum`` (>= 0)."""
    eps: float = 1e-10
    """Added to ``sqrt(g2sum)`` for stability (>= 0)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_lr(self.lr)
        require(
            _finite(self.initial_accumulator_value) and self.initial_accumulator_value >= 0,
            "initial_accumulator_value",
            f"must be a finite number >= 0, got {self.initial_accumulator_value!r}",
        )
        require(_finite(self.eps) and self.eps >= 0, "eps", f"must be >= 0, got {self.eps!r}")

    def state_dim(self, dim: int) -> int:
        return dim

    def init_state(self, state: np.ndarray) -> None:
        state.fill(self.initial_accumulator_value)

    def apply(self, weights, state, grads, rows_meta) -> None:
        state += grads * grads
        std = np.sqrt(state)
        std += np.float32(self.eps)
        weights -= np.float32(self.lr) * (grads / std)


@OptimizerRule.register
@dataclass(frozen=True)
class Adam(OptimizerRule):
    """``torch.optim.Adam(lr, betas, eps)`` with bias correction, the step counted per row.

    ``m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g; t += 1;
    w -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)``.
    """

    TYPE: ClassVar[str] = "adam"
    lr: float
    """Learning rate (>= 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment, each in [0, 1)."""
    eps: float = 1e-8
    """Added to the bias-corrected ``sqrt(v)`` (>= 0)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_lr(self.lr)
        b = tuple(self.betas)
        require(
            len(b) == 2 and all(_finite(x) and 0.0 <= x < 1.0 for x in b),
            "betas",
            f"must be two numbers in [0, 1), got {list(b)}",
        )
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))
        require(_finite(self.eps) and self.eps >= 0, "eps", f"must be >= 0, got {self.eps!r}")

    def state_dim(self, dim: int) -> int:
        return 2 * dim + 1

    def add_state_delta(self, state: np.ndarray, delta: np.ndarray) -> None:
        """Moments and step count add (one trainer's delta restores its state exactly; several
        trainers' sum is the GEO approximation of their interleaved steps); ``v`` and the step
        are clamped at 0, which a sum of decays could cross."""
        state += delta
        dim = (state.shape[1] - 1) // 2
        np.maximum(state[:, dim:], 0.0, out=state[:, dim:])

    def apply(self, weights, state, grads, rows_meta) -> None:
        dim = weights.shape[1]
        b1, b2 = self.betas
        m = state[:, :dim]
        v = state[:, dim : 2 * dim]
        step = state[:, 2 * dim]
        # torch: exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
        m += np.float32(1.0 - b1) * (grads - m)
        v *= np.float32(b2)
        v += np.float32(1.0 - b2) * (grads * grads)
        step += np.float32(1.0)
        t = step.astype(np.float64)
        step_size = (self.lr / (1.0 - b1**t)).astype(np.float32)[:, None]
        bc2_sqrt = np.sqrt(1.0 - b2**t).astype(np.float32)[:, None]
        denom = np.sqrt(v) / bc2_sqrt
        denom += np.float32(self.eps)
        weights -= step_size * (m / denom)


__all__ = ["SGD", "Adagrad", "Adam", "OptimizerRule", "RowsMeta"]
