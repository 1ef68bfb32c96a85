"""GEO deltas for sparse tables: :func:`add_sparse_delta` adds trainers' parameter deltas
straight to the rows, no optimizer rule (dense blocks: :meth:`DenseTable.add`).

In GEO mode (Paddle's ``GeoCommunicator``) a trainer trains local copies of the rows it touched
and every K steps sends ``local - value_at_last_exchange``; the server adds those deltas, so the
updates of several trainers sum. A missing row is first created with its deterministic initial
value (as a pull would create it: the entry policy applies, and the table's ``pull_keys`` counter
counts these keys), then the delta is added. Keys the entry policy has not admitted are dropped
and counted as ``filtered``. Duplicated keys are summed first. A delta marks its rows as pushed
(``unseen_days = 0``, ``count`` += occurrences) and changed (in the next delta checkpoint).
Non-finite deltas follow the table's ``nonfinite`` policy, like gradients.

It works on the table's row storage (``SparseTable.store``: lookup, gather, scatter, the
metadata columns) under the table's lock, as the table's own push does.
"""

from __future__ import annotations

import numpy as np

from ps_server.batch_ops import all_finite, saturating_add, sum_duplicates
from ps_server.config import NonFinitePolicy
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
    if not all_finite(deltas):
        finite = np.isfinite(deltas)
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


__all__ = ["add_sparse_delta"]
