"""A key filter in memory for an SSD table's cold tier: a key never written to RocksDB costs no
RocksDB read.

:class:`KeyFilter` answers "may RocksDB hold this key?" for a batch of int64 keys with numpy
only: ``False`` is certain (the key was never added), ``True`` may be a false positive (about
:data:`FALSE_POSITIVE_RATE` of the keys never added, per filter of the chain). An
:class:`~ps_server.core.ssd_table.SsdSparseTable` adds every key it queues for RocksDB and asks
the filter before each ``multi_get``: a key seen for the first time (most of the misses while a
table grows) then skips RocksDB. A key deleted from RocksDB stays in the filter, which only
costs a read that finds nothing.

Layout: a blocked Bloom filter, one 64-bit word per key. Two multiply-shift hashes of the key
(``key * odd constant`` on uint64): the top bits of the first pick the word, six-bit fields of
the second pick :data:`NUM_BITS` bits in it. A batch costs one gather (lookup) or one sort and
``bitwise_or.reduceat`` (insert) per filter, whatever its size. :data:`BITS_PER_KEY` bits a key
give :data:`FALSE_POSITIVE_RATE` at full load (a standard Bloom filter's 0.8 % needs one memory
access per bit).

Growth: a filter holds ``capacity`` keys; a batch that does not fit starts a new filter as large
as the whole chain so far (the chain doubles), and a lookup asks every filter of the chain. Once
the chain is longer than :data:`MAX_CHAIN` the table rebuilds one filter of twice its keys from a
RocksDB key scan (:meth:`KeyFilter.rebuilt`), so a lookup asks at most a few filters and the
false positives do not add up. Keys are counted when they are new to the filter, so a row
evicted again and again counts once.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

BITS_PER_KEY = 10
"""Bits of filter per key it is sized for."""
NUM_BITS = 5
"""Bits set per key in its word (the best count for one 64-bit word at 10 bits a key)."""
FALSE_POSITIVE_RATE = 0.017
"""Share of never-added keys a full filter of this layout lets through (computed)."""
MAX_CHAIN = 4
"""Past this many chained filters the table rebuilds one filter from a key scan."""
MIN_CAPACITY = 1 << 16
"""Keys the smallest filter holds (80 KiB)."""

_M_WORD = np.uint64(0x9E3779B97F4A7C15)
_M_BITS = np.uint64(0xC2B2AE3D27D4EB4F)
_ONE = np.uint64(1)
_SIX = np.uint64(63)


def _hashes(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(word hash, bit mask) uint64[n] of int64 keys."""
    k = np.ascontiguousarray(keys, dtype=np.int64).view(np.uint64)
    word = k * _M_WORD
    h = k * _M_BITS
    mask = np.zeros(k.shape[0], dtype=np.uint64)
    for i in range(NUM_BITS):
        mask |= _ONE << ((h >> np.uint64(58 - 6 * i)) & _SIX)
    return word, mask


class _Bloom:
    """One blocked Bloom filter of a power-of-two number of 64-bit words."""

    def __init__(self, capacity: int) -> None:
        need = max(1, -(-max(capacity, MIN_CAPACITY) * BITS_PER_KEY // 64))
        log2 = max(1, (need - 1).bit_length())
        self.words = np.zeros(1 << log2, dtype=np.uint64)
        self.shift = np.uint64(64 - log2)
        self.capacity = (1 << log2) * 64 // BITS_PER_KEY
        self.count = 0

    def hits(self, word: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return (self.words[(word >> self.shift).astype(np.intp)] & mask) == mask

    def insert(self, word: np.ndarray, mask: np.ndarray) -> None:
        if word.shape[0] == 0:
            return
        # an unbuffered OR: keys sharing a word all set their bits (8x faster than grouping
        # them by a sort, for 345 000 keys)
        np.bitwise_or.at(self.words, (word >> self.shift).astype(np.intp), mask)
        self.count += int(word.shape[0])


class KeyFilter:
    """Which int64 keys may be in the cold tier (module docstring): no false negatives."""

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        """An empty filter sized for ``capacity`` keys (it grows past them)."""
        self._chain = [_Bloom(capacity)]

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_keys(self) -> int:
        """Keys added (each counted once, give or take the false positives at its add)."""
        return sum(b.count for b in self._chain)

    @property
    def capacity(self) -> int:
        """Keys the chain holds at :data:`BITS_PER_KEY` bits a key."""
        return sum(b.capacity for b in self._chain)

    @property
    def nbytes(self) -> int:
        """Bytes of the bit arrays."""
        return sum(int(b.words.nbytes) for b in self._chain)

    @property
    def chain_length(self) -> int:
        """Filters a lookup asks."""
        return len(self._chain)

    @property
    def needs_rebuild(self) -> bool:
        """The chain is longer than :data:`MAX_CHAIN`: rebuild it with :meth:`rebuilt`."""
        return len(self._chain) > MAX_CHAIN

    # -- lookups and inserts ------------------------------------------------------------------
    def _hits(self, word: np.ndarray, mask: np.ndarray) -> np.ndarray:
        hit = self._chain[-1].hits(word, mask)
        for bloom in self._chain[:-1]:
            todo = np.flatnonzero(~hit)
            if todo.shape[0] == 0:
                break
            hit[todo] = bloom.hits(word[todo], mask[todo])
        return hit

    def may_contain(self, keys: np.ndarray) -> np.ndarray:
        """bool[n]: ``False`` where the key was certainly never added."""
        if keys.shape[0] == 0:
            return np.zeros(0, dtype=bool)
        return self._hits(*_hashes(keys))

    def add(self, keys: np.ndarray) -> None:
        """Add distinct int64 keys (those already in the filter are not counted again); a batch
        that does not fit the newest filter starts a new one as large as the chain."""
        if keys.shape[0] == 0:
            return
        word, mask = _hashes(keys)
        new = ~self._hits(word, mask)
        word, mask = word[new], mask[new]
        last = self._chain[-1]
        if last.count + word.shape[0] > last.capacity:
            last = _Bloom(max(self.capacity, word.shape[0]))
            self._chain.append(last)
        last.insert(word, mask)

    def parts(self) -> list[tuple[np.ndarray, int]]:
        """(bit array, keys counted) of each filter of the chain, for a checkpoint: the arrays
        themselves, not copies (an add only sets more bits, so what a later reader sees still
        holds every key added before)."""
        return [(b.words, b.count) for b in self._chain]

    def with_room(self, keys: int) -> KeyFilter:
        """This filter, grown (an empty bit array appended, as :meth:`add` would) when fewer
        than ``keys`` more keys fit in it."""
        if self.capacity - self.num_keys < keys:
            self._chain.append(_Bloom(max(self.capacity, keys)))
        return self

    @classmethod
    def from_parts(cls, parts: Iterable[tuple[np.ndarray, int]]) -> KeyFilter:
        """The filter whose :meth:`parts` were saved; ValueError for arrays it cannot have."""
        chain = []
        for words, count in parts:
            n = int(words.shape[0])
            if words.dtype != np.uint64 or words.ndim != 1 or n < 2 or n & (n - 1):
                raise ValueError(f"not a key filter's bit array: {words.dtype} {words.shape}")
            bloom = _Bloom.__new__(_Bloom)
            bloom.words = np.ascontiguousarray(words)
            bloom.shift = np.uint64(64 - (n.bit_length() - 1))
            bloom.capacity = n * 64 // BITS_PER_KEY
            bloom.count = int(count)
            chain.append(bloom)
        if not chain:
            raise ValueError("a key filter has at least one bit array")
        out = cls.__new__(cls)
        out._chain = chain
        return out

    @classmethod
    def rebuilt(cls, key_chunks: Iterable[np.ndarray], num_keys: int) -> KeyFilter:
        """One filter of ``2 * num_keys`` keys holding the keys of ``key_chunks`` (a key scan
        of the tier and the keys queued for it; ``num_keys`` is their number or more)."""
        out = cls(2 * num_keys)
        bloom = out._chain[0]
        for keys in key_chunks:
            if keys.shape[0]:
                bloom.insert(*_hashes(keys))
        return out


__all__ = ["BITS_PER_KEY", "FALSE_POSITIVE_RATE", "MAX_CHAIN", "KeyFilter"]
