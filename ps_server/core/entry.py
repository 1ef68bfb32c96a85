"""Entry (admission) policies: which keys get a trainable row.

A sparse table asks its policy about keys that have no row yet, on pull and on push:
``admit(keys, counts, rng) -> bool[n]``. ``counts`` is how often each key has been pushed so far,
*including* the current push (0 on a pull of a key never pushed). Keys the policy refuses get no
row: a pull returns their deterministic initial value (the value the row will start from once
admitted, so the worker sees no jump at admission), and a push of them is dropped and counted as
``filtered``. ``rng`` draws numbers per (table, key, seed), so decisions are reproducible.

* no policy (``entry=None``): every key is admitted on first pull or push (Paddle's default).
* :class:`CountFilterEntry` ``(n)``: admitted by the push that brings its count to ``n``
  (Paddle's ``CountFilterEntry(count_filter)``; the count is the "show" count — see
  :mod:`ps_server.core.sparse_table`). Until then only ``(key, count, unseen_days)`` is kept in a
  small side store, not a full row. That push's gradient is applied to the new row.
* :class:`ProbabilityEntry` ``(p)``: admitted with probability ``p``, decided once per
  (table, key, seed) — a refused key stays refused (feature hashing-style sampling).

Adding one — subclass, register; set ``tracks_counts`` if ``admit`` needs the counts::

    @EntryPolicy.register
    @dataclass(frozen=True)
    class CountOrLucky(EntryPolicy):
        TYPE: ClassVar[str] = "count_or_lucky"
        n: int
        p: float

        @property
        def tracks_counts(self) -> bool:
            return True

        def admit(self, keys, counts, rng):
            return (counts >= self.n) | (rng.uniform(np.zeros(1, np.uint64))[:, 0] < self.p)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from collective.typed_config import require
from ps_server.core.hashing import KeyRNG
from ps_server.core.registry import Registered


@dataclass(frozen=True)
class EntryPolicy(Registered):
    """Base of the admission policies (see the module docstring)."""

    FAMILY: ClassVar[str] = "entry"
    _REGISTRY: ClassVar[dict[str, type]] = {}

    @property
    def tracks_counts(self) -> bool:
        """Whether refused keys' push counts must be remembered (a side store per table)."""
        return False

    def admit(self, keys: np.ndarray, counts: np.ndarray, rng: KeyRNG) -> np.ndarray:
        """bool[n]: which of ``keys`` (int64, distinct, without a row) get a row now."""
        raise NotImplementedError(f"{type(self).__name__}.admit")


@EntryPolicy.register
@dataclass(frozen=True)
class CountFilterEntry(EntryPolicy):
    """Admit a key once it has been pushed ``n`` times (its pushes until then are dropped)."""

    TYPE: ClassVar[str] = "count_filter"
    n: int
    """Pushes (occurrences) needed for a row (>= 1)."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}"
        )

    @property
    def tracks_counts(self) -> bool:
        return True

    def admit(self, keys: np.ndarray, counts: np.ndarray, rng: KeyRNG) -> np.ndarray:
        return np.asarray(counts) >= self.n


@EntryPolicy.register
@dataclass(frozen=True)
class ProbabilityEntry(EntryPolicy):
    """Admit each key with probability ``p``, decided deterministically per (table, key, seed)."""

    TYPE: ClassVar[str] = "probability"
    p: float
    """Admission probability in [0, 1]."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.p, (int, float)) and math.isfinite(self.p) and 0.0 <= self.p <= 1.0,
            "p",
            f"must be a probability in [0, 1], got {self.p!r}",
        )

    def admit(self, keys: np.ndarray, counts: np.ndarray, rng: KeyRNG) -> np.ndarray:
        return rng.uniform(np.zeros(1, dtype=np.uint64))[:, 0] < self.p


__all__ = ["CountFilterEntry", "EntryPolicy", "ProbabilityEntry"]
