"""Counter-based hashing and random numbers keyed by (table, key, seed), vectorised in numpy.

Everything random on the server — initial embedding values, probabilistic admission — is a pure
function of ``(table name, key, seed, purpose, counter)``: no generator state, so a row's initial
value does not depend on which server or shard holds it, on the order keys arrive, or on the batch
they arrive in. The mixer is splitmix64's finaliser (Steele et al., "Fast splittable pseudorandom
number generators", 2014), which passes BigCrush when fed a Weyl sequence, as here:

    base(key)          = mix64(mix64(seed ^ hash(table) ^ hash(purpose)) ^ mix64(key))
    bits(key, counter) = mix64(base(key) + (counter + 1) * 0x9E3779B97F4A7C15)

The table name is hashed with BLAKE2b (Python's ``hash()`` is salted per process). Keys are the
full signed int64 range (viewed as uint64; numpy's uint64 arithmetic wraps modulo 2**64).
"""

from __future__ import annotations

import hashlib

import numpy as np

MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_U_GAMMA, _U_M1, _U_M2 = np.uint64(_GAMMA), np.uint64(_M1), np.uint64(_M2)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_TWO_PI = 2.0 * np.pi


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of a uint64 array (a bijection on 64-bit words; a new array)."""
    z = x + _U_GAMMA
    z = (z ^ (z >> _S30)) * _U_M1
    z = (z ^ (z >> _S27)) * _U_M2
    return z ^ (z >> _S31)


def mix64_int(x: int) -> int:
    """splitmix64 of one Python int (taken modulo 2**64), the scalar twin of :func:`mix64`."""
    z = (x + _GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def name_hash(name: str) -> int:
    """Stable 64-bit hash of a string (same in every process and on every machine)."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def stream_of(table: str, seed: int, purpose: str) -> int:
    """The 64-bit word that keys a :class:`KeyRNG`'s numbers to ``(table, seed, purpose)``."""
    return mix64_int((seed & MASK64) ^ name_hash(table) ^ mix64_int(name_hash(purpose)))


def as_uint64(keys: np.ndarray) -> np.ndarray:
    """The int64 keys reinterpreted as uint64 (two's complement, no copy when contiguous)."""
    return np.ascontiguousarray(keys, dtype=np.int64).view(np.uint64)


def salted_hash(keys: np.ndarray, salt: int) -> np.ndarray:
    """mix64(key ^ salt) for int64 keys — independent hash families for independent salts."""
    return mix64(as_uint64(keys) ^ np.uint64(salt & MASK64))


def to_unit(bits: np.ndarray) -> np.ndarray:
    """Uniform float64 in [0, 1) from the top 53 bits of uint64 words."""
    return (bits >> _S11).astype(np.float64) * (1.0 / (1 << 53))


class KeyRNG:
    """Deterministic random numbers for a batch of keys: a pure function of
    ``(table, seed, purpose, key, counter)``.

    ``purpose`` separates independent uses (``"init"`` for initial values, ``"entry"`` for
    admission) so one does not correlate with the other. Counters are small non-negative ints
    chosen by the caller (initializers use ``column << 9 | attempt << 1 | half``).
    """

    def __init__(self, table: str, seed: int, keys: np.ndarray, purpose: str) -> None:
        self._base = mix64(mix64(as_uint64(keys)) ^ np.uint64(stream_of(table, seed, purpose)))
        self.num_keys = int(self._base.shape[0])

    def subset(self, index: np.ndarray) -> KeyRNG:
        """The generator of ``keys[index]`` (same numbers as the full one for those keys)."""
        sub = object.__new__(KeyRNG)
        sub._base = self._base[index]
        sub.num_keys = int(sub._base.shape[0])
        return sub

    def bits(self, counters: np.ndarray) -> np.ndarray:
        """uint64 words of shape ``[num_keys, len(counters)]``."""
        c = (np.asarray(counters, dtype=np.uint64) + np.uint64(1)) * _U_GAMMA
        return mix64(self._base[:, None] + c[None, :])

    def uniform(self, counters: np.ndarray) -> np.ndarray:
        """Uniform float64 in [0, 1), shape ``[num_keys, len(counters)]``."""
        return to_unit(self.bits(counters))

    def normal(self, columns: int, attempt: int = 0) -> np.ndarray:
        """Standard normal float64 ``[num_keys, columns]`` by Box–Muller (cosine branch).

        Column ``j`` of attempt ``a`` uses counters ``j << 9 | a << 1`` and ``... | 1``, so a
        column's value never depends on how many columns were asked for.
        """
        if not 0 <= attempt < 256:
            raise ValueError(f"attempt must be in [0, 256), got {attempt}")
        base = (np.arange(columns, dtype=np.uint64) << np.uint64(9)) | np.uint64(attempt << 1)
        u1 = 1.0 - self.uniform(base)  # (0, 1]: log is finite
        u2 = self.uniform(base | np.uint64(1))
        return np.sqrt(-2.0 * np.log(u1)) * np.cos(_TWO_PI * u2)

    def column_uniform(self, columns: int) -> np.ndarray:
        """Uniform float64 in [0, 1) ``[num_keys, columns]``, column ``j`` on counter ``j << 9``."""
        return self.uniform(np.arange(columns, dtype=np.uint64) << np.uint64(9))


__all__ = [
    "KeyRNG",
    "as_uint64",
    "mix64",
    "mix64_int",
    "name_hash",
    "salted_hash",
    "stream_of",
    "to_unit",
]
