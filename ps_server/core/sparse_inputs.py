"""What a sparse table accepts: the checks of a call's keys, gradients, shards and import payload.

Each check raises the table error that names the table, the argument and the fix
(:class:`TableInputError`, :class:`WrongShardError`, :class:`NonFiniteGradientError`) before the
table changes; :class:`~ps_server.core.sparse_table.SparseTable` calls them on every pull, push,
GEO delta and checkpoint import. Plain functions of the arguments and the table's settings
(numpy and the compiled kernels only).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from ps_server.config import NonFinitePolicy
from ps_server.core import kernels
from ps_server.core.batch_ops import all_finite
from ps_server.core.routing import ROUTE_SALT, shard_of
from ps_server.core.shard_data import SparseShardData
from ps_server.errors import NonFiniteGradientError, TableInputError, WrongShardError


def check_keys(table: str, keys: Any) -> np.ndarray:
    """``keys`` as a C-contiguous int64[n]; :class:`TableInputError` unless it is a 1-D numpy
    int64 array. Shard ownership is checked separately, on the keys a call misses
    (:func:`check_owned`)."""
    if not isinstance(keys, np.ndarray):
        raise TableInputError(
            table, "keys", f"must be a numpy int64 array, got {type(keys).__name__}"
        )
    if keys.dtype != np.int64:
        raise TableInputError(
            table,
            "keys",
            f"dtype must be int64, got {keys.dtype} (use keys.astype(np.int64))",
        )
    if keys.ndim != 1:
        raise TableInputError(table, "keys", f"must be 1-D, got shape {keys.shape}")
    # The shard check runs on the keys not in the table (every row's key is owned: rows
    # are only created for checked keys, checkpoints load by owned shard), so a request of
    # known keys costs no hash pass; a misrouted key is always a miss and still refused
    # before anything changes.
    return np.ascontiguousarray(keys)


def check_owned(
    table: str, keys: np.ndarray, owned: np.ndarray, all_owned: bool, num_owned: int
) -> None:
    """:class:`WrongShardError` unless ``owned`` (bool[num_shards]) holds the shard of every key
    (int64[n]); ``all_owned``: every shard is, nothing to check; ``num_owned``: for the
    message."""
    if all_owned or keys.shape[0] == 0:
        return
    if kernels.ENABLED and kernels.first_unowned(keys, ROUTE_SALT, owned.view(np.uint8)) < 0:
        return  # the common case, in one compiled pass; the message is built below
    num_shards = owned.shape[0]
    wrong = ~owned[shard_of(keys, num_shards)]
    if wrong.any():
        raise WrongShardError(
            table,
            "keys",
            f"{int(wrong.sum())} of {keys.shape[0]} keys (e.g. {int(keys[wrong][0])}) "
            "belong "
            f"to shards this server does not own (it owns {num_owned} of "
            f"{num_shards}); route keys with ps_server.group_by_server",
        )


def check_grads(table: str, keys: np.ndarray, grads: Any, dim: int) -> np.ndarray:
    """``grads`` as a C-contiguous float32[len(keys), dim]; :class:`TableInputError` unless it is
    a numpy float32 array of that shape."""
    if not isinstance(grads, np.ndarray):
        raise TableInputError(
            table, "grads", f"must be a numpy float32 array, got {type(grads).__name__}"
        )
    if grads.dtype != np.float32:
        raise TableInputError(
            table,
            "grads",
            f"dtype must be float32, got {grads.dtype} (use grads.astype(np.float32))",
        )
    if grads.shape != (keys.shape[0], dim):
        raise TableInputError(
            table,
            "grads",
            f"shape must be (len(keys), dim) = ({keys.shape[0]}, {dim}), got {grads.shape}",
        )
    return np.ascontiguousarray(grads)


def check_shows(table: str, shows: Any, n: int) -> np.ndarray:
    """``shows`` as int64[n] of counts >= 0; :class:`TableInputError` naming ``shows``
    otherwise."""
    arr = np.asarray(shows)
    if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
        raise TableInputError(
            table,
            "shows",
            f"must be {n} integer show counts (one per key), got dtype {arr.dtype} shape "
            f"{arr.shape}",
        )
    arr = arr.astype(np.int64, copy=False)
    if n and int(arr.min()) < 0:
        raise TableInputError(table, "shows", f"show counts must be >= 0, got {int(arr.min())}")
    return arr


def check_state_deltas(table: str, state_deltas: Any, n: int, state_dim: int) -> np.ndarray:
    """``state_deltas`` as float32[n, state_dim]; :class:`TableInputError` naming
    ``state_deltas`` otherwise."""
    arr = np.asarray(state_deltas)
    if arr.shape != (n, state_dim) or arr.dtype.kind != "f":
        raise TableInputError(
            table,
            "state_deltas",
            f"must be float (len(keys), state_dim) = ({n}, {state_dim}) optimizer-state "
            f"deltas, got dtype {arr.dtype} shape {arr.shape}",
        )
    return arr.astype(np.float32, copy=False)


def drop_nonfinite(
    table: str, policy: NonFinitePolicy, keys: np.ndarray, values: np.ndarray, field: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """(keys, values, rows dropped) without the rows carrying NaN/inf under
    ``nonfinite="skip"``; :class:`NonFiniteGradientError` naming ``field`` under ``"reject"``."""
    if all_finite(values):
        return keys, values, 0
    finite = np.isfinite(values)
    bad_rows = ~finite.all(axis=1)
    if policy is NonFinitePolicy.REJECT:
        raise NonFiniteGradientError(table, int((~finite).sum()), int(bad_rows.sum()), field=field)
    return keys[~bad_rows], values[~bad_rows], int(bad_rows.sum())


def drop_nonfinite_rows(
    table: str,
    policy: NonFinitePolicy,
    keys: np.ndarray,
    arrays: Sequence[np.ndarray | None],
    field: str,
) -> tuple[np.ndarray, list[np.ndarray | None], int]:
    """:func:`drop_nonfinite` over several per-row ``arrays`` (None: absent): a row goes when
    any 2-D float array holds NaN/inf in it; the others (show counts) ride along."""
    floats = [a for a in arrays if a is not None and a.ndim == 2]
    if all(all_finite(a) for a in floats):
        return keys, list(arrays), 0
    bad = np.zeros(keys.shape[0], dtype=bool)
    values = 0
    for a in floats:
        finite = np.isfinite(a)
        values += int((~finite).sum())
        bad |= ~finite.all(axis=1)
    if policy is NonFinitePolicy.REJECT:
        raise NonFiniteGradientError(table, values, int(bad.sum()), field=field)
    keep = ~bad
    return keys[keep], [None if a is None else a[keep] for a in arrays], int(bad.sum())


def check_import(
    table: str,
    payload: SparseShardData,
    shards: Collection[int],
    num_shards: int,
    counts_pending: bool,
) -> None:
    """:class:`TableInputError` unless a table owning ``shards`` (of ``num_shards``) can import
    ``payload``: its shard is owned, every key belongs to it, count-filter keys only when the
    table's entry policy counts (``counts_pending``)."""
    d = payload
    if d.shard not in shards:
        raise TableInputError(table, "shard", f"shard {d.shard} is not owned by this server")
    for keys in (d.keys, d.pending_keys):
        if keys.shape[0] and (shard_of(keys, num_shards) != d.shard).any():
            raise TableInputError(
                table, "shard", f"the file of shard {d.shard} holds keys of other shards"
            )
    if d.pending_keys.shape[0] and not counts_pending:
        raise TableInputError(
            table,
            "entry",
            "the checkpoint has count-filter keys but this table's entry policy does not count",
        )


__all__ = ["check_grads", "check_import", "check_keys", "check_owned", "drop_nonfinite"]
