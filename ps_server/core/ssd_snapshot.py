"""A full snapshot of an SSD table that streams its cold rows: one shard in memory at a time.

A full save of an :class:`~ps_server.core.ssd_table.SsdSparseTable` copies its memory rows under
the table's lock (as a memory table does), writes the write-behind queue so that RocksDB holds
exactly the cold rows, and notes the table's eviction sequence number ``seq``. The checkpoint
writer then asks for one shard's payload at a time (:class:`ShardStream`, a mapping computed on
access): the shard's memory rows, and its cold rows read by one key-range scan of RocksDB (the
tier's keys start with the shard), aged to the day of the snapshot. Training goes on meanwhile;
the snapshot must see none of its later changes, and RocksDB's own snapshots cannot be used for
the scan (``rocksdict`` iterators ignore them), so :class:`ColdSaver` keeps the cold rows as of
the snapshot by hand:

* every record carries the sequence number of the eviction that wrote it: a scanned record with
  a number above ``seq`` was written after the snapshot and is left out;
* a row that leaves RocksDB after the snapshot (read back into memory, or deleted by ``shrink``)
  is read before it goes, and the table hands its record to every pending saver
  (:meth:`ColdSaver.keep`) while the shard is not written yet: the first time a cold row leaves
  after the snapshot it still holds the snapshot's record;
* a shard's rows are the scan's, minus the records written later, plus the kept ones (the kept
  record wins where the scan still saw the row: the delete was not written yet).

So a save holds the memory rows, one shard of cold rows and the rows that left the disk during
the save, not every cold row at once. A ``clear`` (a full load) or ``close`` during the save
makes it fail with :class:`~ps_server.errors.SsdTierError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from ps_server.core.routing import shard_of
from ps_server.core.row_flags import SEEN
from ps_server.core.shard_data import SparseShardData
from ps_server.core.sparse_shards import SparseSnapshot

ColdShard = Callable[[int], Iterator[tuple[np.ndarray, np.ndarray]]]
"""``scan(shard)``: (keys, records) chunks of the shard's rows in RocksDB now."""


class ColdSaver:
    """The cold rows of one pending full snapshot that left RocksDB after it (module
    docstring)."""

    def __init__(self, seq: int, num_shards: int, shards: tuple[int, ...]) -> None:
        self.seq = seq
        self.num_shards = num_shards
        self._lock = threading.Lock()
        self._kept: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {s: [] for s in shards}
        self._done: set[int] = set()

    def keep(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Rows leaving RocksDB now (their records as on disk): those of the snapshot, of
        shards not written yet, are kept."""
        old = records["seq"] <= np.uint64(self.seq)
        if not old.any():
            return
        keys, records = keys[old], records[old]
        of = shard_of(keys, self.num_shards)
        with self._lock:
            for s in np.unique(of).tolist():
                if s in self._kept and s not in self._done:
                    sel = of == s
                    self._kept[s].append((keys[sel], records[sel].copy()))

    def shard(self, shard: int, scan: ColdShard) -> tuple[np.ndarray, np.ndarray] | None:
        """(keys, records) of ``shard``'s cold rows as of the snapshot; None if it had none.
        Each shard once: what was kept for it is dropped."""
        chunks = []
        for keys, rec in scan(shard):
            old = rec["seq"] <= np.uint64(self.seq)  # the others were written after
            chunks.append((keys[old], rec[old]))
        with self._lock:
            kept = self._kept.pop(shard, [])
            self._done.add(shard)
        parts = kept + chunks  # kept records first: they win over the scan's copy
        if not parts:
            return None
        keys = np.concatenate([k for k, _ in parts])
        recs = np.concatenate([r for _, r in parts])
        _, first = np.unique(keys, return_index=True)
        return keys[first], recs[first]


class ShardStream(Mapping[int, SparseShardData]):
    """Per owned shard, the payload of memory and cold rows, computed when asked for (not
    kept: ask for each shard once)."""

    def __init__(
        self,
        hot: dict[int, SparseShardData],
        cold: Callable[[int], tuple[np.ndarray, np.ndarray] | None],
    ) -> None:
        self._hot, self._cold = hot, cold

    def __getitem__(self, shard: int) -> SparseShardData:
        hot = self._hot[shard]
        got = self._cold(shard)
        if got is None:
            return hot
        keys, rec = got
        return SparseShardData(
            shard=shard,
            keys=np.concatenate([hot.keys, keys]),
            values=np.concatenate([hot.values, rec["values"]]),
            state=np.concatenate([hot.state, rec["state"]]),
            count=np.concatenate([hot.count, rec["count"]]),
            unseen_days=np.concatenate([hot.unseen_days, rec["unseen_days"]]),
            flags=np.concatenate([hot.flags, rec["flags"] & SEEN]),
            pending_keys=hot.pending_keys,
            pending_count=hot.pending_count,
            pending_unseen_days=hot.pending_unseen_days,
            pending_flags=hot.pending_flags,
            deleted_keys=hot.deleted_keys,
            deleted_pending_keys=hot.deleted_pending_keys,
        )

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._hot))

    def __len__(self) -> int:
        return len(self._hot)


class StreamedSnapshot(SparseSnapshot):
    """A full snapshot: copies of the memory rows, and the cold rows read shard by shard when
    the checkpoint writes them (module docstring)."""

    def __init__(
        self,
        base: SparseSnapshot,
        saver: ColdSaver,
        cold: Callable[[int], tuple[np.ndarray, np.ndarray] | None],
    ) -> None:
        super().__init__(base.meta, base.store, base.pending, base.num_shards, base.changed)
        self.saver = saver
        """Registered with the table while this snapshot exists."""
        self._cold = cold

    def export_shards(self) -> ShardStream:  # type: ignore[override]
        """Per owned shard, its rows of both tiers (each read when the mapping is indexed)."""
        return ShardStream(super().export_shards(), self._cold)


__all__ = ["ColdSaver", "ShardStream", "StreamedSnapshot"]
