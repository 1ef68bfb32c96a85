"""Sparse (embedding) table: int64 keys → float32 rows, server-side optimizer, admission, aging.

One :class:`SparseTable` per (table, server) holds the rows of the shards that server owns, in one
:class:`~ps_server.core.row_store.RowStore` (the shard is a pure function of the key, recomputed
when a checkpoint is written per shard, :mod:`ps_server.core.sparse_shards`). Calls are vectorised
over a batch and thread-safe (one lock).

Semantics (Paddle's ``MemorySparseTable`` + ``CtrCommonAccessor`` where they apply):

* ``pull(keys)`` returns ``float32[n, dim]``. A missing key gets a row with its deterministic
  initial value (a pure function of table name, key, seed) if the entry policy admits it;
  otherwise the same initial value is returned and nothing is stored. Pulls are reads: they do
  not count as "seen" and do not reset ``unseen_days`` (evaluation pulls and retried RPCs must not
  keep a row alive) — as in Paddle, where only the push (``Update``) resets them.
* ``push(keys, grads)`` sums the gradients of duplicated keys first, then applies the rule once
  per distinct row. A missing key is created (subject to the entry policy) and then updated.
* ``add_delta(keys, deltas)`` (GEO) adds parameter deltas to the rows, no optimizer rule.
* ``count`` — Paddle's *show* count: the number of occurrences of the key in pushes (a key twice
  in one push counts 2, as Paddle's per-instance show of 1 is summed). Pulls do not count.
  ``CountFilterEntry(n)`` admits a key by the push that brings this count to ``n``.
* ``unseen_days`` — days since the key was last pushed. A push sets it to 0 and marks the row
  seen; ``end_day()`` sets it to 0 for rows seen since the previous end_day and adds 1 to every
  other row (saturating at 65535), then clears the seen marks — Paddle's ``UnseenDays`` reset in
  ``Update`` and day-end increment. ``shrink(max_unseen_days)`` deletes rows (and pending
  count-filter entries) with ``unseen_days > max_unseen_days`` (Paddle's
  ``delete_after_unseen_days``).
* ``max_capacity``: before creating rows that would exceed it, the rows with the largest
  ``unseen_days`` (then the smallest ``count``) are evicted, never a row touched by the current
  batch. This costs O(rows) per batch that evicts; a daily ``shrink`` keeps most batches below.
* Non-finite gradients: ``nonfinite="reject"`` raises :class:`NonFiniteGradientError` before
  anything changes; ``"skip"`` drops the rows (occurrences) that carry NaN/inf and counts them.

Storage is column arrays + a numpy open-addressing hash index, not a Python object per key; why,
with the measured memory and throughput of the alternatives, is in :mod:`ps_server.core.row_store`
(1 M rows at dim 8 with Adagrad: 1.12x the payload, pull 7.8 M rows/s, push 2.75 M rows/s at
64k-key batches on 2 CPU cores).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ps_server.config import SparseTableConfig
from ps_server.core import kernels, sparse_inputs, sparse_shards
from ps_server.core.batch_ops import (
    distinct,
    pull_buffer,
    saturating_add,
    shows_per_row,
    sum_duplicates,
)
from ps_server.core.hash_index import HashIndex, KeyIndex
from ps_server.core.hashing import KeyRNG
from ps_server.core.optimizers import RowsMeta
from ps_server.core.row_flags import CHANGED, LIVE, SEEN
from ps_server.core.row_store import RowStore
from ps_server.core.shard_data import SparseShardData
from ps_server.core.table import ChangeLog, PushStats, Table, TableSnapshot
from ps_server.errors import TableCapacityError, TableInputError

logger = logging.getLogger(__name__)

_U32_MAX = np.iinfo(np.uint32).max
_U16_MAX = np.iinfo(np.uint16).max


class SparseTable(Table):
    """The rows of one sparse table that this server owns (see the module docstring)."""

    KIND = "sparse"

    def __init__(
        self,
        config: SparseTableConfig,
        shards: Iterable[int] | None = None,
        *,
        index_factory: Callable[[], KeyIndex] = HashIndex,
    ) -> None:
        """``shards``: the shards this server owns (default all); ``index_factory`` picks the key
        index (``HashIndex``; ``DictIndex`` exists for tests and benchmarks)."""
        if not isinstance(config, SparseTableConfig):
            raise TypeError(f"SparseTable needs a SparseTableConfig, got {type(config).__name__}")
        super().__init__(config, shards)
        self.dim = config.dim
        self._state_dim = config.optimizer.state_dim(config.dim)
        self._fused = kernels.push_hyper(config.optimizer)
        """(rule id, hyper-parameters) when pushes take the compiled kernel, else None."""
        self._owned = np.zeros(config.num_shards, dtype=bool)
        self._owned[list(self.shards)] = True
        self._all_owned = bool(self._owned.all())
        self.store = RowStore(
            {
                "values": ((self.dim,), np.float32),
                "state": ((self._state_dim,), np.float32),
                "count": ((), np.uint32),
                "unseen_days": ((), np.uint16),
            },
            index_factory=index_factory,
        )
        entry = config.entry
        self.pending: RowStore | None = None
        if entry is not None and entry.tracks_counts:
            self.pending = RowStore(
                {"count": ((), np.uint32), "unseen_days": ((), np.uint16)},
                index_factory=index_factory,
            )
        self._counters = dict.fromkeys(
            (
                "pull_keys",
                "push_keys",
                "rows_created",
                "rows_evicted",
                "rows_shrunk",
                "pending_shrunk",
                "pulls_unadmitted",
                "pushes_filtered",
                "nonfinite_skipped",
            ),
            0,
        )

    # -- properties ---------------------------------------------------------------------------
    @property
    def state_dim(self) -> int:
        """float32 optimizer-state values per row."""
        return self._state_dim

    @property
    def num_rows(self) -> int:
        """Rows with a trainable value (pending count-filter keys not included)."""
        return self.store.num_rows

    @property
    def num_pending(self) -> int:
        """Keys counted by a count-filter policy but not admitted yet."""
        return 0 if self.pending is None else self.pending.num_rows

    @property
    def memory_bytes(self) -> int:
        """Bytes of all arrays of this table (rows, pending store, indexes; allocated capacity)."""
        return self.store.memory_bytes + (0 if self.pending is None else self.pending.memory_bytes)

    def payload_bytes_per_row(self) -> int:
        """Bytes a row needs at minimum: key + values + state + count (u32) + unseen_days (u16)."""
        return 8 + 4 * self.dim + 4 * self._state_dim + 4 + 2

    def stats(self) -> dict[str, Any]:
        """Sizes and cumulative counters (plain data)."""
        with self.lock:
            rows = self.num_rows
            return {
                "table": self.name,
                "kind": self.KIND,
                "shards": len(self.shards),
                "num_rows": rows,
                "num_pending": self.num_pending,
                "capacity": self.store.capacity,
                "memory_bytes": self.memory_bytes,
                "bytes_per_row": self.memory_bytes / rows if rows else 0.0,
                "payload_bytes_per_row": self.payload_bytes_per_row(),
                **self._counters,
            }

    # -- validation (ps_server.core.sparse_inputs) --------------------------------------------
    def _check_keys(self, keys: Any) -> np.ndarray:
        return sparse_inputs.check_keys(self.name, keys)

    def check_owned(self, keys: np.ndarray) -> None:
        """:class:`WrongShardError` unless this server owns the shard of every key (int64[n])."""
        sparse_inputs.check_owned(self.name, keys, self._owned, self._all_owned, len(self.shards))

    # -- initial values and admission ---------------------------------------------------------
    def initial_values(self, keys: np.ndarray) -> np.ndarray:
        """float32[n, dim]: the value a new row of each key starts from (deterministic)."""
        return self.config.initializer.rows(self.name, self.config.seed, keys, self.dim)

    def _admit(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        entry = self.config.entry
        if entry is None or keys.shape[0] == 0:
            return np.ones(keys.shape[0], dtype=bool)
        rng = KeyRNG(self.name, self.config.seed, keys, "entry")
        return np.asarray(entry.admit(keys, counts, rng), dtype=bool)

    def _pending_counts(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pending row or -1, count so far) of distinct keys without a row."""
        if self.pending is None:
            return np.full(keys.shape[0], -1, dtype=np.int64), np.zeros(
                keys.shape[0], dtype=np.int64
            )
        prow = self.pending.lookup(keys)
        counts = np.zeros(keys.shape[0], dtype=np.int64)
        has = prow >= 0
        counts[has] = self.pending.cols["count"][prow[has]]
        return prow, counts

    def _evict_for(self, num_new: int, protect: np.ndarray) -> int:
        cap = self.config.max_capacity
        if cap is None:
            return 0
        overflow = self.store.num_rows + num_new - cap
        if overflow <= 0:
            return 0
        if num_new > cap:
            raise TableCapacityError(
                f"table {self.name!r}: one batch creates {num_new} rows but max_capacity is {cap}; "
                "send smaller batches or raise max_capacity"
            )
        hw = self.store.high_water
        candidate = (self.store.flags[:hw] & LIVE).astype(bool)
        candidate[protect[protect >= 0]] = False
        rows = np.flatnonzero(candidate)
        if rows.shape[0] < overflow:
            raise TableCapacityError(
                f"table {self.name!r}: needs {overflow} free rows under max_capacity={cap} "
                "but only "
                f"{rows.shape[0]} rows are not in use by this batch; send smaller batches or raise "
                "max_capacity"
            )
        unseen = self.store.cols["unseen_days"][rows].astype(np.int64)
        count = self.store.cols["count"][rows].astype(np.int64)
        score = (unseen << 32) | (_U32_MAX - count)  # most unseen first, then least counted
        victims = rows[np.argpartition(-score, overflow - 1)[:overflow]]
        self.store.remove_rows(victims)
        self._counters["rows_evicted"] += overflow
        return overflow

    def _create(
        self, keys: np.ndarray, counts: np.ndarray | None, protect: np.ndarray
    ) -> tuple[np.ndarray, int]:
        """Rows for admitted distinct keys, initialised with their ``counts`` (None: 0);
        returns (rows, evicted)."""
        n = keys.shape[0]
        evicted = self._evict_for(n, protect)
        st = self.store
        hw = st.high_water
        rows = st.allocate(keys)
        # all rows new past the high-water mark (no freed row reused): fill them as slices
        at: slice | np.ndarray = slice(hw, hw + n) if st.high_water - hw == n else rows
        self.config.initializer.write_rows(self.name, self.config.seed, keys, st.cols["values"], at)
        if isinstance(at, slice):
            self.config.optimizer.init_state(st.cols["state"][at])
        else:
            state = np.empty((n, self._state_dim), dtype=np.float32)
            self.config.optimizer.init_state(state)
            st.scatter("state", rows, state)
        st.cols["count"][at] = 0 if counts is None else np.minimum(counts, _U32_MAX)
        st.cols["unseen_days"][at] = 0
        self._counters["rows_created"] += int(keys.shape[0])
        return rows, evicted

    def _admit_and_create(self, keys: np.ndarray, protect: np.ndarray) -> np.ndarray:
        """Rows (-1: not admitted) for distinct keys a pull misses, under the entry policy."""
        prow, counts = self._pending_counts(keys)
        admit = self._admit(keys, counts)
        rows = np.full(keys.shape[0], -1, dtype=np.int64)
        if admit.any():
            rows[admit], _ = self._create(keys[admit], counts[admit], protect)
            if self.pending is not None and (admit & (prow >= 0)).any():
                self.pending.remove_rows(prow[admit & (prow >= 0)])
        return rows

    # -- pull / push --------------------------------------------------------------------------
    def pull(self, keys: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """float32[n, dim] rows of ``keys`` (int64[n], duplicates allowed); creates admitted
        rows. ``out``: a writable C-contiguous float32[n, dim] to fill (and return) instead of
        a new array (the server writes a shared-memory reply in place)."""
        keys = self._check_keys(keys)
        out = pull_buffer(self.name, keys.shape[0], self.dim, out)
        with self.lock:
            rows = self.store.lookup(keys)
            miss = rows < 0
            if miss.any():
                every = bool(miss.all())  # a first pass: no key held yet
                mkeys, inv, _ = distinct(keys if every else keys[miss])
                self.check_owned(mkeys)
                if self.config.entry is None:  # every key admitted, nothing pending
                    mrows, _ = self._create(mkeys, None, rows)
                else:
                    mrows = self._admit_and_create(mkeys, rows)
                if every:
                    rows = mrows[inv]
                else:
                    rows[miss] = mrows[inv]
            self.store.gather_into("values", rows, out)
            unadmitted = rows < 0
            if unadmitted.any():
                out[unadmitted] = self.initial_values(keys[unadmitted])
                self._counters["pulls_unadmitted"] += int(unadmitted.sum())
            self._counters["pull_keys"] += int(keys.shape[0])
            return out

    def pull_with_state(
        self, keys: np.ndarray, out: np.ndarray | None = None, state_out: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(:meth:`pull` of ``keys``, float32[n, state_dim] optimizer state of their rows) under
        one lock; a key without a row (not admitted) gets the rule's initial state. A pass
        cache seeds its rows with both, so the rule continues across passes. ``out`` /
        ``state_out``: buffers to fill, as :meth:`pull`'s ``out``."""
        keys = self._check_keys(keys)
        with self.lock:
            values = self.pull(keys, out)
            state = pull_buffer(self.name, keys.shape[0], self._state_dim, state_out)
            self.config.optimizer.init_state(state)
            self.store.gather_into("state", self.store.lookup(keys), state)
            return values, state

    def push(self, keys: np.ndarray, grads: np.ndarray) -> PushStats:
        """Apply ``grads`` float32[n, dim] to the rows of ``keys`` int64[n] (duplicates summed)."""
        keys = self._check_keys(keys)
        grads = sparse_inputs.check_grads(self.name, keys, grads, self.dim)
        n = int(keys.shape[0])
        keys, grads, skipped = sparse_inputs.drop_nonfinite(
            self.name, self.config.nonfinite, keys, grads, "grads"
        )
        with self.lock:
            created = filtered = evicted = 0
            rows = self.store.lookup(keys)
            miss = rows < 0
            if miss.any():
                mkeys, inv, occ = distinct(keys[miss])
                self.check_owned(mkeys)
                prow, before = self._pending_counts(mkeys)
                counts = before + occ
                admit = self._admit(mkeys, counts)
                mrows = np.full(mkeys.shape[0], -1, dtype=np.int64)
                if admit.any():
                    # the row starts with the pushes counted before it; this push adds ``occ`` below
                    mrows[admit], evicted = self._create(mkeys[admit], before[admit], rows)
                    created = int(admit.sum())
                refused = ~admit
                filtered = int(occ[refused].sum())
                if self.pending is not None:
                    self._update_pending(mkeys, prow, counts, admit)
                rows[miss] = mrows[inv.reshape(-1)]
            keep = rows >= 0
            if not keep.all():
                rows, grads = rows[keep], grads[keep]
            applied = self._apply_grads(rows, grads)
            self._counters["push_keys"] += n
            self._counters["pushes_filtered"] += filtered
            self._counters["nonfinite_skipped"] += skipped
            return PushStats(n, applied, created, filtered, skipped, evicted)

    def add_delta(
        self,
        keys: np.ndarray,
        deltas: np.ndarray,
        shows: np.ndarray | None = None,
        state_deltas: np.ndarray | None = None,
    ) -> PushStats:
        """Add ``deltas`` float32[n, dim] to the rows of ``keys`` int64[n], no optimizer rule
        (GEO: trainers send ``local - value_at_last_exchange`` every K steps and the deltas of
        several trainers sum, as in Paddle's ``GeoCommunicator``).

        A missing row is first created as a pull creates it (the entry policy applies; the
        ``pull_keys`` counter counts these keys), then the delta is added; keys the policy has
        not admitted are dropped and counted as ``filtered``. Duplicated keys are summed first.
        A delta marks its rows pushed (``unseen_days = 0``, ``count`` += occurrences, or the
        sum of ``shows`` of its keys: the show counts a pass cache counted in its examples) and
        changed (in the next delta checkpoint). With ``shows``, keys the entry policy has not
        admitted count their shows toward admission as a push counts its occurrences (a count
        filter admits a key once its shows reach the threshold, and the delta goes to the new
        row); without, they are dropped. ``state_deltas`` float32[n, state_dim]: changes of
        the rows' optimizer state, merged by the rule's ``add_state_delta`` (summed over
        duplicates, as the deltas). NaN/inf in either follow ``nonfinite`` as gradients do.
        """
        n = int(keys.shape[0])
        if deltas.shape != (n, self.dim):
            raise TableInputError(
                self.name,
                "grads",
                f"deltas shape must be (len(keys), dim) = ({n}, {self.dim}), got {deltas.shape}",
            )
        if state_deltas is not None:
            state_deltas = sparse_inputs.check_state_deltas(
                self.name, state_deltas, n, self._state_dim
            )
        if shows is not None:
            shows = sparse_inputs.check_shows(self.name, shows, n)
        keys, (deltas, state_deltas, shows), skipped = sparse_inputs.drop_nonfinite_rows(
            self.name, self.config.nonfinite, keys, (deltas, state_deltas, shows), "deltas"
        )
        assert deltas is not None
        with self.lock:
            before = self.num_rows
            self.pull(keys)  # validates the keys (dtype, shard) and creates the admitted rows
            created = max(self.num_rows - before, 0)
            st = self.store
            rows = st.lookup(keys)
            evicted = 0
            if shows is not None and (rows < 0).any():
                more, evicted = self._admit_shown(keys, rows, shows)
                created += more
            keep = rows >= 0
            filtered = int((~keep).sum())
            if filtered:
                rows, deltas = rows[keep], deltas[keep]
                shows = None if shows is None else shows[keep]
                state_deltas = None if state_deltas is None else state_deltas[keep]
            urows, udeltas, occ = sum_duplicates(rows, np.ascontiguousarray(deltas), st.high_water)
            if shows is not None:
                occ = shows_per_row(rows, urows, shows)
            if state_deltas is not None and urows.shape[0] != rows.shape[0]:
                state_deltas = sum_duplicates(rows, state_deltas, st.high_water)[1]
            if urows.shape[0]:
                values = st.gather("values", urows)
                values += udeltas
                st.scatter("values", urows, values)
                if state_deltas is not None:
                    state = st.gather("state", urows)
                    self.config.optimizer.add_state_delta(state, state_deltas)
                    st.scatter("state", urows, state)
                st.cols["count"][urows] = saturating_add(
                    st.cols["count"][urows], occ, _U32_MAX, np.uint32
                )
                st.cols["unseen_days"][urows] = 0
                st.flags[urows] |= SEEN | CHANGED
        return PushStats(n, int(urows.shape[0]), created, filtered, skipped, evicted)

    def _admit_shown(
        self, keys: np.ndarray, rows: np.ndarray, shows: np.ndarray
    ) -> tuple[int, int]:
        """A delta with show counts: its keys without a row count their shows toward the entry
        policy as a push counts its occurrences; rows are created for the keys it admits
        (``rows`` filled in place). Returns (rows created, rows evicted)."""
        miss = rows < 0
        mkeys, inv, _ = distinct(keys[miss])
        inv = inv.reshape(-1)
        shown = np.bincount(inv, weights=shows[miss], minlength=mkeys.shape[0]).astype(np.int64)
        prow, before = self._pending_counts(mkeys)
        counts = before + shown
        admit = self._admit(mkeys, counts)
        mrows = np.full(mkeys.shape[0], -1, dtype=np.int64)
        evicted = 0
        if admit.any():  # the row starts with the shows counted before; the delta adds its own
            mrows[admit], evicted = self._create(mkeys[admit], before[admit], rows)
        if self.pending is not None:
            self._update_pending(mkeys, prow, counts, admit)
        rows[miss] = mrows[inv]
        return int(admit.sum()), evicted

    def _update_pending(
        self, keys: np.ndarray, prow: np.ndarray, counts: np.ndarray, admit: np.ndarray
    ) -> None:
        pending = self.pending
        assert pending is not None
        gone = admit & (prow >= 0)
        if gone.any():
            pending.remove_rows(prow[gone])
        refused = ~admit
        old = refused & (prow >= 0)
        new = refused & (prow < 0)
        rows = np.concatenate([prow[old], pending.allocate(keys[new])])
        if rows.shape[0]:
            order = np.concatenate([np.flatnonzero(old), np.flatnonzero(new)])
            pending.cols["count"][rows] = np.minimum(counts[order], _U32_MAX).astype(np.uint32)
            pending.cols["unseen_days"][rows] = 0
            pending.flags[rows] |= SEEN | CHANGED

    def _apply_grads(self, rows: np.ndarray, grads: np.ndarray) -> int:
        """Sum duplicated rows' gradients and apply the rule once per distinct row; returns the
        distinct rows (compiled kernel for the built-in rules, see ps_server.core.kernels)."""
        fused = self._fused
        if fused is not None:
            return kernels.push(fused[0], fused[1], self.store.cols, self.store.flags, rows, grads)
        urows, ugrads, occ_rows = sum_duplicates(rows, grads, self.store.high_water)
        self._apply(urows, ugrads, occ_rows)
        return int(urows.shape[0])

    def _apply(self, rows: np.ndarray, grads: np.ndarray, occ: np.ndarray) -> None:
        if rows.shape[0] == 0:
            return
        st = self.store
        weights = st.gather("values", rows)
        state = st.gather("state", rows)
        count = saturating_add(st.cols["count"][rows], occ, _U32_MAX, np.uint32)
        unseen = np.zeros(rows.shape[0], dtype=np.uint16)
        self.config.optimizer.update(weights, state, grads, RowsMeta(count, unseen))
        st.scatter("values", rows, weights)
        st.scatter("state", rows, state)
        st.cols["count"][rows] = count
        st.cols["unseen_days"][rows] = unseen
        st.flags[rows] |= SEEN | CHANGED

    # -- aging --------------------------------------------------------------------------------
    def end_day(self) -> None:
        """Close a day: rows pushed since the last end_day get ``unseen_days = 0``, every other
        row ``unseen_days += 1``; the seen marks are cleared (see the module docstring); every
        show count is multiplied by ``config.show_decay_rate`` (rounded down)."""
        rate = float(self.config.show_decay_rate)
        with self.lock:
            for store in (self.store, self.pending):
                if store is None:
                    continue
                hw = store.high_water
                flags = store.flags[:hw]
                unseen = store.cols["unseen_days"][:hw]
                seen = (flags & SEEN).astype(bool)
                aged = np.minimum(unseen.astype(np.int32) + 1, _U16_MAX).astype(np.uint16)
                unseen[:] = np.where(seen, np.uint16(0), aged)
                flags &= ~SEEN
                if rate != 1.0:  # show decay: not a change a delta carries (loads replay it)
                    count = store.cols["count"][:hw]
                    count[:] = np.floor(count * rate).astype(np.uint32)
            self.days_since_save += 1

    def shrink(self, max_unseen_days: int) -> int:
        """Delete rows (and pending keys) unseen for more than ``max_unseen_days`` days; returns
        the number of rows deleted (pending keys are counted in ``stats()["pending_shrunk"]``)."""
        if not isinstance(max_unseen_days, (int, np.integer)) or max_unseen_days < 0:
            raise TableInputError(
                self.name, "max_unseen_days", f"must be an integer >= 0, got {max_unseen_days!r}"
            )
        with self.lock:
            removed = 0
            for store, counter in ((self.store, "rows_shrunk"), (self.pending, "pending_shrunk")):
                if store is None:
                    continue
                live = store.live_rows()
                old = live[store.cols["unseen_days"][live] > max_unseen_days]
                store.remove_rows(old)
                self._counters[counter] += int(old.shape[0])
                if store is self.store:
                    removed = int(old.shape[0])
                if store.num_rows < 0.5 * store.high_water:
                    store.compact()
            logger.info(
                "table %r: shrink(max_unseen_days=%d) removed %d rows, %d remain",
                self.name,
                max_unseen_days,
                removed,
                self.num_rows,
            )
            return removed

    # -- checkpoint hooks ---------------------------------------------------------------------
    def _snapshot(self, delta: bool, log: ChangeLog | None) -> sparse_shards.SparseSnapshot:
        """Copies of the row stores (memcpy; the shard split runs later, without the lock)."""
        changed = sparse_shards.CHANGE_FLAG[log] if delta and log is not None else None
        if changed is not None and not self.store.keeps_log(changed):
            raise TableInputError(
                self.name,
                "mode",
                "a delta export needs a full export first (since the table was created or "
                "loaded, none was made): export with mode='all'",
            )
        return sparse_shards.SparseSnapshot(
            self._meta(delta),
            self.store.snapshot(),
            self.pending.snapshot() if self.pending is not None else None,
            self.config.num_shards,
            changed,
        )

    def reset_changes(self, log: ChangeLog) -> None:
        """Forget the changes of change log ``log`` (SAVE also zeroes ``days_since_save``)."""
        for store in (self.store, self.pending):
            if store is not None:
                store.reset_changes(sparse_shards.CHANGE_FLAG[log])
        if log is ChangeLog.SAVE:
            self.days_since_save = 0

    def import_shard(self, payload: SparseShardData, delta: bool) -> int:
        """Upsert one shard's rows (a delta first deletes its deleted keys); returns rows read.
        The payload is checked before anything changes."""
        self.check_import(payload)
        sparse_shards.import_shard(self.store, self.pending, payload, delta)
        return int(payload.keys.shape[0])

    def check_import(self, payload: SparseShardData) -> None:
        """:class:`TableInputError` unless this table can import ``payload`` (its shard is
        owned here, every key belongs to it, count-filter keys only with a counting entry)."""
        sparse_inputs.check_import(
            self.name, payload, self.shards, self.config.num_shards, self.pending is not None
        )

    def clear(self) -> None:
        """Drop every row, pending key and change record."""
        self.store.clear()
        if self.pending is not None:
            self.pending.clear()

    def requeue_changes(self, log: ChangeLog, snapshot: TableSnapshot) -> None:
        """Every live row counts as changed for ``log`` again, the lost snapshot's deleted keys
        go back on the log (:func:`sparse_shards.requeue_changes`)."""
        with self.lock:
            sparse_shards.requeue_changes(self.store, self.pending, snapshot, log)

    def mark_saved(self) -> None:
        """Forget dirty flags, deletion logs and the end_day count since the last save."""
        self.reset_changes(ChangeLog.SAVE)


__all__ = ["PushStats", "SparseTable", "pull_buffer"]
