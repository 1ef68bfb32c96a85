"""A pass's pull from an SSD table: rows read through both tiers, none moved or created.

A pass cache (``fleet.begin_pass``) pulls every row of its pass once, with the rows' optimizer
state, trains them on the trainer and sends their deltas back once at the pass's end
(:meth:`~ps_server.core.sparse_table.SparseTable.add_delta`). A memory table's pull creates the
rows it misses. An SSD table whose memory holds a small share of a pass's rows cannot take them
in without evicting them at once: each row would be written to RocksDB by that eviction, read
back by the delta push and written again.

So an SSD table serves a pull with state by reading through: rows in memory are read there,
cold rows from the write-behind queue or RocksDB and left where they are (no promotion, no
delete op, no eviction), and a key without a row gets the initial values and optimizer state
its row would be created with (initializers are deterministic per key, so the row the delta
push creates starts from the same values the trainer trained from). The delta push then
creates or promotes each row once, and the eviction after it writes it once.

What differs from a memory table: the rows a pass pulls for the first time exist from its
delta push on, not from its pull (``num_rows`` and ``rows_created`` count them then), and a key
pulled and never pushed gets no row. Every row a pass trains ends as on a memory table, and
``pulls_unadmitted`` counts the keys the entry policy would not have admitted, as a memory
table's pull does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ps_server.core.batch_ops import distinct, pull_buffer

if TYPE_CHECKING:
    from ps_server.core.ssd_table import SsdSparseTable


def pull_through(
    table: SsdSparseTable,
    keys: np.ndarray,
    out: np.ndarray | None,
    state_out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(float32[n, dim] values, float32[n, state_dim] optimizer state) of checked int64
    ``keys`` (duplicates allowed) over both tiers, nothing moved or created (hold the lock).
    ``out`` / ``state_out``: buffers to fill, as :meth:`SparseTable.pull`'s ``out``."""
    n = int(keys.shape[0])
    values = pull_buffer(table.name, n, table.dim, out)
    state = pull_buffer(table.name, n, table.state_dim, state_out)
    rule = table.config.optimizer
    st = table.store
    rows = st.lookup(keys)
    hot = rows >= 0
    nhot = int(np.count_nonzero(hot))
    tier = table._tier
    tier["hot_hits"] += nhot
    tier["hot_misses"] += n - nhot
    table._counters["pull_keys"] += n
    if nhot:
        st.gather_into("values", rows, values)
        st.gather_into("state", rows, state)
    if nhot == n:
        return values, state
    miss = np.flatnonzero(~hot)
    mkeys, inv, _ = distinct(keys[miss])
    table.check_owned(mkeys)
    m = int(mkeys.shape[0])
    mvalues = np.empty((m, table.dim), np.float32)
    mstate = np.empty((m, table.state_dim), np.float32)
    found = np.zeros(m, dtype=bool)
    if table._cold_rows:
        at_queue, queued, at_disk, rec = table._cold_lookup(mkeys)
        mvalues[at_queue] = queued["values"]
        mstate[at_queue] = queued["state"]
        mvalues[at_disk] = rec["values"]
        mstate[at_disk] = rec["state"]
        tier["cold_hits"] += int(at_disk.shape[0] + at_queue.shape[0])
        found[at_queue] = True
        found[at_disk] = True
    new = np.flatnonzero(~found)
    if new.shape[0]:
        nkeys = mkeys[new]
        if table.config.entry is not None:  # keys a memory table's pull would not admit
            refused = np.zeros(m, dtype=bool)
            refused[new] = ~table._admit(nkeys, table._pending_counts(nkeys)[1])
            table._counters["pulls_unadmitted"] += int(np.count_nonzero(refused[inv]))
        mvalues[new] = table.initial_values(nkeys)
        fresh = np.empty((new.shape[0], table.state_dim), np.float32)
        rule.init_state(fresh)
        mstate[new] = fresh
    values[miss] = mvalues[inv]
    state[miss] = mstate[inv]
    return values, state


__all__ = ["pull_through"]
