"""key → row index of a row store: a vectorised open-addressing hash table in numpy.

:class:`HashIndex` keeps one ``int32`` per slot — the row id, or ``-1`` empty / ``-2`` deleted —
and compares a probed slot's key by reading the store's own key column (``stored_keys[row]``),
so the index costs 4 B per slot and never duplicates the 8 B keys. Probing is linear, over a
power-of-two table kept at most 70 % full (live + deleted slots); a whole batch probes at once:
each round gathers the slots of the keys still unresolved, resolves the hits and the empty slots,
and moves the rest one slot on. Inserting claims empty slots the same way (``slots[pos] = rows``,
then reading back which writes won), so a batch of 64k keys costs a few dozen numpy calls, not
64k Python steps. Deleting writes a tombstone; a rebuild (on growth, or when tombstones fill the
table) drops them.

:class:`DictIndex` is the plain-Python peer (a ``dict`` key → row) with the same interface, kept
for tests (as an oracle) and for ``bench/bench_ps_memory.py``, which measures both in one run.
See :mod:`ps_server.core.row_store` for the numbers behind choosing the hash index.
"""

from __future__ import annotations

import sys

import numpy as np

from ps_server.core import kernels
from ps_server.core.hashing import salted_hash

EMPTY = -1
TOMBSTONE = -2
INDEX_SALT = 0x2545F4914F6CDD1D
"""Salt of the index hash (independent of the routing hash, see ps_server.core.routing)."""
MAX_LOAD = 0.7
"""Rebuild when live + deleted slots would exceed this fraction of the table."""
GROW_LOAD = 0.5
"""A rebuilt table is the smallest power of two that is at most this full."""
MIN_SLOTS = 1024


def _slots_for(num_keys: int) -> int:
    cap = MIN_SLOTS
    while num_keys > GROW_LOAD * cap:
        cap *= 2
    return cap


class HashIndex:
    """Vectorised linear-probing hash index from int64 keys to int32 row ids.

    Every method takes ``stored_keys``, the store's key column (``stored_keys[row]`` is the key of
    ``row``), because the index itself holds only row ids.
    """

    def __init__(self) -> None:
        self._slots = np.full(MIN_SLOTS, EMPTY, dtype=np.int32)
        self._size = 0  # live entries
        self._used = 0  # live + tombstones

    def __len__(self) -> int:
        return self._size

    @property
    def num_slots(self) -> int:
        """Slots in the table (a power of two)."""
        return int(self._slots.shape[0])

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the slot array."""
        return int(self._slots.nbytes)

    def _home(self, keys: np.ndarray) -> np.ndarray:
        mask = np.uint64(self._slots.shape[0] - 1)
        return (salted_hash(keys, INDEX_SALT) & mask).astype(np.int64)

    def _probe(self, query: np.ndarray, stored_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, slots) of each query key; ``-1`` in both where the key is absent."""
        table = self._slots
        mask = table.shape[0] - 1
        pos = self._home(query)
        # round 0 over the whole batch; an empty/deleted slot (-1/-2) reads a real but
        # unrelated key through numpy's negative indexing and is masked out by ``r >= 0``
        r = table.take(pos)
        hit = stored_keys.take(r) == query
        hit &= r >= 0
        rows = np.where(hit, r, -1).astype(np.int64)
        slots = np.where(hit, pos, -1)
        active = np.flatnonzero(~hit & (r != EMPTY))
        while active.size:  # the keys whose home slot held another key: move one slot on
            p = (pos[active] + 1) & mask
            pos[active] = p
            r = table.take(p)
            hit = stored_keys.take(r) == query[active]
            hit &= r >= 0
            found = active[hit]
            rows[found] = r[hit]
            slots[found] = p[hit]
            active = active[~hit & (r != EMPTY)]
        return rows, slots

    def lookup(self, query: np.ndarray, stored_keys: np.ndarray) -> np.ndarray:
        """int64 row of each key, ``-1`` where absent."""
        if kernels.ENABLED:
            return kernels.probe(self._slots, stored_keys, query)
        return self._probe(query, stored_keys)[0]

    def insert(self, query: np.ndarray, rows: np.ndarray, stored_keys: np.ndarray) -> None:
        """Add distinct, absent keys (already written at ``stored_keys[rows]``)."""
        n = query.shape[0]
        if n == 0:
            return
        if self._used + n > MAX_LOAD * self._slots.shape[0]:
            old = self._slots
            self._slots = np.full(_slots_for(self._size + n), EMPTY, dtype=np.int32)
            if kernels.ENABLED:  # one pass over the old slots in C
                kernels.reindex(self._slots, stored_keys, old)
                self._used = self._size
            else:
                live = old[old >= 0].astype(np.int64)
                self._size = self._used = 0
                self._place(stored_keys[live], live, stored_keys)
        self._place(query, rows, stored_keys)

    def _place(self, query: np.ndarray, rows: np.ndarray, stored_keys: np.ndarray) -> None:
        self._size += rows.shape[0]
        self._used += rows.shape[0]
        if kernels.ENABLED:  # one key at a time in C (slots may differ from the rounds' below)
            kernels.insert(self._slots, stored_keys, query, rows)
            return
        mask = self._slots.shape[0] - 1
        pos = self._home(query)
        pending = rows.astype(np.int32)
        while pending.size:
            empty = self._slots[pos] == EMPTY
            claim_pos = pos[empty]
            claim_rows = pending[empty]
            self._slots[claim_pos] = claim_rows  # several keys may claim one slot: one write wins
            won = np.zeros(pending.shape[0], dtype=bool)
            won[empty] = self._slots[claim_pos] == claim_rows
            lost = ~won
            # keys whose slot was taken before this round move on; losers of a race retry the
            # same (now occupied) slot and move on next round
            pos = np.where(empty[lost], pos[lost], (pos[lost] + 1) & mask)
            pending = pending[lost]

    def remove(self, query: np.ndarray, stored_keys: np.ndarray) -> np.ndarray:
        """Delete present keys; returns their rows (``-1`` for keys that were absent)."""
        rows, slots = self._probe(query, stored_keys)
        found = slots >= 0
        self._slots[slots[found]] = TOMBSTONE
        self._size -= int(found.sum())
        return rows

    def rebuild(self, rows: np.ndarray, stored_keys: np.ndarray) -> None:
        """Forget everything and index exactly ``rows`` (distinct keys), sized for them."""
        self._slots = np.full(_slots_for(rows.shape[0]), EMPTY, dtype=np.int32)
        self._size = self._used = 0
        self._place(stored_keys[rows], rows.astype(np.int64), stored_keys)


class DictIndex:
    """The plain-Python peer of :class:`HashIndex`: a ``dict`` from key to row id.

    About 100 B per entry (dict slot and hash, a key int object, a row int object) and a Python
    step per key; kept as a test oracle and a benchmark baseline.
    """

    def __init__(self) -> None:
        self._map: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._map)

    @property
    def memory_bytes(self) -> int:
        """Approximate bytes: the dict itself plus one key and one row int object per entry."""
        return sys.getsizeof(self._map) + len(self._map) * (36 + 32)

    def lookup(self, query: np.ndarray, stored_keys: np.ndarray) -> np.ndarray:
        get = self._map.get
        return np.fromiter(
            (get(k, -1) for k in query.tolist()), dtype=np.int64, count=query.shape[0]
        )

    def insert(self, query: np.ndarray, rows: np.ndarray, stored_keys: np.ndarray) -> None:
        self._map.update(zip(query.tolist(), rows.tolist(), strict=True))

    def remove(self, query: np.ndarray, stored_keys: np.ndarray) -> np.ndarray:
        pop = self._map.pop
        return np.fromiter(
            (pop(k, -1) for k in query.tolist()), dtype=np.int64, count=query.shape[0]
        )

    def rebuild(self, rows: np.ndarray, stored_keys: np.ndarray) -> None:
        self._map = dict(zip(stored_keys[rows].tolist(), rows.tolist(), strict=True))


KeyIndex = HashIndex | DictIndex

__all__ = ["DictIndex", "HashIndex", "KeyIndex"]
