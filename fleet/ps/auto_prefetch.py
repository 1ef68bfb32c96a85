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

Under several training threads (:mod:`fleet.ps.threads`) the loop reads batches into a buffer
of one batch per thread; the batch a read hands to the prefetcher as the next one is
prefetched once the reading thread has left the hand-off lock (:meth:`SlotPrefetcher.run_deferred`),
so a batch's rows are pulled about one step time of a thread before its forward. The batch a
forward belongs to is the one its thread took (:meth:`SlotPrefetcher.take`, kept per thread).
Plans are kept per original module (a thread's model copy teaches and uses its original's
plans).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from fleet.base import lookahead
from fleet.ps import threads
from fleet.ps.runtime import current_communicator

MAX_PLANS = 4
"""Distinct slot lists remembered per embedding (a model may call one table several times)."""


class SlotPrefetcher:
    """The :class:`fleet.base.lookahead.Prefetcher` of the parameter-server trainer."""

    def __init__(self) -> None:
        self._local = _Batches()
        # embedding -> list of (slot names, single): single = the forward took one slot/tensor
        self._plans: weakref.WeakKeyDictionary[Any, list[tuple[tuple[str, ...], bool]]] = (
            weakref.WeakKeyDictionary()
        )
        self.prefetched = 0
        """Prefetches started (for tests and logs)."""
        self._lock = threading.Lock()

    @property
    def _current(self) -> Mapping[str, Any] | None:
        """The batch this thread is training (None outside a looking-ahead iteration)."""
        return self._local.current

    # -- lookahead.Prefetcher ------------------------------------------------------------------
    def active(self) -> bool:
        comm = current_communicator()
        return comm is not None and comm.auto_prefetch

    def on_batch(
        self, current: Mapping[str, Any] | None, following: Mapping[str, Any] | None
    ) -> None:
        local = self._local
        if threads.GATE.running:  # training threads: see take() and run_deferred()
            if following is not None:
                local.deferred.append(following)
            return
        local.current, local.following, local.index = current, following, None
        if following is not None:
            self._start(following)

    def take(self, current: Mapping[str, Any], following: Mapping[str, Any] | None) -> None:
        """Training threads: this thread trains ``current`` (read ahead into the loop's buffer
        by any thread), ``following`` is the next batch in that buffer (or None)."""
        local = self._local
        local.current, local.following, local.index = current, following, None

    def run_deferred(self) -> None:
        """Training threads: start the prefetches of the batches this thread read ahead (called
        once it holds its batch, so the lookups' layout is not made while the batch hand-off is
        locked)."""
        local = self._local
        todo, local.deferred = local.deferred, []
        for following in todo:
            self._start(following)

    def _start(self, following: Mapping[str, Any]) -> None:
        with self._lock:
            todo = [(m, list(plans)) for m, plans in self._plans.items()]
        for module, plans in todo:
            for names, single in plans:
                self._prefetch(module, names, single, following)

    # -- called by DistributedEmbedding.forward ------------------------------------------------
    def seen(self, module: Any, slots: Sequence[Any], single: bool) -> None:
        """``module``'s forward got ``slots`` (a one-element list when ``single``)."""
        local = self._local
        current = local.current
        if current is None:
            return
        if local.index is None:
            local.index = {id(v): k for k, v in current.items()}
        names = []
        for s in slots:
            name = local.index.get(id(s))
            if name is None:
                return  # not the batch's own slot objects: nothing to plan
            names.append(name)
        plan = (tuple(names), single)
        module = threads.original(module)
        with self._lock:
            plans = self._plans.setdefault(module, [])
            if plan in plans:
                return
            plans.append(plan)
            del plans[:-MAX_PLANS]
        if local.following is not None:  # learned now: the next batch is already known
            self._prefetch(module, plan[0], single, local.following)

    def _prefetch(
        self, module: Any, names: tuple[str, ...], single: bool, batch: Mapping[str, Any]
    ) -> None:
        try:
            slots = [batch[n] for n in names]
        except KeyError:
            return  # this batch lacks a slot the plan names: its forward pulls as usual
        module.prefetch(slots[0] if single else slots)
        with self._lock:
            self.prefetched += 1


class _Batches(threading.local):
    """Per thread: the batch it trains, the one the lookahead read after it, slot ids."""

    def __init__(self) -> None:
        self.current: Mapping[str, Any] | None = None
        self.following: Mapping[str, Any] | None = None
        self.deferred: list[Mapping[str, Any]] = []
        self.index: dict[int, str] | None = None


PREFETCHER = SlotPrefetcher()
lookahead.register(PREFETCHER)


def seen(module: Any, slots: Sequence[Any], single: bool = False) -> None:
    """Hook for :class:`~fleet.ps.embedding.DistributedEmbedding`: the slots (or ids tensor) its
    forward got; cheap when no looking-ahead iteration is running."""
    if PREFETCHER._current is not None:
        PREFETCHER.seen(module, slots, single)


__all__ = ["PREFETCHER", "SlotPrefetcher", "seen"]
