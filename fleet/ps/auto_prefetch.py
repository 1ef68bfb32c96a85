"""Automatic prefetch: the next batch's sparse rows are pulled while the current batch trains.

Registered with :mod:`fleet.base.lookahead` when :mod:`fleet.ps` is imported; active on a
trainer whose communicator prefetches (async and half-async mode) with the strategy's
``a_sync_configs.prefetch`` on (the default). Sync and GEO never look ahead: a sync pull must
see the previous step's update, GEO pulls are local.

How it knows what to prefetch, without being told: while a batch from a looking-ahead iterator
trains, every :class:`~fleet.ps.embedding.DistributedEmbedding` forward reports the slot objects
it was given (:func:`seen`). Those that are values of the batch mapping (``batch["1"]``, or a
list / dict of such) are recorded by slot name as a plan for that embedding. For the batch after
(already read by the lookahead), the embedding's :meth:`prefetch` is called with the same slot
names, so its forward finds the rows pulled. A forward given ids computed from the batch (hashed,
sliced) is not recognised and pulls at its step as before. The first batch of a pass teaches the
plans (and its forward prefetches the second batch right away); every later batch is prefetched.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from fleet.base import lookahead
from fleet.ps.runtime import current_communicator

MAX_PLANS = 4
"""Distinct slot lists remembered per embedding (a model may call one table several times)."""


class SlotPrefetcher:
    """The :class:`fleet.base.lookahead.Prefetcher` of the parameter-server trainer."""

    def __init__(self) -> None:
        self._current: Mapping[str, Any] | None = None
        self._following: Mapping[str, Any] | None = None
        self._index: dict[int, str] | None = None
        # embedding -> list of (slot names, single): single = the forward took one slot/tensor
        self._plans: weakref.WeakKeyDictionary[Any, list[tuple[tuple[str, ...], bool]]] = (
            weakref.WeakKeyDictionary()
        )
        self.prefetched = 0
        """Prefetches started (for tests and logs)."""

    # -- lookahead.Prefetcher ------------------------------------------------------------------
    def active(self) -> bool:
        comm = current_communicator()
        return comm is not None and comm.auto_prefetch

    def on_batch(
        self, current: Mapping[str, Any] | None, following: Mapping[str, Any] | None
    ) -> None:
        self._current, self._following, self._index = current, following, None
        if following is None:
            return
        for module, plans in list(self._plans.items()):
            for names, single in plans:
                self._prefetch(module, names, single, following)

    # -- called by DistributedEmbedding.forward ------------------------------------------------
    def seen(self, module: Any, slots: Sequence[Any], single: bool) -> None:
        """``module``'s forward got ``slots`` (a one-element list when ``single``)."""
        current = self._current
        if current is None:
            return
        if self._index is None:
            self._index = {id(v): k for k, v in current.items()}
        names = []
        for s in slots:
            name = self._index.get(id(s))
            if name is None:
                return  # not the batch's own slot objects: nothing to plan
            names.append(name)
        plan = (tuple(names), single)
        plans = self._plans.setdefault(module, [])
        if plan in plans:
            return
        plans.append(plan)
        del plans[:-MAX_PLANS]
        if self._following is not None:  # learned now: the next batch is already known
            self._prefetch(module, plan[0], single, self._following)

    def _prefetch(
        self, module: Any, names: tuple[str, ...], single: bool, batch: Mapping[str, Any]
    ) -> None:
        try:
            slots = [batch[n] for n in names]
        except KeyError:
            return  # this batch lacks a slot the plan names: its forward pulls as usual
        module.prefetch(slots[0] if single else slots)
        self.prefetched += 1


PREFETCHER = SlotPrefetcher()
lookahead.register(PREFETCHER)


def seen(module: Any, slots: Sequence[Any], single: bool = False) -> None:
    """Hook for :class:`~fleet.ps.embedding.DistributedEmbedding`: the slots (or ids tensor) its
    forward got; cheap when no looking-ahead iteration is running."""
    if PREFETCHER._current is not None:
        PREFETCHER.seen(module, slots, single)


__all__ = ["PREFETCHER", "SlotPrefetcher", "seen"]
