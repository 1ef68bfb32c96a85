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
makes it fail with :class:`~ps_server.errors.SsdTierError`. Serving exports take this path.

A checkpoint (a full save or a recovery checkpoint) takes the cold tier whole instead
(:func:`native_snapshot`, :class:`NativeSnapshot`): under the table's lock, after the queue is
written, a RocksDB checkpoint of the tier (the memtable flushed, every live file hard-linked into
a directory inside the tier: milliseconds, no row read) is the cold half of the cut, and the
memory rows copied as above are the hot half; a key is in exactly one of them. The checkpoint
writer then links (or copies) the staged files into the checkpoint directory
(:mod:`ps_server.checkpoint.ssd_files`); a reader that needs rows opens the staged or saved
RocksDB read-only (:class:`ColdReader`).
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ps_server.core.routing import shard_of
from ps_server.core.row_flags import SEEN
from ps_server.core.shard_data import SparseShardData
from ps_server.core.sparse_shards import SparseSnapshot
from ps_server.core.ssd_aging import aged
from ps_server.core.ssd_changes import EPOCH_FIELDS
from ps_server.core.ssd_tier import SCAN_CHUNK, record_dtype, tier_options
from ps_server.errors import SsdTierError

if TYPE_CHECKING:
    from ps_server.core.ssd_table import SsdSparseTable

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


def with_cold(hot: SparseShardData, cold: tuple[np.ndarray, np.ndarray] | None) -> SparseShardData:
    """A shard's payload of memory rows ``hot`` plus its cold rows ``(keys, records)``
    (already aged)."""
    if cold is None or cold[0].shape[0] == 0:
        return hot
    keys, rec = cold
    return SparseShardData(
        shard=hot.shard,
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


class ShardStream(Mapping[int, SparseShardData]):
    """Per owned shard, the payload of memory and cold rows, computed when asked for (not
    kept: ask for each shard once)."""

    def __init__(
        self,
        hot: dict[int, SparseShardData],
        cold: Callable[[int], tuple[np.ndarray, np.ndarray] | None],
    ) -> None:
        self._hot, self._cold = hot, cold
        self.owner: object = None
        """What must live while the stream is read."""

    def __getitem__(self, shard: int) -> SparseShardData:
        return with_cold(self._hot[shard], self._cold(shard))

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


_KEY = np.dtype([("shard", ">u2"), ("key", ">i8")])
_STAGED = itertools.count(1)
STAGING_DIR = "checkpoints"
"""Subdirectory of a tier directory holding the RocksDB checkpoints staged for saves."""


@dataclass(frozen=True)
class ColdCut:
    """The cold half of a checkpoint's cut: a RocksDB checkpoint of one server's tier, and what
    reading its records back needs (the manifest keeps all but ``path`` and ``table``)."""

    path: str
    """The RocksDB directory (staged in the tier, or saved in a checkpoint)."""
    table: str
    shards: tuple[int, ...]
    num_shards: int
    rows: int
    """Cold rows at the cut."""
    day: int
    """The table's ``end_day`` count at the cut (records age from the day they were written)."""
    seq: int
    """The table's eviction sequence number at the cut (every record's ``seq`` is <= it)."""
    epochs: dict[str, int]
    """Each change log's epoch at the cut, by record field (every record's is <= it)."""
    dim: int
    state_dim: int
    show_decay_rate: float
    keyfilter: tuple[tuple[np.ndarray, int], ...] = ()
    """The table's key filter at the cut (:meth:`KeyFilter.parts
    <ps_server.core.ssd_filter.KeyFilter.parts>`: every key of the cut, maybe more)."""
    keyfilter_path: str = ""
    """A saved cut's key filter file ("": none saved, a load rebuilds it by a key scan)."""

    def to_dict(self) -> dict[str, Any]:
        """The manifest's part (plain data)."""
        return {
            "shards": list(self.shards),
            "rows": self.rows,
            "day": self.day,
            "seq": self.seq,
            "epochs": dict(self.epochs),
        }

    @classmethod
    def from_dict(
        cls,
        data: dict[str, Any],
        path: str,
        table: str,
        num_shards: int,
        dim: int,
        state_dim: int,
        show_decay_rate: float,
        keyfilter_path: str = "",
    ) -> ColdCut:
        """A saved cut (a manifest entry, see :meth:`to_dict`) at ``path``."""
        return cls(
            path=path,
            table=table,
            shards=tuple(int(s) for s in data["shards"]),
            num_shards=num_shards,
            rows=int(data["rows"]),
            day=int(data["day"]),
            seq=int(data["seq"]),
            epochs={str(k): int(v) for k, v in data["epochs"].items()},
            dim=dim,
            state_dim=state_dim,
            show_decay_rate=show_decay_rate,
            keyfilter_path=keyfilter_path,
        )


class ColdReader:
    """The rows of a :class:`ColdCut`'s RocksDB, opened read-only, one shard at a time (for
    readers that need rows: serving exports, resharding, loads into other tables)."""

    def __init__(self, cut: ColdCut) -> None:
        self.cut = cut
        self.dtype = record_dtype(cut.dim, cut.state_dim)
        try:
            import rocksdict as rd

            self._rd = rd
            self._db: Any = rd.Rdict(
                cut.path, tier_options(rd), access_type=rd.AccessType.read_only()
            )
        except Exception as err:  # rocksdict raises plain Exceptions
            raise self._error("cannot be opened", err) from None

    def _error(self, what: str, err: BaseException) -> SsdTierError:
        return SsdTierError(
            self.cut.table,
            self.cut.path,
            f"the RocksDB checkpoint of the cold rows {what}: {err} (a missing or damaged "
            "file: load an older checkpoint)",
        )

    def shard(self, shard: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(keys, records aged to the cut's day) of ``shard``'s cold rows; None if none."""
        ro = self._rd.ReadOptions()
        ro.set_iterate_upper_bound(int(shard + 1).to_bytes(2, "big"))
        ro.fill_cache(False)
        kbuf: list[bytes] = []
        vbuf: list[bytes] = []
        try:
            for k, v in self._db.items(from_key=int(shard).to_bytes(2, "big"), read_opt=ro):
                kbuf.append(k)
                vbuf.append(v)
        except Exception as err:
            raise self._error(f"failed while reading shard {shard}", err) from None
        if not kbuf:
            return None
        keys = np.frombuffer(b"".join(kbuf), dtype=_KEY)["key"].astype(np.int64)
        rec = np.frombuffer(b"".join(vbuf), dtype=self.dtype)
        return keys, aged(rec, self.cut.day, self.cut.show_decay_rate, True)

    def chunks(self) -> Iterator[np.ndarray]:
        """int64 key chunks of every row (for the key filter of a table adopting the files)."""
        kbuf: list[bytes] = []
        for k in self._db.keys():
            kbuf.append(k)
            if len(kbuf) >= SCAN_CHUNK:
                yield np.frombuffer(b"".join(kbuf), dtype=_KEY)["key"].astype(np.int64)
                kbuf = []
        if kbuf:
            yield np.frombuffer(b"".join(kbuf), dtype=_KEY)["key"].astype(np.int64)

    def close(self) -> None:
        """Close the database."""
        if self._db is not None:
            self._db.close()
            self._db = None


class NativeSnapshot(SparseSnapshot):
    """A checkpoint's snapshot of an SSD table: copies of the memory rows, and the cold tier as
    a RocksDB checkpoint staged in the tier directory (module docstring). The staged files go
    when :meth:`release` is called or the snapshot is garbage-collected."""

    def __init__(self, base: SparseSnapshot, cut: ColdCut) -> None:
        super().__init__(base.meta, base.store, base.pending, base.num_shards, base.changed)
        self.cold_cut = cut
        self._readers: list[ColdReader] = []
        self._finalizer = weakref.finalize(self, shutil.rmtree, cut.path, True)

    def hot_shards(self) -> dict[int, SparseShardData]:
        """Per owned shard, its memory rows only (the cold ones are the staged RocksDB)."""
        return super().export_shards()

    def export_shards(self) -> ShardStream:  # type: ignore[override]
        """Per owned shard, its rows of both tiers (the cold ones read from the staged
        RocksDB checkpoint when the mapping is indexed)."""
        reader = ColdReader(self.cold_cut)
        self._readers.append(reader)
        stream = ShardStream(super().export_shards(), reader.shard)
        stream.owner = self  # the staged files stay while the stream is read
        return stream

    def release(self) -> None:
        """Remove the staged files (after they were linked or copied, or on failure)."""
        for reader in self._readers:
            reader.close()
        self._readers.clear()
        self._finalizer()


def native_snapshot(table: SsdSparseTable, base: SparseSnapshot) -> NativeSnapshot:
    """The snapshot of a checkpoint (module docstring): ``base`` (the memory rows) and a
    RocksDB checkpoint of the tier taken now. Hold the table's lock, the queue written."""
    cold = table.cold
    staging = os.path.join(cold.path, STAGING_DIR)
    path = os.path.join(staging, f"{os.getpid()}-{next(_STAGED)}")
    try:
        os.makedirs(staging, exist_ok=True)
        cold.checkpoint(path)
    except Exception as err:  # rocksdict raises plain Exceptions
        shutil.rmtree(path, ignore_errors=True)
        raise SsdTierError(
            table.name, cold.path, f"cannot take a RocksDB checkpoint of the tier: {err}"
        ) from None
    cut = ColdCut(
        path=path,
        table=table.name,
        shards=tuple(table.shards),
        num_shards=int(table.config.num_shards),
        rows=int(table.num_rows - table.store.num_rows),
        day=int(table.day),
        seq=int(table._seq),
        epochs={field: int(table.changes.epoch[flag]) for flag, field in EPOCH_FIELDS.items()},
        dim=int(table.dim),
        state_dim=int(table.state_dim),
        show_decay_rate=float(table.config.show_decay_rate),
        keyfilter=tuple(table.keyfilter.parts()),
    )
    return NativeSnapshot(base, cut)


def streamed_snapshot(table: SsdSparseTable, base: SparseSnapshot) -> StreamedSnapshot:
    """The snapshot of a full serving export (module docstring): ``base`` (the memory rows) and
    the cold rows read shard by shard while the export is written, aged to today's day. Hold
    the table's lock, the queue written."""
    saver = ColdSaver(table._seq, table.config.num_shards, table.shards)
    table._savers.add(saver)
    generation, day, cold = table.cold.generation, table.day, table.cold

    def read(shard: int) -> tuple[np.ndarray, np.ndarray] | None:
        got = saver.shard(shard, lambda s: cold.read_shard(generation, s))
        return None if got is None else (got[0], table._aged(got[1], day))

    return StreamedSnapshot(base, saver, read)


__all__ = [
    "STAGING_DIR",
    "ColdCut",
    "ColdReader",
    "ColdSaver",
    "NativeSnapshot",
    "ShardStream",
    "StreamedSnapshot",
    "native_snapshot",
    "streamed_snapshot",
    "with_cold",
]
