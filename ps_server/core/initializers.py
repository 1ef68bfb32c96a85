"""Initial values of sparse rows, deterministic per (table, key, seed).

An initializer turns a :class:`~ps_server.core.hashing.KeyRNG` (counter-based, keyed by table name,
seed and key) into ``float32[n, dim]``. Column ``j`` of a key depends only on
``(table, seed, key, j)`` — not on the shard, the server, the batch or the order of arrival — so
every server (and a client computing the value of a not-yet-admitted key) gets the same row.
Values are computed in float64 and rounded once to float32.

Adding one — subclass, register::

    @Initializer.register
    @dataclass(frozen=True)
    class Xavier(Initializer):
        TYPE: ClassVar[str] = "xavier"
        fan_in: int

        def generate(self, rng: KeyRNG, dim: int) -> np.ndarray:
            bound = math.sqrt(6.0 / (self.fan_in + dim))
            return (bound * (2.0 * rng.column_uniform(dim) - 1.0)).astype(np.float32)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from collective.typed_config import require
from ps_server.core import kernels
from ps_server.core.batch_ops import put_rows
from ps_server.core.hashing import KeyRNG, stream_of
from ps_server.core.registry import Registered

_MAX_ATTEMPTS = 256
RowKernel = Callable[..., None]
"""``kernel(keys, stream, out[, rows])``: writes the initial rows of ``keys`` into ``out`` (all
of it, or its rows ``rows``)."""


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass(frozen=True)
class Initializer(Registered):
    """Base of the row initializers: override :meth:`generate`, register with
    ``@Initializer.register`` (see the module docstring)."""

    FAMILY: ClassVar[str] = "initializer"
    _REGISTRY: ClassVar[dict[str, type]] = {}

    def generate(self, rng: KeyRNG, dim: int) -> np.ndarray:
        """Initial values ``float32[rng.num_keys, dim]``; column ``j`` may use only the
        counters of column ``j`` (``j << 9 | ...``) so values do not depend on ``dim``."""
        raise NotImplementedError(f"{type(self).__name__}.generate")

    def _kernel(self, dim: int) -> RowKernel | None:
        """A compiled kernel that writes these rows bit-identically to :meth:`generate`, or
        None (numpy's :meth:`generate` computes them). Subclasses that change ``generate`` must
        not inherit a kernel: the built-in ones check ``type(self).generate``."""
        return None

    def rows(self, table: str, seed: int, keys: np.ndarray, dim: int) -> np.ndarray:
        """The initial rows of ``keys`` in table ``table`` with ``seed`` (float32 ``[n, dim]``)."""
        kernel = self._kernel(dim)
        if kernel is None:
            out = self.generate(KeyRNG(table, seed, keys, "init"), dim)
            return np.ascontiguousarray(out, dtype=np.float32)
        out = np.empty((keys.shape[0], dim), dtype=np.float32)
        kernel(keys, stream_of(table, seed, "init"), out)
        return out

    def write_rows(
        self, table: str, seed: int, keys: np.ndarray, dst: np.ndarray, rows: np.ndarray | slice
    ) -> None:
        """``dst[rows] = self.rows(table, seed, keys, dst.shape[1])``: the initial values of new
        rows written into a table's value column (``rows``: distinct rows or a slice)."""
        kernel = self._kernel(dst.shape[1]) if dst.flags.c_contiguous else None
        if kernel is None:
            put_rows(dst, rows, self.rows(table, seed, keys, dst.shape[1]))
        elif isinstance(rows, slice):  # a run of rows: a contiguous view, written in order
            kernel(keys, stream_of(table, seed, "init"), dst[rows])
        else:
            kernel(keys, stream_of(table, seed, "init"), dst, rows)


@Initializer.register
@dataclass(frozen=True)
class Uniform(Initializer):
    """Uniform in ``[low, high]`` (``torch.nn.init.uniform_``)."""

    TYPE: ClassVar[str] = "uniform"
    low: float = -0.01
    """Lower bound."""
    high: float = 0.01
    """Upper bound (>= low)."""

    def __post_init__(self) -> None:
        require(
            _finite(self.low) and _finite(self.high) and self.low <= self.high,
            "high",
            f"need finite low <= high, got low={self.low!r} high={self.high!r}",
        )

    def generate(self, rng: KeyRNG, dim: int) -> np.ndarray:
        return (self.low + (self.high - self.low) * rng.column_uniform(dim)).astype(np.float32)

    def _kernel(self, dim: int) -> RowKernel | None:
        if not (kernels.ENABLED and dim > 0 and type(self).generate is Uniform.generate):
            return None
        return lambda keys, stream, out, *rows: kernels.uniform_rows(
            keys, stream, self.low, self.high, out, *rows
        )


@Initializer.register
@dataclass(frozen=True)
class Normal(Initializer):
    """Normal ``N(mean, std**2)`` (``torch.nn.init.normal_``), by Box–Muller."""

    TYPE: ClassVar[str] = "normal"
    mean: float = 0.0
    """Mean."""
    std: float = 0.01
    """Standard deviation (>= 0)."""

    def __post_init__(self) -> None:
        require(_finite(self.mean), "mean", f"must be finite, got {self.mean!r}")
        require(_finite(self.std) and self.std >= 0, "std", f"must be >= 0, got {self.std!r}")

    def generate(self, rng: KeyRNG, dim: int) -> np.ndarray:
        return (self.mean + self.std * rng.normal(dim)).astype(np.float32)

    def _kernel(self, dim: int) -> RowKernel | None:
        # bit-identical to generate where kernels.normal_compiled() says so (checked once)
        if not (dim > 0 and type(self).generate is Normal.generate and kernels.normal_compiled()):
            return None
        return lambda keys, stream, out, *rows: kernels.normal_rows(
            keys, stream, self.mean, self.std, out, *rows
        )


@Initializer.register
@dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """Normal ``N(mean, std**2)`` truncated to ``[mean - 2 std, mean + 2 std]``.

    Like ``torch.nn.init.trunc_normal_`` with its default ``a=-2, b=2`` — but the bounds here are
    in units of ``std`` around ``mean`` (torch's ``a``/``b`` are absolute). Drawn by bounded
    resampling: a value outside the bounds is redrawn from the next counter of its column
    (``attempt`` 1, 2, ...), so the result is still a pure function of (table, key, seed, column).
    """

    TYPE: ClassVar[str] = "truncated_normal"
    mean: float = 0.0
    """Mean (of the untruncated normal)."""
    std: float = 0.01
    """Standard deviation of the untruncated normal (>= 0); values lie within 2 std of mean."""

    def __post_init__(self) -> None:
        require(_finite(self.mean), "mean", f"must be finite, got {self.mean!r}")
        require(_finite(self.std) and self.std >= 0, "std", f"must be >= 0, got {self.std!r}")

    def generate(self, rng: KeyRNG, dim: int) -> np.ndarray:
        z = rng.normal(dim, attempt=0)
        bad = np.abs(z) > 2.0
        attempt = 1
        while bad.any() and attempt < _MAX_ATTEMPTS:
            # redraw only the rows with rejected cells; 4.6% of cells per round
            rows = np.flatnonzero(bad.any(axis=1))
            redraw = rng.subset(rows).normal(dim, attempt=attempt)
            sub = z[rows]
            sub_bad = bad[rows]
            sub[sub_bad] = redraw[sub_bad]
            z[rows] = sub
            bad[rows] = np.abs(sub) > 2.0
            attempt += 1
        np.clip(z, -2.0, 2.0, out=z)  # only reachable with probability 0.046**256
        return (self.mean + self.std * z).astype(np.float32)


@Initializer.register
@dataclass(frozen=True)
class Constant(Initializer):
    """Every value equal to ``value`` (``torch.nn.init.constant_``)."""

    TYPE: ClassVar[str] = "constant"
    value: float = 0.0
    """The value."""

    def __post_init__(self) -> None:
        require(_finite(self.value), "value", f"must be finite, got {self.value!r}")

    def generate(self, rng: KeyRNG, dim: int) -> np.ndarray:
        return np.full((rng.num_keys, dim), self.value, dtype=np.float32)


__all__ = ["Constant", "Initializer", "Normal", "TruncatedNormal", "Uniform"]
