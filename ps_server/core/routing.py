"""Key → shard → server routing: pure, vectorised functions shared by servers and clients.

A table has a fixed number of shards (``num_shards``, default 64). A key's shard is a hash of the
key alone; a shard's server is ``shard % num_servers``. Because the shard count never changes and
checkpoints are written per shard, a table saved by N servers loads into M servers: each server
loads the shard files it owns under the new spread.

The shard hash (``mix64(key ^ ROUTE_SALT)``) is independent of the hash the servers' key index
uses, so the keys one server holds are still spread evenly over its index slots. Dense blocks are
routed by a stable hash of their name (:func:`block_shard`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collective.errors import ConfigError
from ps_server.core import kernels
from ps_server.core.hashing import name_hash, salted_hash

ROUTE_SALT = 0x5851F42D4C957F2D
"""Salt of the key → shard hash (never change it: shard files depend on it)."""


def _check_counts(num_shards: int, num_servers: int | None = None) -> None:
    if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ConfigError(f"must be an integer >= 1, got {num_shards!r}", key="num_shards")
    if num_servers is not None:
        if not isinstance(num_servers, (int, np.integer)) or num_servers < 1:
            raise ConfigError(f"must be an integer >= 1, got {num_servers!r}", key="num_servers")
        if num_servers > num_shards:
            raise ConfigError(
                f"{num_servers} servers but only {num_shards} shards: {num_servers - num_shards} "
                "server(s) would hold nothing; use at most num_shards servers or create the "
                "table with more shards",
                key="num_servers",
            )


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """int64 shard index in ``[0, num_shards)`` of each int64 key (any value of the int64 range)."""
    _check_counts(num_shards)
    return (salted_hash(keys, ROUTE_SALT) % np.uint64(num_shards)).astype(np.int64)


def server_of_shard(shards: np.ndarray | int, num_servers: int) -> np.ndarray | int:
    """The server index that owns each shard: ``shard % num_servers``."""
    return shards % num_servers


def shards_of_server(server_index: int, num_servers: int, num_shards: int) -> tuple[int, ...]:
    """The shards server ``server_index`` of ``num_servers`` owns (``shard % num_servers``)."""
    _check_counts(num_shards, num_servers)
    if not 0 <= server_index < num_servers:
        raise ConfigError(
            f"must be in [0, {num_servers}), got {server_index!r}", key="server_index"
        )
    return tuple(range(server_index, num_shards, num_servers))


def group_by_server(keys: np.ndarray, num_servers: int, num_shards: int) -> list[np.ndarray]:
    """Positions of ``keys`` per server: ``out[s]`` is an int64 index array into ``keys``
    (in ascending position order) of the keys server ``s`` owns.

    A client sends ``keys[out[s]]`` to server ``s`` and scatters the replies back with
    ``result[out[s]] = reply_s``.
    """
    return split_by_server(keys, num_servers, num_shards)[0]


def split_by_server(
    keys: np.ndarray, num_servers: int, num_shards: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(positions, keys) per server: :func:`group_by_server`'s positions and the keys at them
    (``keys[positions[s]]``), both grouped in one compiled pass when the kernels are built."""
    _check_counts(num_shards, num_servers)
    if kernels.ENABLED:
        return kernels.group(keys, ROUTE_SALT, num_shards, num_servers)
    server = shard_of(keys, num_shards) % num_servers
    if num_servers <= 8:  # one linear scan per server beats a stable argsort of int64 here
        positions = [np.flatnonzero(server == s) for s in range(num_servers)]
    else:
        order = np.argsort(server, kind="stable")
        bounds = np.cumsum(np.bincount(server, minlength=num_servers))[:-1]
        positions = [part.astype(np.int64, copy=False) for part in np.split(order, bounds)]
    return positions, [keys[p] for p in positions]


def block_shard(name: str, num_shards: int) -> int:
    """The shard of a dense block, from a stable hash of its name."""
    _check_counts(num_shards)
    return name_hash(name) % num_shards


def split_for_messages(keys: np.ndarray, per: int, keep_keys_together: bool) -> list[Any]:
    """Slices (or position arrays) of ``keys`` with at most ``per`` keys each (one message
    each). ``keep_keys_together``: every occurrence of a key lands in the same part (keys are
    sorted first; a part may then be a little shorter), so an APPLY push sees each key once."""
    n = keys.shape[0]
    if n <= per:
        return [slice(0, n)]
    if not keep_keys_together:
        return [slice(s, min(s + per, n)) for s in range(0, n, per)]
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    out, start = [], 0
    while start < n:
        stop = min(start + per, n)
        if stop < n:  # move the cut back to the start of the key run it falls in
            run_start = int(np.searchsorted(sorted_keys, sorted_keys[stop], "left"))
            stop = (
                run_start
                if run_start > start
                else int(np.searchsorted(sorted_keys, sorted_keys[stop], "right"))
            )
        out.append(order[start:stop])
        start = stop
    return out


__all__ = [
    "ROUTE_SALT",
    "block_shard",
    "group_by_server",
    "server_of_shard",
    "shard_of",
    "shards_of_server",
    "split_by_server",
    "split_for_messages",
]
