"""A sparse table larger than memory: hot rows in a :class:`RowStore`, cold rows in RocksDB.

:class:`SsdSparseTable` is a :class:`~ps_server.core.sparse_table.SparseTable` whose row store
holds at most ``config.cache_rows`` rows after every call; the others live in its
:class:`~ps_server.core.ssd_tier.ColdTier` (Paddle's ``SSDSparseTable``). A key is in exactly one
place: memory, an op of the write-behind queue not yet written (:mod:`ps_server.core.ssd_evict`,
the newest op wins) or RocksDB. Every call that takes keys runs in batched steps under the
table's lock:

1. *promote*: the keys missing from memory are looked up in the write-behind queue (numpy
   ``searchsorted``), then the rest in RocksDB in one ``multi_get``, except those the key filter
   (:mod:`ps_server.core.ssd_filter`: every key ever queued for RocksDB) rules out, such as keys
   seen for the first time; the rows found move to memory, and one delete op for their keys is
   queued (written later, behind any put of theirs);
2. the memory table's own code runs unchanged (its C kernels for the lookup and the optimizer),
   so the optimizer math, admission (count-filter pending keys stay in memory), initial values
   and counters are exactly a memory table's;
3. *evict*: past the high watermark (:data:`EVICT_HIGH` of ``cache_rows``) the background thread
   is woken; it picks rows (policy below) down to the low watermark (:data:`EVICT_LOW`), moves
   their records to a put op and frees them, then writes every queued op in one RocksDB write
   batch without the table's lock. A call that leaves more than ``cache_rows`` rows in memory
   picks the rows itself (the write still goes to the thread); a call that finds more than
   ``cache_rows`` keys queued by earlier calls and not yet written writes them (back pressure).

Eviction policy: lowest show count first (the ``count`` column: pushes, decayed by
``show_decay_rate`` at ``end_day``), ties broken by least recent use (a per-row access tick set by
every pull, push and GEO delta); the rows of the latest call go last, and so do the rows whose
last use was one of the latest pulls (pulled, not pushed since; as many pulls, newest first,
as touched at most :data:`PROTECT_SHARE` of ``cache_rows`` keys), so a row pulled is not written
to disk before its push, also when a trainer prefetches the next batch's rows before it pushes
the current one's. One ``argpartition`` over a packed 64-bit score per pick. Chosen over pure
recency (``eviction="recency"``) by the hit rate on the benchmark's Zipf(1.1) stream (the
numbers are in ``docs/ps/ssd-storage.md``).

Aging is lazy on disk (:mod:`ps_server.core.ssd_aging`): a cold row records the table's day
number when it was evicted; ``end_day`` ages the rows in memory and bumps the day number, and a
row read back gets the days it missed applied (unseen_days and show decay, with the same float
arithmetic as ``end_day``). ``shrink`` deletes old rows from both tiers (a scan of RocksDB).

Checkpoints: a full snapshot holds the rows of both tiers (the queue written first, the memory
rows copied; a checkpoint's cold rows are a RocksDB checkpoint of the tier taken under the lock,
a serving export's are read shard by shard while it is written, aged to the day of the
snapshot: :mod:`ps_server.core.ssd_snapshot`), so save / load / resharding work as for a memory table; a delta
snapshot (delta saves, delta serving exports) holds the changed rows of both tiers: the change
flags travel with the rows, and :mod:`ps_server.core.ssd_changes` keeps the cold tier's side of
each change log (epochs, the keys of changed cold rows, the keys deleted from disk).

``close()`` stops the thread (a write in progress finishes) and closes RocksDB. ``max_capacity``
counts the rows of both tiers (:mod:`ps_server.core.ssd_capacity`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from collective.errors import ConfigError
from ps_server.config import SparseStorage, SparseTableConfig
from ps_server.core import sparse_shards
from ps_server.core.batch_ops import sorted_distinct
from ps_server.core.hash_index import HashIndex, KeyIndex
from ps_server.core.row_flags import LIVE
from ps_server.core.row_store import RowSnapshot, RowStore
from ps_server.core.shard_data import SparseShardData
from ps_server.core.sparse_table import SparseTable
from ps_server.core.ssd_aging import aged
from ps_server.core.ssd_capacity import make_room
from ps_server.core.ssd_changes import ROW_COLUMNS, ColdChanges, LogState, delta_snapshot
from ps_server.core.ssd_evict import ABSENT, PUT, WriteBehind
from ps_server.core.ssd_filter import KeyFilter
from ps_server.core.ssd_import import flush_ingest, split_import
from ps_server.core.ssd_pass import pull_through
from ps_server.core.ssd_snapshot import ColdSaver, native_snapshot, streamed_snapshot
from ps_server.core.ssd_tier import ColdTier, as_void, packed_records, record_dtype
from ps_server.core.table import ChangeLog, PushStats, TableSnapshot
from ps_server.errors import SsdTierError

logger = logging.getLogger(__name__)

_U31_MAX = (1 << 31) - 1
EVICT_HIGH = 0.95
"""Past this fraction of ``cache_rows`` in memory the background thread evicts."""
EVICT_LOW = 0.9
"""An eviction leaves this fraction of ``cache_rows`` in memory."""
PROTECT_SHARE = 1.0
"""The rows the latest pulls touched last, pulls of up to this share of ``cache_rows`` keys
together, are evicted last."""
_RECENT_CALLS = 64
"""Keyed calls remembered for :data:`PROTECT_SHARE`."""
EVICTION_POLICIES = ("count", "recency")


class SsdSparseTable(SparseTable):
    """A sparse table with ``storage="ssd"`` (see the module docstring)."""

    def __init__(
        self,
        config: SparseTableConfig,
        shards: Iterable[int] | None = None,
        *,
        ssd_root: str | None = None,
        index_factory: Callable[[], KeyIndex] = HashIndex,
        eviction: str = "count",
        background: bool = True,
    ) -> None:
        """``ssd_root``: the server's SSD directory (the tier goes to
        ``<ssd_root>/<table>/shards-<first shard>``, emptied first); ``eviction``: ``"count"``
        (lowest show count first, the default) or ``"recency"`` (least recently used first);
        ``background=False`` evicts and writes in the calling request (for comparisons)."""
        if not isinstance(config, SparseTableConfig) or config.storage is not SparseStorage.SSD:
            raise TypeError("SsdSparseTable needs a SparseTableConfig with storage='ssd'")
        if eviction not in EVICTION_POLICIES:
            raise SsdTierError(
                config.name, "", f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}"
            )
        super().__init__(config, shards, index_factory=index_factory)
        self.eviction = eviction
        self.background = background
        # the memory store gains an access tick per row (the eviction order)
        spec = {
            "values": ((self.dim,), np.float32),
            "state": ((self.state_dim,), np.float32),
            "count": ((), np.uint32),
            "unseen_days": ((), np.uint16),
            "tick": ((), np.uint64),
        }
        self.store = RowStore(spec, index_factory=index_factory)
        self.cache_rows = self._cache_rows(config)
        self.cold = ColdTier(
            self.name,
            ssd_root,
            self.shards,
            record_dtype(self.dim, self.state_dim),
            config.num_shards,
        )
        self.queue = WriteBehind(self.cold.write, self._background_step)
        self.changes = ColdChanges()
        """The change logs of the cold rows (delta saves and exports)."""
        self.keyfilter = self._new_filter()
        """Every key queued for RocksDB since the tier was emptied (:mod:`.ssd_filter`)."""
        self.day = 0
        """end_day calls so far (cold rows record the day they were written)."""
        self._cold_rows = 0
        """Rows in the cold tier: in RocksDB or in a put op not yet written."""
        self.bulk_loading = False
        """Inside :meth:`bulk_load`."""
        self.ingest_buffer: list[tuple[np.ndarray, np.ndarray]] = []
        """(keys, records) a bulk load sends to disk, ingested in large files."""
        self._tick = 0
        self._recent: collections.deque[tuple[int, int, bool]] = collections.deque(
            maxlen=_RECENT_CALLS
        )
        """(tick, keys, is a pull) of the latest keyed calls, oldest first."""
        self._seq = 0
        """Eviction batches so far (each record carries the number of its batch)."""
        self._savers: weakref.WeakSet[ColdSaver] = weakref.WeakSet()
        """The pending full snapshots (they keep the rows that leave the disk)."""
        self._depth = 0
        self._closed = False
        self._tier = dict.fromkeys(
            (
                "hot_hits",
                "hot_misses",
                "cold_hits",
                "cold_misses",
                "filter_skips",
                "filter_rebuilds",
                "tier_evictions",
            ),
            0,
        )

    def _cache_rows(self, config: SparseTableConfig) -> int:
        """``cache_rows``, or the rows ``cache_bytes`` holds."""
        if config.cache_bytes is None:
            return int(config.cache_rows or 0)
        rows = int(config.cache_bytes) // self.store.row_bytes
        if rows < 1:
            raise ConfigError(
                f"table {self.name!r}: cache_bytes={config.cache_bytes} holds no row of "
                f"{self.store.row_bytes} bytes; give at least that many",
                key="cache_bytes",
            )
        return rows

    # -- sizes and stats ----------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows in both tiers (pending count-filter keys not included)."""
        return self.store.num_rows + self._cold_rows

    def stats(self) -> dict[str, Any]:
        """The memory table's stats (``num_rows`` over both tiers) plus the tiers': hot and
        cold rows, hits and misses of the memory tier (``hot_hit_rate``), cold rows read back,
        evictions, bytes on disk, RocksDB read and write counts and times, keys queued and not
        yet written."""
        with self.lock:
            out = super().stats()
            looked = self._tier["hot_hits"] + self._tier["hot_misses"]
            out.update(
                storage="ssd",
                cache_rows=self.cache_rows,
                hot_rows=self.store.num_rows,
                cold_rows=self._cold_rows,
                hot_hit_rate=self._tier["hot_hits"] / looked if looked else 0.0,
                ssd_bytes=self.cold.disk_bytes,
                ssd_reads=self.cold.reads,
                ssd_read_seconds=self.cold.read_seconds,
                filter_keys=self.keyfilter.num_keys,
                filter_bytes=self.keyfilter.nbytes,
                filter_chain=self.keyfilter.chain_length,
                **self.queue.stats(),
                **self._tier,
            )
            return out

    # -- the tier around every keyed call -----------------------------------------------------
    def _promote(self, keys: np.ndarray, pull: bool = False) -> np.ndarray | None:
        """Move the rows of ``keys`` held in the cold tier into memory (batched) and stamp the
        rows of ``keys`` with this call's tick (``pull``: the call is a pull); returns the
        distinct keys still missing (rows the call may create), None if none."""
        self._tick += 1
        self._recent.append((self._tick, int(keys.shape[0]), pull))
        st = self.store
        rows = st.lookup(keys)
        miss = rows < 0
        nmiss = int(np.count_nonzero(miss))
        self._tier["hot_hits"] += int(keys.shape[0]) - nmiss
        if not nmiss:
            st.cols["tick"][rows] = self._tick
            return None
        self._tier["hot_misses"] += nmiss
        st.cols["tick"][rows[~miss]] = self._tick
        mkeys = sorted_distinct(keys[miss])
        if self._cold_rows == 0:
            return mkeys
        at_queue, queued, at_disk, rec = self._cold_lookup(mkeys)
        for saver in list(self._savers):  # the rows leave the disk: pending saves keep them
            saver.keep(mkeys[at_disk], rec)
        if at_disk.shape[0] + at_queue.shape[0] == 0:
            return mkeys
        got = np.zeros(mkeys.shape[0], dtype=bool)
        got[at_queue] = True
        got[at_disk] = True
        fkeys = mkeys[got]  # sorted: the delete op below needs no argsort
        both = np.empty(mkeys.shape[0], dtype=rec.dtype)
        slots = as_void(both)
        slots[at_queue] = as_void(queued)
        slots[at_disk] = as_void(rec)
        rec = self._aged(slots[got].view(rec.dtype), copy=False)
        new = st.allocate(fkeys)
        for name in ROW_COLUMNS:
            st.scatter(name, new, rec[name])
        st.cols["tick"][new] = self._tick
        st.flags[new] = self.changes.current_flags(rec) | LIVE
        self.queue.delete(fkeys)
        n = int(fkeys.shape[0])
        self._cold_rows -= n
        self._tier["cold_hits"] += n
        return mkeys[~got]

    def _cold_lookup(self, mkeys: np.ndarray) -> tuple[np.ndarray, Any, np.ndarray, np.ndarray]:
        """Where the cold tier holds distinct ``mkeys`` (none in memory): (positions in the
        queue, its records; positions in RocksDB, its records); the key filter spares RocksDB."""
        state, queued = self.queue.lookup(mkeys, self.cold.dtype)
        ask = np.flatnonzero(state == ABSENT)
        maybe = self.keyfilter.may_contain(mkeys[ask])
        self._tier["filter_skips"] += int(ask.shape[0] - np.count_nonzero(maybe))
        ask = ask[maybe]
        found, rec = self.cold.get(mkeys[ask])
        self._tier["cold_misses"] += int(ask.shape[0] - np.count_nonzero(found))
        return np.flatnonzero(state == PUT), queued, ask[found], rec

    def _aged(self, rec: np.ndarray, day: int | None = None, copy: bool = True) -> np.ndarray:
        """Records with the end_day steps since they were written applied (as ``end_day``),
        up to day ``day`` (default: today); ``copy=False`` ages ``rec`` in place."""
        day = self.day if day is None else day
        return aged(rec, day, self.config.show_decay_rate, copy)

    def _touch(self, keys: np.ndarray) -> None:
        rows = self.store.lookup(keys)
        self.store.cols["tick"][rows[rows >= 0]] = self._tick

    def _coldest(self, live: np.ndarray, n: int) -> np.ndarray:
        """Indexes into ``live`` of the ``n`` rows to evict first (policy: module docstring)."""
        st = self.store
        tick = st.cols["tick"][live]
        # the latest call's rows, and the rows the latest pulls touched last (not pushed since)
        latest = np.isin(tick, self._protected_ticks()).astype(np.uint64) << np.uint64(63)
        if self.eviction == "count":
            count = np.minimum(st.cols["count"][live], _U31_MAX).astype(np.uint64)
            score = latest | (count << np.uint64(32)) | (tick & np.uint64(0xFFFFFFFF))
        else:
            score = latest | tick
        if n >= live.shape[0]:
            return np.arange(live.shape[0])
        return np.argpartition(score, n - 1)[:n]

    def _protected_ticks(self) -> np.ndarray:
        """The ticks whose rows are evicted last: the latest call's, and those of the latest
        pulls that touched at most :data:`PROTECT_SHARE` of ``cache_rows`` keys together."""
        ticks, budget = [self._tick], PROTECT_SHARE * self.cache_rows
        for tick, n, pull in reversed(self._recent):
            if not pull:
                continue
            budget -= n
            if budget < 0:
                break
            ticks.append(tick)
        return np.array(ticks, dtype=np.uint64)

    def _evict(self) -> None:
        """Move rows to a put op until :data:`EVICT_LOW` of ``cache_rows`` remain in memory
        (hold the lock)."""
        st = self.store
        keep = max(1, int(self.cache_rows * EVICT_LOW))
        n = st.num_rows - keep
        if n <= 0:
            return
        live = st.live_rows()
        victims = np.sort(live[self._coldest(live, n)])
        vkeys = st.keys[victims]
        rec = self._records(st, victims)
        self.queue.put(vkeys, rec)
        self.keyfilter.add(vkeys)
        if self.keyfilter.needs_rebuild:
            self._rebuild_filter()
        st.remove_rows(victims, log=False)
        self.changes.evicted(vkeys, rec["flags"], self._is_hot)
        self._cold_rows += n
        self._tier["tier_evictions"] += n
        if st.num_rows < 0.5 * st.high_water:
            st.compact()

    def _is_hot(self, keys: np.ndarray) -> np.ndarray:
        return self.store.lookup(keys) >= 0

    def _new_filter(self) -> KeyFilter:
        return KeyFilter(max(2 * self.cache_rows, 1))

    def _rebuild_filter(self, keys: Iterator[np.ndarray] | None = None, num_keys: int = 0) -> None:
        """One filter of the keys in RocksDB and in put ops not yet written (hold the lock).
        ``keys``: the RocksDB keys, when the caller scans anyway (the queue written first);
        ``num_keys``: the keys to size it for, when more are coming."""
        queued = self.queue.put_keys()  # before the scan: a write ending between is in both
        if keys is None:
            keys = self.cold.scan_keys() if self._cold_rows else iter(())
        self.keyfilter = KeyFilter.rebuilt(
            itertools.chain(queued, keys), max(self._cold_rows, self.cache_rows, num_keys)
        )
        self._tier["filter_rebuilds"] += 1

    def _background_step(self) -> None:
        """The eviction thread's pick (under the lock), before it writes the queue."""
        with self.lock:
            if not self._closed and self.store.num_rows > self.cache_rows * EVICT_HIGH:
                self._evict()

    def _after_call(self, backlog: int | None = None) -> None:
        """Eviction and back pressure after a call (hold the lock); ``backlog``: the keys queued
        and not taken by a writer when the call began (default: now)."""
        hot = self.store.num_rows
        if not self.background:
            if hot > self.cache_rows:
                self._evict()
            self._write_queued()
            return
        backlog = self.queue.queued_rows if backlog is None else backlog
        if hot > self.cache_rows:
            self._evict()  # over the bound: the call picks; the thread writes
        if backlog > self.cache_rows:
            self._write_queued()
        elif hot > self.cache_rows * EVICT_HIGH or self.queue.queued_rows:
            self.queue.kick()

    def _write_queued(self) -> None:
        """Write the queue now (hold the lock); a failed write as :class:`SsdTierError`."""
        try:
            self.queue.write_queued()
        except Exception as err:
            raise self._write_error(err) from err

    def _write_error(self, err: BaseException) -> SsdTierError:
        return SsdTierError(
            self.name,
            self.cold.path,
            f"writing evicted rows to RocksDB failed: {err!r} (the rows stay readable in "
            "memory; free disk space or fix the directory, then restore from a checkpoint)",
        )

    def _check_open(self) -> None:
        if self._closed:
            raise SsdTierError(self.name, self.cold.path, "the table is closed")
        err = self.queue.error
        if err is not None:
            raise self._write_error(err)

    def _records(self, st: RowStore | RowSnapshot, rows: np.ndarray) -> np.ndarray:
        self._seq += 1
        tail = np.zeros(1, dtype=self.cold.dtype)  # what every record of the batch shares
        tail["day"] = self.day
        tail["seq"] = self._seq
        self.changes.stamp(tail)
        cols = {**{name: st.cols[name] for name in ROW_COLUMNS}, "flags": st.flags}
        return packed_records(tail, rows, cols)

    def _keyed(self, keys: Any, call: Any, pull: bool = False) -> Any:
        """Run ``call()`` after the promotion, then evict (once: nested calls skip both)."""
        with self.lock:
            if self._depth:
                return call()
            self._check_open()
            valid = self._check_keys(keys)
            backlog = self.queue.queued_rows  # earlier calls' ops (back pressure)
            self._depth += 1
            try:
                created = self._counters["rows_created"]
                missing = self._promote(valid, pull)
                result = call()
                if missing is not None and self._counters["rows_created"] != created:
                    self._touch(missing)  # rows the call created
            finally:
                self._depth -= 1
            self._after_call(backlog)
            return result

    def flush(self) -> None:
        """Evict down to the watermark and write every queued op to RocksDB now."""
        with self.lock:
            self._check_open()
            if self.store.num_rows > self.cache_rows * EVICT_HIGH:
                self._evict()
            self._write_queued()

    def pull(self, keys: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """As :meth:`SparseTable.pull`, over both tiers."""
        return self._keyed(keys, lambda: super(SsdSparseTable, self).pull(keys, out), pull=True)

    def push(self, keys: np.ndarray, grads: np.ndarray) -> PushStats:
        """As :meth:`SparseTable.push`, over both tiers."""
        return self._keyed(keys, lambda: super(SsdSparseTable, self).push(keys, grads))

    def pull_with_state(
        self, keys: np.ndarray, out: np.ndarray | None = None, state_out: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`SparseTable.pull_with_state`, read through both tiers (:mod:`.ssd_pass`)."""
        with self.lock:
            self._check_open()
            return pull_through(self, self._check_keys(keys), out, state_out)

    def add_delta(
        self,
        keys: np.ndarray,
        deltas: np.ndarray,
        shows: np.ndarray | None = None,
        state_deltas: np.ndarray | None = None,
    ) -> PushStats:
        """As :meth:`SparseTable.add_delta`, over both tiers."""
        return self._keyed(
            keys,
            lambda: super(SsdSparseTable, self).add_delta(keys, deltas, shows, state_deltas),
        )

    def _evict_for(self, num_new: int, protect: np.ndarray) -> int:
        """``max_capacity`` over both tiers (:func:`~ps_server.core.ssd_capacity.make_room`)."""
        return make_room(self, num_new, protect)

    # -- aging --------------------------------------------------------------------------------
    def end_day(self) -> None:
        """As :meth:`SparseTable.end_day`; the cold rows age when they are read back."""
        with self.lock:
            super().end_day()
            self.day += 1

    def shrink(self, max_unseen_days: int) -> int:
        """As :meth:`SparseTable.shrink`, over both tiers (scans RocksDB)."""
        with self.lock:
            self._check_open()
            removed = super().shrink(max_unseen_days)
            self._write_queued()  # RocksDB holds every cold row; no op is queued now
            old: list[np.ndarray] = []

            def kept() -> Iterator[np.ndarray]:
                for keys, rec in self.cold.scan():
                    out = self._aged(rec)["unseen_days"] > max_unseen_days
                    for saver in list(self._savers):
                        saver.keep(keys[out], rec[out])
                    old.append(keys[out])
                    yield keys[~out]

            self._rebuild_filter(kept())  # the filter forgets the deleted keys
            gone = np.concatenate(old) if old else np.zeros(0, dtype=np.int64)
            self.cold.delete(gone)
            self.changes.deleted(gone)
            self._cold_rows -= int(gone.shape[0])
            self._counters["rows_shrunk"] += int(gone.shape[0])
            return removed + int(gone.shape[0])

    # -- checkpoint hooks ---------------------------------------------------------------------
    def snapshot(self, delta: bool = False, log: ChangeLog | None = None) -> TableSnapshot:
        """As :meth:`Table.snapshot <ps_server.core.table.Table.snapshot>`; the snapshot also
        remembers the cold tier's change log before the reset (for :meth:`requeue_changes`)."""
        snap = super().snapshot(delta, log)
        if log is not None:
            snap.cold_log = self._last_reset  # type: ignore[attr-defined]
        return snap

    def reset_changes(self, log: ChangeLog) -> None:
        """As :meth:`SparseTable.reset_changes`, for the rows of both tiers (the cold rows'
        change flags become stale at once: a new epoch)."""
        super().reset_changes(log)
        self._last_reset: LogState = self.changes.reset(sparse_shards.CHANGE_FLAG[log])

    def requeue_changes(self, log: ChangeLog, snapshot: TableSnapshot) -> None:
        """As :meth:`SparseTable.requeue_changes`; the cold rows' changes count again too."""
        with self.lock:
            super().requeue_changes(log, snapshot)
            before = getattr(snapshot, "cold_log", None)
            if before is not None:
                self.changes.requeue(sparse_shards.CHANGE_FLAG[log], before)

    def _snapshot(self, delta: bool, log: ChangeLog | None) -> sparse_shards.SparseSnapshot:
        """Both tiers' rows (all of them, or those of change log ``log``): the memory rows
        copied; the cold rows as a RocksDB checkpoint (a checkpoint), read later shard by shard
        (a full serving export: :mod:`ps_server.core.ssd_snapshot`) or now in a ``multi_get``
        (the changed ones: :func:`ps_server.core.ssd_changes.delta_snapshot`)."""
        self._check_open()
        snap = super()._snapshot(delta, log)
        if delta:
            assert log is not None
            return delta_snapshot(self, snap, sparse_shards.CHANGE_FLAG[log])
        self._write_queued()  # RocksDB holds every cold row
        if log is not ChangeLog.EXPORT:  # a checkpoint: the tier as a RocksDB checkpoint
            return native_snapshot(self, snap)
        return streamed_snapshot(self, snap)

    def import_shard(self, payload: SparseShardData, delta: bool) -> int:
        """As :meth:`SparseTable.import_shard`; the new rows beyond the memory tier's room go
        to disk directly (:mod:`.ssd_import`)."""
        with self.lock:
            self._check_open()
            self.check_import(payload)
            keys = np.concatenate([payload.keys, payload.deleted_keys])
            self._promote(sorted_distinct(keys))
            room = int(self.cache_rows * EVICT_LOW) - self.store.num_rows
            hot = split_import(self, payload, room)
            sparse_shards.import_shard(self.store, self.pending, hot, delta)
            self._touch(hot.keys)
            self._after_call()
            return int(payload.keys.shape[0])

    streams_load = True
    """Checkpoint loads hand this table one shard at a time (``ps_server.checkpoint.load``)."""

    @contextlib.contextmanager
    def bulk_load(self, rows: int) -> Iterator[None]:
        """Around a checkpoint load of ``rows`` rows: the key filter is sized for them at once
        (one rebuild now instead of rebuilds from RocksDB scans as they arrive), and the rows
        sent to disk are ingested as sorted files (:mod:`.ssd_import`)."""
        with self.lock:
            need = self._cold_rows + self.queue.inflight_keys + rows
            if self.keyfilter.capacity - self.keyfilter.num_keys < rows:
                self._rebuild_filter(num_keys=need)
            self.bulk_loading = True
            try:
                yield
                flush_ingest(self)
            finally:
                self.bulk_loading = False
                self.ingest_buffer.clear()

    def clear(self) -> None:
        """Drop every row of both tiers."""
        with self.lock:
            self._check_open()
            super().clear()
            self.queue.discard(self.cold.clear)
            self._cold_rows = 0
            self.keyfilter = self._new_filter()
            self.changes = ColdChanges()

    def close(self) -> None:
        """Stop the eviction thread (a write in progress finishes first) and close RocksDB;
        the table is unusable afterwards."""
        with self.lock:
            self._closed = True
        self.queue.close()
        with self.lock:
            self.cold.close()


__all__ = ["SsdSparseTable"]
