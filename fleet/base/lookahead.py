"""Batch lookahead: while batch s trains, whatever batch s + 1 needs from the servers is fetched.

The iterators of :mod:`fleet.data` (and :func:`fleet.train_from_dataset` over any other iterable
of batches) pass their batches through :func:`batches`. When a registered :class:`Prefetcher`
is active — the parameter-server layer registers one, active in async and half-async mode
(:mod:`fleet.ps.auto_prefetch`) — the iterator reads one batch ahead and hands the pair
(batch about to train, the one after it) to the prefetcher before yielding. Otherwise the
batches pass through untouched, with no lookahead at all.

This module only connects the two sides: :mod:`fleet.data` and :mod:`fleet.ps` are siblings and
import neither each other; both import this one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import fleet.telemetry as telemetry

Batch = Mapping[str, Any]


class Prefetcher(Protocol):
    """What the lookahead hands batches to (see :mod:`fleet.ps.auto_prefetch`)."""

    def active(self) -> bool:
        """Whether a lookahead is worth it now (checked once per pass over the batches)."""
        ...

    def on_batch(self, current: Batch | None, following: Batch | None) -> None:
        """``current`` is about to be yielded for training; ``following`` comes after it (None
        at the end). Called with (None, None) when the pass ends."""
        ...


_PREFETCHERS: list[Prefetcher] = []


def register(prefetcher: Prefetcher) -> None:
    """Add a prefetcher (once; registering the same object again does nothing)."""
    if not any(p is prefetcher for p in _PREFETCHERS):
        _PREFETCHERS.append(prefetcher)


def batches(iterable: Iterable[Batch]) -> Iterator[Batch]:
    """The batches of ``iterable`` in order; one batch ahead when a prefetcher is active.

    While step-phase timing is on (:mod:`fleet.telemetry`), the time spent producing each batch
    (the lookahead's read and prefetch start included) is added to the ``data`` phase."""
    active = [p for p in _PREFETCHERS if p.active()]
    if not active:
        if not telemetry.phase_clock():
            yield from iterable
            return
        it = iter(iterable)
        while True:
            t0 = telemetry.phase_clock()
            batch = next(it, None)
            if batch is None:
                return
            telemetry.add_phase("data", t0)
            yield batch
    it = iter(iterable)
    t0 = telemetry.phase_clock()
    current = next(it, None)
    try:
        while current is not None:
            following = next(it, None)
            for p in active:
                p.on_batch(current, following)
            telemetry.add_phase("data", t0)
            yield current
            t0 = telemetry.phase_clock()
            current = following
    finally:
        for p in active:
            p.on_batch(None, None)


LOOKS_AHEAD = "looks_ahead"
"""Attribute name: an iterable whose iterator already goes through :func:`batches` sets it
true, so :func:`fleet.train_from_dataset` does not wrap it twice."""


def looks_ahead(iterable: Any) -> bool:
    """Whether ``iterable``'s iterator already goes through :func:`batches`."""
    return bool(getattr(iterable, LOOKS_AHEAD, False))


__all__ = ["LOOKS_AHEAD", "Prefetcher", "batches", "looks_ahead", "register"]
