"""Table operations the RPC layer needs that the table classes do not offer (yet).

**GEO deltas** (:func:`add_sparse_delta`, :func:`add_dense_delta`): add trainers' parameter
deltas straight to the rows, no optimizer rule. In GEO mode (Paddle's ``GeoCommunicator``) a
trainer trains local copies of the rows it touched and every K steps sends ``local - value_at_last_exchange``; the server adds those deltas, so the
updates of several trainers sum. A missing row is first created with its deterministic initial
value (as a pull would create it: the entry policy applies, and the table's ``pull_keys`` counter
counts these keys), then the delta is added. Keys the entry policy has not admitted are dropped
and counted as ``filtered``. Duplicated keys are summed first. A delta marks its rows as pushed
(``unseen_days = 0``, ``count`` += occurrences) and changed (in the next delta checkpoint).
Non-finite deltas follow the table's ``nonfinite`` policy, like gradients.

**Dense block size and slices** (:func:`dense_numel`, :func:`dense_slice`): the size of a
block (SYNC pushes are checked on arrival) and a slice of it without copying the whole block
(a block larger than one message is pulled in ranges).

The tables have no public in-place "add" or slice yet, so this module works on the table's
storage (``SparseTable.store``) and, for dense tables, on the block lookup of
:class:`DenseTable`; it holds the table's lock throughout, exactly as the table's own methods do.
Moving these into the table classes (``SparseTable.add``, ``DenseTable.add``/``slice``) is the
natural next step.
"""

from __future__ import annotations

import numpy as np

from ps_server.batch_ops import saturating_add, sum_duplicates
from ps_server.config import NonFinitePolicy
from ps_server.dense_table import DenseTable
from ps_server.errors import NonFiniteGradientError, TableInputError
from ps_server.row_store import DIRTY, SEEN
from ps_server.sparse_table import PushStats, SparseTable

_U32_MAX = np.iinfo(np.uint32).max


def add_sparse_delta(table: SparseTable, keys: np.ndarray, deltas: np.ndarray) -> PushStats:
    """Add ``deltas`` float32[n, dim] to the rows of ``keys`` int64[n] (see the module doc)."""
    n = int(keys.shape[0])
    if deltas.shape != (n, table.dim):
        raise TableInputError(
            table.name,
            "grads",
            f"deltas shape must be (len(keys), dim) = ({n}, {table.dim}), got {deltas.shape}",
        )
    skipped = 0
    finite = np.isfinite(deltas)
    if not finite.all():
        bad_rows = ~finite.all(axis=1)
        if table.config.nonfinite is NonFinitePolicy.REJECT:
            raise NonFiniteGradientError(
                table.name, int((~finite).sum()), int(bad_rows.sum()), field="deltas"
            )
        skipped = int(bad_rows.sum())
        keys, deltas = keys[~bad_rows], deltas[~bad_rows]
    with table.lock:
        before = table.num_rows
        table.pull(keys)  # validates the keys (dtype, shard) and creates the admitted rows
        created = max(table.num_rows - before, 0)
        store = table.store
        rows = store.lookup(keys)
        keep = rows >= 0
        filtered = int((~keep).sum())
        if filtered:
            rows, deltas = rows[keep], deltas[keep]
        urows, udeltas, occ = sum_duplicates(rows, np.ascontiguousarray(deltas), store.high_water)
        if urows.shape[0]:
            values = store.gather("values", urows)
            values += udeltas
            store.scatter("values", urows, values)
            store.cols["count"][urows] = saturating_add(
                store.cols["count"][urows], occ, _U32_MAX, np.uint32
            )
            store.cols["unseen_days"][urows] = 0
            store.flags[urows] |= SEEN | DIRTY
    return PushStats(n, int(urows.shape[0]), created, filtered, skipped, 0)


def add_dense_delta(table: DenseTable, name: str, delta: np.ndarray) -> bool:
    """Add ``delta`` (float32, the block's element count) to block ``name``; False when skipped
    for NaN/inf under ``nonfinite="skip"``."""
    table.pull(name)  # validates the name and its shard; NOT_FOUND for a missing block
    with table.lock:
        block = table._block(name)
        flat = np.asarray(delta, dtype=np.float32).reshape(1, -1)
        if flat.shape[1] != block.values.shape[1]:
            raise TableInputError(
                table.name,
                "grad",
                f"delta of {name!r} has {flat.shape[1]} elements, the block has "
                f"{block.values.shape[1]}",
            )
        bad = int((~np.isfinite(flat)).sum())
        if bad:
            if table.config.nonfinite is NonFinitePolicy.REJECT:
                raise NonFiniteGradientError(table.name, bad, 1, field=f"delta of {name!r}")
            return False
        block.values += flat
        block.dirty = True
        return True


def dense_numel(table: DenseTable, name: str) -> int:
    """Elements of block ``name`` (TableNotFoundError if missing, WrongShardError if not ours)."""
    name = table._check_name(name)
    with table.lock:
        return int(table._block(name).values.shape[1])


def dense_slice(table: DenseTable, name: str, offset: int, count: int) -> tuple[np.ndarray, int]:
    """(a copy of elements ``[offset, offset + count)`` of block ``name``, the block's size);
    ``count == 0`` means up to the end."""
    name = table._check_name(name)
    with table.lock:
        values = table._block(name).values[0]
        total = int(values.shape[0])
        if offset > total:
            raise TableInputError(
                table.name, "offset", f"{offset} is past the end of {name!r} ({total} elements)"
            )
        end = total if count == 0 else min(total, offset + count)
        table._counters["pulls"] += 1
        return values[offset:end].copy(), total


__all__ = ["add_dense_delta", "add_sparse_delta", "dense_numel", "dense_slice"]
