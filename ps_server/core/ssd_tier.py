"""The cold tier of an SSD sparse table: packed rows in an embedded RocksDB, batched access only.

One :class:`ColdTier` per (table, server) holds the rows its
:class:`~ps_server.core.ssd_table.SsdSparseTable` evicted from memory, in one RocksDB directory
``<ssd_root>/<table>/shards-<first owned shard>`` (the ``rocksdict`` wheel bundles RocksDB: no
system package). Keys are the rows' shard (2 bytes) then
int64 key (8 bytes), big-endian, so the rows of one shard are one key range (a full save reads
one shard at a time, :meth:`ColdTier.read_shard`); a value is one row record of
:func:`record_dtype` (values, optimizer state, show count, unseen days, flags, the day the row
was written, so aging can be applied lazily when the row comes back, the epochs of its change
flags (:mod:`ps_server.core.ssd_changes`) and the sequence number of its eviction
(:mod:`ps_server.core.ssd_snapshot`).

Every call takes a whole batch: the keys are turned into Python ``bytes`` with one numpy
``tolist()`` and the records come back as one ``b"".join`` decoded by ``np.frombuffer``, so no
Python bytecode runs per key (``map`` drives the ``WriteBatch.put`` calls). Reads go in RocksDB's
key order; the files carry bloom filters (a key that was never evicted costs no block read) and
LZ4 blocks behind a block cache of :data:`BLOCK_CACHE_BYTES`; writes skip the write-ahead log
(the directory is scratch). Measured on a loaded 2-core machine, 10^6 rows of 75 bytes, 31 k-key
reads: bloom filters, the block cache, no compression and sorted keys read 2.3x faster than
RocksDB's defaults with keys in random order (0.18 against 0.077 M keys/s). Uncompressed blocks
took 1.65x the payload on disk (4 * 10^6 rows), hence LZ4; mmap reads (1.3x faster reads in a
3 * 10^6-row test) are off because the mapped files count in the server's RSS. Writes are batches of ops
(:meth:`ColdTier.write`) that :mod:`ps_server.core.ssd_evict` queues and writes in order; a
checkpoint load writes the rows it sends to disk as sorted files RocksDB ingests whole
(:meth:`ColdTier.ingest`: no memtable, no compaction).

The directory is scratch: it is emptied when the table is created and never read back after a
restart (the rows come from the checkpoint the server restores). A directory is only ever
emptied if it carries this module's marker file :data:`MARKER`; anything else there (a foreign
RocksDB, unrelated files) is refused with :class:`~ps_server.errors.SsdTierError`.
"""

from __future__ import annotations

import fcntl
import itertools
import operator
import os
import shutil
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ps_server.core import kernels
from ps_server.core.routing import shard_of
from ps_server.errors import SsdTierError

MARKER = "FLEET_SSD_TIER"
"""File written in every tier directory this module creates (it may empty only those)."""
_KEY = np.dtype([("shard", ">u2"), ("key", ">i8")])
"""A RocksDB key: the row's shard, then its int64 key (RocksDB's byte order groups shards)."""
BLOOM_BITS_PER_KEY = 10
"""Bloom filter bits per key in every RocksDB file (about 1 % false positives)."""
BLOCK_CACHE_BYTES = 64 << 20
"""RocksDB block cache of one tier (uncompressed blocks of recently read rows)."""
SCAN_CHUNK = 65536
"""Rows decoded per chunk while scanning the whole tier."""


class _Deletes:
    """A delete op for :meth:`ColdTier.write`."""

    records = None

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = keys


READ_PART = 8192
"""A read of RocksDB keys is split over threads in parts of at least this many keys."""


def record_dtype(dim: int, state_dim: int) -> np.dtype:
    """The packed record of one cold row."""
    return np.dtype(
        [
            ("values", np.float32, (dim,)),
            ("state", np.float32, (state_dim,)),
            ("count", np.uint32),
            ("unseen_days", np.uint16),
            ("flags", np.uint8),
            ("day", np.uint32),
            ("save_epoch", np.uint32),
            ("export_epoch", np.uint32),
            ("seq", np.uint64),
        ]
    )


def packed_records(tail: np.ndarray, rows: np.ndarray, cols: dict[str, np.ndarray]) -> np.ndarray:
    """The records of ``rows`` of a row store: the one-record ``tail`` (the fields every record
    of the batch shares) with each field of ``cols`` (name: column) gathered at ``rows`` (one
    compiled pass over the records where the kernels are built)."""
    rec = np.empty(rows.shape[0], dtype=tail.dtype)
    if kernels.ENABLED:
        kernels.pack(rec, tail, rows, cols)
        return rec
    rec[...] = tail[0]
    for name, col in cols.items():
        rec[name] = col[rows]
    return rec


def as_void(records: np.ndarray) -> np.ndarray:
    """Contiguous records as opaque fixed-size items: numpy gathers and scatters those several
    times faster than structured records (0.07 against 0.48 ms for 3 000 of 150 bytes)."""
    return records.view(f"V{records.dtype.itemsize}")


def _rocksdict() -> Any:
    try:
        import rocksdict
    except ImportError:
        return None
    return rocksdict


def open_rocksdb(rd: Any, path: str) -> Any:
    """A ``rocksdict.Rdict`` at ``path`` with the tier's options (module docstring)."""
    db = rd.Rdict(path, tier_options(rd))
    # the directory is scratch (never read after a restart): no write-ahead log
    write_opts = rd.WriteOptions()
    write_opts.disable_wal = True
    db.set_write_options(write_opts)
    return db


def tier_options(rd: Any) -> Any:
    """The ``rocksdict.Options`` of a tier's RocksDB and of the files it ingests."""
    opts = rd.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_write_buffer_size(16 << 20)
    # point lookups: a bloom filter per file (a key not on disk costs no block read), a
    # block cache of uncompressed blocks, LZ4 on disk (the cheapest to decompress)
    table = rd.BlockBasedOptions()
    table.set_bloom_filter(BLOOM_BITS_PER_KEY, False)
    table.set_block_cache(rd.Cache(BLOCK_CACHE_BYTES))
    opts.set_block_based_table_factory(table)
    opts.set_compression_type(rd.DBCompressionType.lz4())
    return opts


def last_ops(ops: list[Any]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """(keys, records or None) of each op of one write batch, less the keys a later op of the
    batch writes: the batch is atomic, so only a key's last op shows (a pass's push queues the
    delete of the cold rows it promotes, and its eviction their put)."""
    if len(ops) < 2:
        return [(op.keys, op.records) for op in ops]
    keys = np.concatenate([op.keys for op in ops])
    order = np.argsort(keys, kind="stable")  # equal keys in op order
    ordered = keys[order]
    last = np.ones(keys.shape[0], dtype=bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    keep = np.zeros(keys.shape[0], dtype=bool)
    keep[order[last]] = True
    out, at = [], 0
    for op in ops:
        k = keep[at : at + op.keys.shape[0]]
        at += op.keys.shape[0]
        if k.all():
            out.append((op.keys, op.records))
        elif k.any():
            out.append((op.keys[k], None if op.records is None else op.records[k]))
    return out


def rocksdb_order(keys: np.ndarray, shards: np.ndarray) -> np.ndarray:
    """The order of int64 ``keys`` (and their ``shards``) in RocksDB: by shard, then by the key
    as unsigned (its big-endian bytes). Keys already sorted as int64 (a queued op's) take one
    stable radix sort of the 16-bit shards after the negative keys are moved last, a third of a
    two-key ``lexsort``'s time."""
    n = keys.shape[0]
    if n < 2 or not bool((keys[1:] > keys[:-1]).all()):
        return np.lexsort((np.ascontiguousarray(keys).view(np.uint64), shards))
    first = int(np.searchsorted(keys, 0))  # the negative keys come last as unsigned
    by_key = np.concatenate((np.arange(first, n), np.arange(first)))
    return by_key[np.argsort(shards[by_key].astype(np.uint16), kind="stable")]


def key_bytes(keys: np.ndarray, num_shards: int, shards: np.ndarray | None = None) -> list[bytes]:
    """The RocksDB keys of int64 ``keys`` of a table of ``num_shards`` shards (``shards``: their
    shards, computed if not given): the shard, then the key, big-endian."""
    packed = np.empty(keys.shape[0], dtype=_KEY)
    packed["shard"] = shard_of(keys, num_shards) if shards is None else shards
    packed["key"] = keys
    return packed.view(f"V{_KEY.itemsize}").tolist()


def tier_dir(ssd_root: str, table: str, shards: tuple[int, ...]) -> str:
    """The directory of table ``table``'s cold tier for the server owning ``shards``."""
    return os.path.join(ssd_root, table, f"shards-{shards[0]:05d}")


def check_root(table: str, ssd_root: str | None) -> str:
    """The real path of ``ssd_root``, which must be an existing writable directory."""
    if not ssd_root:
        raise SsdTierError(
            table,
            "",
            "the table has storage='ssd' but the server has no SSD directory: start it with "
            "--ssd_root DIR (PSServer(ssd_root=...), make_table(..., ssd_root=...))",
        )
    root = os.path.realpath(ssd_root)
    if not os.path.isdir(root):
        raise SsdTierError(table, root, "the SSD root does not exist or is not a directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise SsdTierError(table, root, "the SSD root is not writable by this process")
    return root


class ColdTier:
    """Rows of one table (the shards one server owns) in RocksDB, keyed by int64."""

    def __init__(
        self,
        table: str,
        ssd_root: str | None,
        shards: tuple[int, ...],
        dtype: np.dtype,
        num_shards: int | None = None,
    ) -> None:
        """Open a fresh, empty tier under ``ssd_root`` (see the module docstring) for the rows
        of ``shards`` of a table of ``num_shards`` shards (default: ``max(shards) + 1``)."""
        rocksdict = _rocksdict()
        if rocksdict is None:
            raise SsdTierError(
                table,
                str(ssd_root or ""),
                "storage='ssd' needs the rocksdict package: pip install \"fleetrun[ssd]\"",
            )
        self._rd = rocksdict
        self.table = table
        root = check_root(table, ssd_root)
        path = os.path.realpath(tier_dir(root, table, shards))
        if not path.startswith(root.rstrip(os.sep) + os.sep):
            raise SsdTierError(table, path, f"resolves outside the SSD root {root}")
        self.path = path
        self.dtype = dtype
        self.num_shards = int(num_shards or max(shards) + 1)
        self.io_lock = threading.Lock()
        """Held while a checkpoint reads a RocksDB snapshot and while the tier is cleared or
        closed (so neither happens during the other)."""
        self.generation = 0
        """Bumped by :meth:`clear` and :meth:`close` (a snapshot of an older one is void)."""
        self.reads = 0
        self.read_seconds = 0.0
        self._ingests = 0
        self._db: Any = None
        self._lock_file: Any = None
        try:
            self._prepare()
            self._open()
        except BaseException:
            self._release()
            raise

    # -- directory ----------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Empty (or create) the tier directory; refuse one this module did not create."""
        path = self.path
        if os.path.lexists(path):
            if not os.path.isdir(path) or os.path.islink(path):
                raise SsdTierError(self.table, path, "exists and is not a directory")
            entries = os.listdir(path)
            if entries and MARKER not in entries:
                raise SsdTierError(
                    self.table,
                    path,
                    "holds files that are not a fleetrun SSD tier (a foreign RocksDB or other "
                    f"data; no {MARKER} marker): remove them or choose another --ssd_root",
                )
            if entries:
                self._lock_marker()  # refuses a tier another process holds
            try:
                shutil.rmtree(path)
            except OSError as err:
                raise SsdTierError(self.table, path, f"cannot empty the old tier: {err}") from None
        try:
            os.makedirs(path)
            with open(os.path.join(path, MARKER), "w") as f:
                f.write("scratch cold tier of a fleetrun sparse table; emptied at table creation\n")
        except OSError as err:
            raise SsdTierError(
                self.table, path, f"cannot create the tier directory: {err}"
            ) from None
        self._lock_marker()

    def _lock_marker(self) -> None:
        """Hold an exclusive lock on the marker file while this tier is open (a flock: any
        other table object, in this process or another, is refused; the lock goes with the
        file object, also when the table is garbage-collected)."""
        self._release()
        f = open(os.path.join(self.path, MARKER), "rb")  # held while the tier is open
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise SsdTierError(
                self.table,
                self.path,
                "is in use by another table (another server process with the same --ssd_root "
                "and server index, or an open table object of this process): close it first",
            ) from None
        self._lock_file = f

    def _release(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _open(self) -> None:
        try:
            self._db = open_rocksdb(self._rd, os.path.join(self.path, "db"))
        except Exception as err:  # rocksdict raises plain Exceptions for I/O and lock errors
            raise SsdTierError(self.table, self.path, f"cannot open RocksDB: {err}") from None

    def close(self) -> None:
        """Close the database (the files stay until the next table creation)."""
        with self.io_lock:
            self.generation += 1
            if self._db is not None:
                self._db.close()
                self._db = None
            self._release()

    def clear(self) -> None:
        """Drop every cold row (a fresh, empty database)."""
        with self.io_lock:
            self.generation += 1
            if self._db is not None:
                self._db.close()
                self._db = None
            self._prepare()
            self._open()

    # -- batched access -----------------------------------------------------------------------
    def _key_bytes(self, keys: np.ndarray, shards: np.ndarray | None = None) -> list[bytes]:
        return key_bytes(keys, self.num_shards, shards)

    @staticmethod
    def _keys_of(kbuf: list[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(kbuf), dtype=_KEY)["key"].astype(np.int64)

    def _decode(self, blobs: list[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(blobs), dtype=self.dtype)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found mask bool[n], records of the found keys in order) of distinct int64 keys.

        The keys are read in RocksDB's byte order (consecutive keys share blocks and files)."""
        n = keys.shape[0]
        if n == 0:
            return np.zeros(0, dtype=bool), np.zeros(0, dtype=self.dtype)
        # RocksDB's order: by shard, then the int64 key as unsigned (its big-endian bytes)
        shards = shard_of(keys, self.num_shards)
        order = rocksdb_order(keys, shards)
        kb = self._key_bytes(keys[order], shards[order])
        t0 = time.perf_counter()
        blobs = self._multi_get(kb)
        self.read_seconds += time.perf_counter() - t0
        self.reads += 1
        if None not in blobs:
            rec = np.empty(n, dtype=self.dtype)
            as_void(rec)[order] = as_void(self._decode(blobs))
            return np.ones(n, dtype=bool), rec
        # map / compress with C callables: no Python bytecode per key
        hit = np.array(list(map(operator.is_not, blobs, itertools.repeat(None))), dtype=bool)
        found = np.zeros(n, dtype=bool)
        found[order[hit]] = True
        at = np.empty(n, dtype=np.int64)  # position of each found key among the found ones
        at[found] = np.arange(int(hit.sum()))
        rec = np.empty(int(hit.sum()), dtype=self.dtype)
        as_void(rec)[at[order[hit]]] = as_void(self._decode(list(itertools.compress(blobs, hit))))
        return found, rec

    def _multi_get(self, kb: list[bytes]) -> list[bytes | None]:
        """``multi_get`` of RocksDB keys, split over the call's threads (parts of at least
        :data:`READ_PART` keys): the binding releases the GIL while RocksDB reads, so two
        threads read a large batch (a pass's rows) in about half the time."""
        k = min(kernels.call_threads(), len(kb) // READ_PART)
        if k < 2:
            return self._db.get(kb)
        bounds = [len(kb) * i // k for i in range(k + 1)]
        parts: list[Any] = [None] * k

        def read(i: int) -> None:
            try:
                parts[i] = self._db.get(kb[bounds[i] : bounds[i + 1]])
            except BaseException as err:  # raised by the calling thread below
                parts[i] = err

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(1, k)]
        for t in threads:
            t.start()
        read(0)
        for t in threads:
            t.join()
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        return list(itertools.chain.from_iterable(parts))

    def write(self, ops: list[Any]) -> int:
        """Apply ops (:class:`~ps_server.core.ssd_evict.Op`: sorted ``keys``, ``records`` or
        ``None`` for deletes) in order, in one write batch; the keys put or deleted."""
        batch = self._rd.WriteBatch(raw_mode=True)
        written = 0
        for op_keys, records in last_ops(ops):
            written += int(op_keys.shape[0])
            # RocksDB's key order: the memtable inserts touch neighbouring nodes (a quarter
            # less CPU per written key than int64 order, which scatters the keys over shards)
            shards = shard_of(op_keys, self.num_shards)
            order = rocksdb_order(op_keys, shards)
            keys = self._key_bytes(op_keys[order], shards[order])
            if records is None:
                deque(map(batch.delete, keys), maxlen=0)  # C-level loop
            else:
                values = as_void(records)[order].tolist()
                deque(map(batch.put, keys, values), maxlen=0)
        self._db.write(batch)
        return written

    def ingest(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Write the records of distinct keys none of which RocksDB holds as one sorted file
        that RocksDB takes in whole (a bulk load: no memtable, no compaction of these rows).
        No op may be queued for these keys."""
        if keys.shape[0] == 0:
            return
        shards = shard_of(keys, self.num_shards)
        order = rocksdb_order(keys, shards)
        kb = self._key_bytes(keys[order], shards[order])
        values = records[order].view(f"V{self.dtype.itemsize}").tolist()
        with self.io_lock:
            self._ingests += 1
            path = os.path.join(self.path, f"ingest-{self._ingests}.sst")
            writer = self._rd.SstFileWriter(options=tier_options(self._rd))
            writer.open(path)
            deque(map(writer.__setitem__, kb, values), maxlen=0)  # C-level loop
            writer.finish()
            opts = self._rd.IngestExternalFileOptions()
            opts.set_move_files(True)
            try:
                self._db.ingest_external_file([path], opts)
            finally:
                if os.path.exists(path):
                    os.unlink(path)

    def delete(self, keys: np.ndarray) -> None:
        """Delete distinct keys now, in one batch (no op queued before may be pending)."""
        if keys.shape[0]:
            self.write([_Deletes(np.sort(keys))])

    def flush(self) -> None:
        """Write RocksDB's memtable to its files (so ``disk_bytes`` counts every row)."""
        self._db.flush()

    def scan(self) -> Any:
        """Yield (keys int64[m], records) chunks of every cold row (hold the table's lock)."""
        kbuf: list[bytes] = []
        vbuf: list[bytes] = []
        for k, v in self._db.items():
            kbuf.append(k)
            vbuf.append(v)
            if len(kbuf) >= SCAN_CHUNK:
                yield self._chunk(kbuf, vbuf)
                kbuf, vbuf = [], []
        if kbuf:
            yield self._chunk(kbuf, vbuf)

    def scan_keys(self) -> Any:
        """Yield int64 chunks of every key in RocksDB (a consistent view from the call's
        first step)."""
        kbuf: list[bytes] = []
        for k in self._db.keys():
            kbuf.append(k)
            if len(kbuf) >= SCAN_CHUNK:
                yield self._keys_of(kbuf)
                kbuf = []
        if kbuf:
            yield self._keys_of(kbuf)

    def _chunk(self, kbuf: list[bytes], vbuf: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        return self._keys_of(kbuf), self._decode(vbuf)

    def read_shard(self, generation: int, shard: int) -> Any:
        """Yield (keys, records) chunks of the rows of ``shard`` now, in one key-range scan
        (an iterator's consistent view); :class:`SsdTierError` if the tier was cleared or
        closed since :attr:`generation` was ``generation``."""
        ro = self._rd.ReadOptions()
        ro.set_iterate_upper_bound(int(shard + 1).to_bytes(2, "big"))
        ro.fill_cache(False)  # a whole-shard read must not push the hot blocks out
        with self.io_lock:
            if generation != self.generation:
                raise SsdTierError(
                    self.table,
                    self.path,
                    "the table was cleared or closed while its checkpoint was being written",
                )
            kbuf: list[bytes] = []
            vbuf: list[bytes] = []
            for k, v in self._db.items(from_key=int(shard).to_bytes(2, "big"), read_opt=ro):
                kbuf.append(k)
                vbuf.append(v)
                if len(kbuf) >= SCAN_CHUNK:
                    yield self._chunk(kbuf, vbuf)
                    kbuf, vbuf = [], []
            if kbuf:
                yield self._chunk(kbuf, vbuf)

    def checkpoint(self, path: str) -> None:
        """A RocksDB checkpoint of the tier as it is now, in the new directory ``path`` (the
        memtable flushed, the live files hard-linked: ``path`` is inside the tier directory,
        so on its filesystem); :mod:`ps_server.core.ssd_snapshot`."""
        with self.io_lock:
            self._rd.Checkpoint(self._db).create_checkpoint(path)

    def adopt(self, place: Any) -> None:
        """Replace the database by the files ``place(db_dir)`` puts into its new, empty
        directory (a checkpoint's, linked or copied), then open it."""
        with self.io_lock:
            self.generation += 1
            if self._db is not None:
                self._db.close()
                self._db = None
            db = os.path.join(self.path, "db")
            shutil.rmtree(db, ignore_errors=True)
            os.makedirs(db)
            place(db)
            self._open()

    @property
    def disk_bytes(self) -> int:
        """Bytes of the tier's files on disk (memtables not yet flushed are not counted; the
        checkpoints staged for a save are links to these files, not counted)."""
        total = 0
        for dirpath, _dirs, files in os.walk(os.path.join(self.path, "db")):
            for name in files:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except OSError:
                    continue  # a file RocksDB removed during the walk
        return total


__all__ = [
    "MARKER",
    "ColdTier",
    "as_void",
    "check_root",
    "key_bytes",
    "open_rocksdb",
    "tier_options",
    "record_dtype",
    "tier_dir",
]
