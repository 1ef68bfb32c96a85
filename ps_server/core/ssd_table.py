"""A sparse table larger than memory: hot rows in a :class:`RowStore`, cold rows in RocksDB.

:class:`SsdSparseTable` is a :class:`~ps_server.core.sparse_table.SparseTable` whose row store
holds at most ``config.cache_rows`` rows after every call; the others live in its
:class:`~ps_server.core.ssd_tier.ColdTier` (Paddle's ``SSDSparseTable``). A key is in exactly one
tier. Every call that takes keys runs in three batched steps under the table's lock:

1. *promote*: the keys missing from memory are read from RocksDB in one ``multi_get``; the rows
   found move to memory (and are deleted from disk in one write batch);
2. the memory table's own code runs unchanged, so the optimizer math, admission (count-filter
   pending keys stay in memory), initial values and counters are exactly a memory table's;
3. *evict*: if more than ``cache_rows`` rows are in memory, rows chosen by the policy below are
   written to RocksDB in one write batch, down to 90 % of ``cache_rows`` (the slack makes the
   next calls' new rows cost no eviction).

Eviction policy: lowest show count first (the ``count`` column: pushes, decayed by
``show_decay_rate`` at ``end_day``), ties broken by least recent use (a per-row access tick set by
every pull, push and GEO delta); the rows of the call that overflowed the cache go last, so a key
pulled for the first time is not written to disk before its push. Chosen over pure recency by a
cache simulation of Zipf(1.1) key streams (cache 2 k rows, 2 k-key batches, 50 batches a day):
count keeps more hits unless most traffic moves to new ids every day, and ``show_decay_rate``
closes most of that gap (the numbers are in ``docs/ps/ssd-storage.md``).

Aging is lazy on disk: a cold row records the table's day number when it was written;
``end_day`` ages the rows in memory and bumps the day number, and a row read back gets the days
it missed applied (unseen_days and show decay, with the same float arithmetic as
``end_day``). ``shrink`` deletes old rows from both tiers (a scan of RocksDB).

Checkpoints: a full snapshot holds the rows of both tiers (the cold ones read by a scan, aged
to today), so save / load / resharding work as for a memory table; delta snapshots (delta saves,
delta serving exports) are refused with :class:`~ps_server.errors.SsdTierError`.

Not built yet: eviction off the request path (eviction writes run in the calling request; a
writer thread would not overlap with requests, as ``rocksdict`` holds the GIL while it writes a
batch), ``max_capacity`` (refused by the config), delta checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ps_server.config import SparseStorage, SparseTableConfig
from ps_server.core import sparse_shards
from ps_server.core.hash_index import HashIndex, KeyIndex
from ps_server.core.row_flags import LIVE, SEEN
from ps_server.core.row_store import RowSnapshot, RowStore
from ps_server.core.shard_data import SparseShardData
from ps_server.core.sparse_table import SparseTable
from ps_server.core.ssd_tier import ColdTier, record_dtype
from ps_server.core.table import ChangeLog, PushStats
from ps_server.errors import SsdTierError

logger = logging.getLogger(__name__)

_U16_MAX = np.iinfo(np.uint16).max
EVICT_TO = 0.9
"""An eviction leaves this fraction of ``cache_rows`` in memory."""
_COLUMNS = ("values", "state", "count", "unseen_days")


class SsdSparseTable(SparseTable):
    """A sparse table with ``storage="ssd"`` (see the module docstring)."""

    def __init__(
        self,
        config: SparseTableConfig,
        shards: Iterable[int] | None = None,
        *,
        ssd_root: str | None = None,
        index_factory: Callable[[], KeyIndex] = HashIndex,
    ) -> None:
        """``ssd_root``: the server's SSD directory (the tier goes to
        ``<ssd_root>/<table>/shards-<first shard>``, emptied first)."""
        if not isinstance(config, SparseTableConfig) or config.storage is not SparseStorage.SSD:
            raise TypeError("SsdSparseTable needs a SparseTableConfig with storage='ssd'")
        super().__init__(config, shards, index_factory=index_factory)
        self.cache_rows = int(config.cache_rows or 0)
        # the memory store gains an access tick per row (the eviction order)
        spec = {
            "values": ((self.dim,), np.float32),
            "state": ((self.state_dim,), np.float32),
            "count": ((), np.uint32),
            "unseen_days": ((), np.uint16),
            "tick": ((), np.uint64),
        }
        self.store = RowStore(spec, index_factory=index_factory)
        self.cold = ColdTier(
            self.name, ssd_root, self.shards, record_dtype(self.dim, self.state_dim)
        )
        self.day = 0
        """end_day calls so far (cold rows record the day they were written)."""
        self._tick = 0
        self._depth = 0
        self._tier = dict.fromkeys(("hot_hits", "hot_misses", "cold_hits", "tier_evictions"), 0)

    # -- sizes and stats ----------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows in both tiers (pending count-filter keys not included)."""
        return self.store.num_rows + self.cold.num_rows

    def stats(self) -> dict[str, Any]:
        """The memory table's stats (``num_rows`` over both tiers) plus the tiers': hot and
        cold rows, hits and misses of the memory tier, cold rows read back, evictions, bytes on
        disk and RocksDB read time."""
        with self.lock:
            out = super().stats()
            out.update(
                storage="ssd",
                cache_rows=self.cache_rows,
                hot_rows=self.store.num_rows,
                cold_rows=self.cold.num_rows,
                ssd_bytes=self.cold.disk_bytes,
                ssd_reads=self.cold.reads,
                ssd_read_seconds=self.cold.read_seconds,
                **self._tier,
            )
            return out

    # -- the tier around every keyed call -----------------------------------------------------
    def _promote(self, keys: np.ndarray) -> None:
        """Move the rows of ``keys`` found on disk into memory (batched)."""
        rows = self.store.lookup(keys)
        miss = rows < 0
        nmiss = int(miss.sum())
        self._tier["hot_hits"] += int(keys.shape[0]) - nmiss
        if not nmiss:
            return
        self._tier["hot_misses"] += nmiss
        if self.cold.num_rows == 0:
            return
        mkeys = np.unique(keys[miss])
        found, rec = self.cold.get(mkeys)
        if rec.shape[0] == 0:
            return
        fkeys = mkeys[found]
        rec = self._aged(rec)
        new = self.store.allocate(fkeys)
        for name in _COLUMNS:
            self.store.scatter(name, new, rec[name])
        self.store.flags[new] = rec["flags"] | LIVE
        self.cold.delete(fkeys)
        self._tier["cold_hits"] += int(fkeys.shape[0])

    def _aged(self, rec: np.ndarray) -> np.ndarray:
        """Records with the end_day steps since they were written applied (as ``end_day``)."""
        rec = rec.copy()
        missed = self.day - rec["day"].astype(np.int64)
        aged = missed > 0
        if not aged.any():
            return rec
        r = rec[aged]
        k = missed[aged]
        seen = (r["flags"] & SEEN).astype(bool)
        first = np.where(seen, 0, r["unseen_days"].astype(np.int64) + 1)
        r["unseen_days"] = np.minimum(first + (k - 1), _U16_MAX).astype(np.uint16)
        r["flags"] &= ~SEEN
        rate = float(self.config.show_decay_rate)
        if rate != 1.0:
            count = r["count"].copy()
            for step in range(1, int(k.max()) + 1):
                due = k >= step
                if not count[due].any():
                    break
                count[due] = np.floor(count[due] * rate).astype(np.uint32)
            r["count"] = count
        r["day"] = self.day
        rec[aged] = r
        return rec

    def _touch(self, keys: np.ndarray) -> None:
        self._tick += 1
        rows = self.store.lookup(keys)
        self.store.cols["tick"][rows[rows >= 0]] = self._tick

    def _evict(self) -> None:
        """Write rows to disk until 90 % of ``cache_rows`` remain: lowest show count first,
        then least recently used; the current call's rows last."""
        st = self.store
        if st.num_rows <= self.cache_rows:
            return
        keep = max(1, int(self.cache_rows * EVICT_TO))
        n = st.num_rows - keep
        live = st.live_rows()
        ticks = st.cols["tick"][live]
        order = np.lexsort((ticks, st.cols["count"][live], ticks == self._tick))
        victims = np.sort(live[order[:n]])
        self.cold.put(st.keys[victims], self._records(st, victims), new=int(victims.shape[0]))
        st.remove_rows(victims, log=False)
        self._tier["tier_evictions"] += int(victims.shape[0])
        if st.num_rows < 0.5 * st.high_water:
            st.compact()

    def _records(self, st: RowStore | RowSnapshot, rows: np.ndarray) -> np.ndarray:
        rec = np.empty(rows.shape[0], dtype=self.cold.dtype)
        for name in _COLUMNS:
            rec[name] = st.cols[name][rows]
        rec["flags"] = st.flags[rows]
        rec["day"] = self.day
        return rec

    def _keyed(self, keys: Any, call: Any) -> Any:
        """Run ``call()`` between promote and evict (once: nested calls skip both)."""
        with self.lock:
            if self._depth:
                return call()
            valid = self._check_keys(keys)
            self._depth += 1
            try:
                self._promote(valid)
                result = call()
                self._touch(valid)
            finally:
                self._depth -= 1
            self._evict()
            return result

    def pull(self, keys: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """As :meth:`SparseTable.pull`, over both tiers."""
        return self._keyed(keys, lambda: super(SsdSparseTable, self).pull(keys, out))

    def push(self, keys: np.ndarray, grads: np.ndarray) -> PushStats:
        """As :meth:`SparseTable.push`, over both tiers."""
        return self._keyed(keys, lambda: super(SsdSparseTable, self).push(keys, grads))

    def add_delta(self, keys: np.ndarray, deltas: np.ndarray) -> PushStats:
        """As :meth:`SparseTable.add_delta`, over both tiers."""
        return self._keyed(keys, lambda: super(SsdSparseTable, self).add_delta(keys, deltas))

    # -- aging --------------------------------------------------------------------------------
    def end_day(self) -> None:
        """As :meth:`SparseTable.end_day`; the cold rows age when they are read back."""
        with self.lock:
            super().end_day()
            self.day += 1

    def shrink(self, max_unseen_days: int) -> int:
        """As :meth:`SparseTable.shrink`, over both tiers (scans RocksDB)."""
        with self.lock:
            removed = super().shrink(max_unseen_days)
            old = [
                keys[self._aged(rec)["unseen_days"] > max_unseen_days]
                for keys, rec in self.cold.scan()
            ]
            gone = np.concatenate(old) if old else np.zeros(0, dtype=np.int64)
            self.cold.delete(gone)
            self._counters["rows_shrunk"] += int(gone.shape[0])
            return removed + int(gone.shape[0])

    # -- checkpoint hooks ---------------------------------------------------------------------
    def _snapshot(self, delta: bool, log: ChangeLog | None) -> sparse_shards.SparseSnapshot:
        """Both tiers' rows: the memory rows copied, the cold rows scanned and aged."""
        if delta:
            raise SsdTierError(
                self.name,
                self.cold.path,
                "delta checkpoints and delta exports of storage='ssd' tables are not supported "
                "yet: save or export with mode 0 (all rows)",
            )
        snap = super()._snapshot(delta, log)
        chunks = list(self.cold.scan())
        if chunks:
            hot = snap.store
            keys = np.concatenate([hot.keys, *(k for k, _ in chunks)])
            rec = self._aged(np.concatenate([r for _, r in chunks]))
            flags = np.concatenate([hot.flags, rec["flags"] | LIVE])
            cols = {name: np.concatenate([hot.cols[name], rec[name]]) for name in _COLUMNS}
            logs = {int(f): hot.take_deleted(f) for f in sparse_shards.CHANGE_FLAG.values()}
            snap.store = RowSnapshot(keys, flags, cols, logs)
        return snap

    def import_shard(self, payload: SparseShardData, delta: bool) -> int:
        """As :meth:`SparseTable.import_shard`; rows beyond ``cache_rows`` go to disk."""
        with self.lock:
            keys = np.concatenate([payload.keys, payload.deleted_keys])
            self._promote(np.unique(keys))
            read = super().import_shard(payload, delta)
            self._touch(payload.keys)
            self._evict()
            return read

    def clear(self) -> None:
        """Drop every row of both tiers."""
        with self.lock:
            super().clear()
            self.cold.clear()

    def close(self) -> None:
        """Close the RocksDB database (the table is unusable afterwards)."""
        self.cold.close()


__all__ = ["SsdSparseTable"]
