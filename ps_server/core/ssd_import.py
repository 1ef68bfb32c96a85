"""Loading rows into an SSD table: the rows that do not fit in memory go straight to RocksDB.

A checkpoint load (``import_shard``) of a table far larger than ``cache_rows`` would otherwise
put every row into the memory tier and evict all but the last ``cache_rows`` of them again: two
copies and an eviction pick per row. :func:`split_import` queues the payload's new rows beyond
the memory tier's free room as cold records directly (of each payload, the most counted new
rows take the room, as eviction by show count would keep them; a load fills the room with the
first shards it reads, and training promotes what it touches) and returns the rest for the
memory table's import.
The records are what an eviction of the same rows would write: the same flags (live, seen; a
loaded row is not dirty), the day, a sequence number and the change logs' epochs. During a
checkpoint load (``SsdSparseTable.bulk_load``) they go to RocksDB as sorted files it ingests
whole instead of through the write-behind queue.

A checkpoint whose cold rows are a RocksDB checkpoint of a tier with the loading table's shards
loads faster still (:func:`adopted`): its files become the tier's database (the SST files
hard-linked where the filesystem allows, copied otherwise; no row goes through Python), then the
memory rows are imported as above.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from ps_server.core import sparse_shards
from ps_server.core.row_flags import LIVE, SEEN
from ps_server.core.shard_data import SparseShardData
from ps_server.core.ssd_changes import EPOCH_FIELDS

if TYPE_CHECKING:
    from ps_server.core.ssd_filter import KeyFilter
    from ps_server.core.ssd_table import SsdSparseTable

_ROW_FIELDS = ("keys", "values", "state", "count", "unseen_days", "flags")


INGEST_ROWS = 4_000_000
"""Rows a bulk load gathers into one file before RocksDB ingests it (fewer, larger files: each
ingestion syncs its file)."""


def flush_ingest(table: SsdSparseTable) -> None:
    """Hand the rows a bulk load gathered to RocksDB as one sorted file (the table's lock is
    held). Until then they are counted as cold rows and their keys are in the key filter but
    reads do not find them: a load imports each key once (its shards are disjoint), so nothing
    reads them before the load ends."""
    if not table.ingest_buffer:
        return
    keys = np.concatenate([k for k, _ in table.ingest_buffer])
    rec = np.concatenate([r for _, r in table.ingest_buffer])
    table.ingest_buffer.clear()
    table._write_queued()  # no older op on these keys may land after the file
    table.cold.ingest(keys, rec)


def split_import(table: SsdSparseTable, payload: SparseShardData, room: int) -> SparseShardData:
    """Queue the new rows of ``payload`` (keys in neither tier: call after the promotion of
    its keys) beyond ``room`` free memory rows as cold records, and return the payload of the
    rows left for memory (all of them when they fit). The table's lock is held; the payload
    is valid (``SparseTable.check_import``)."""
    d = payload
    if d.keys.shape[0] == 0:
        return d
    hot = table.store.lookup(d.keys) >= 0
    new = np.flatnonzero(~hot)
    room = max(0, room)
    if new.shape[0] <= room:
        return d
    if room:
        by_count = np.argpartition(-d.count[new].astype(np.int64), room - 1)
        keep_new, cold = new[by_count[:room]], np.sort(new[by_count[room:]])
    else:
        keep_new, cold = new[:0], new
    keys = d.keys[cold]
    rec = np.empty(cold.shape[0], dtype=table.cold.dtype)
    rec["values"] = d.values[cold]
    rec["state"] = d.state[cold]
    rec["count"] = d.count[cold]
    rec["unseen_days"] = d.unseen_days[cold]
    rec["flags"] = LIVE | (d.flags[cold] & SEEN)
    rec["day"] = table.day
    table._seq += 1
    rec["seq"] = table._seq
    table.changes.stamp(rec)
    if table.bulk_loading:
        table.ingest_buffer.append((keys, rec))
        if sum(int(k.shape[0]) for k, _ in table.ingest_buffer) >= INGEST_ROWS:
            flush_ingest(table)
    else:
        table.queue.put(keys, rec)
    table.keyfilter.add(keys)
    if table.keyfilter.needs_rebuild:
        table._rebuild_filter()
    table.changes.evicted(keys, rec["flags"], table._is_hot)
    table._cold_rows += int(cold.shape[0])
    keep = np.sort(np.concatenate([np.flatnonzero(hot), keep_new]))
    return dataclasses.replace(d, **{f: getattr(d, f)[keep] for f in _ROW_FIELDS})


@contextlib.contextmanager
def adopted(
    table: SsdSparseTable,
    place: Callable[[str], None],
    cut: dict[str, int | dict[str, int]],
    hot_rows: int,
    keyfilter: KeyFilter | None = None,
) -> Iterator[None]:
    """Around a full load whose cold rows are a RocksDB checkpoint of this table's shards: the
    tier's database becomes the files ``place(db_dir)`` puts in place, then the body imports
    the ``hot_rows`` memory rows (:func:`import_hot`, inside :meth:`bulk_load`). ``cut``: the
    checkpoint's manifest entry (rows, day, seq, epochs); ``keyfilter``: its saved key filter
    (None: rebuilt from a key scan of the files). Call on a cleared table, its lock held.

    The loaded records keep the day, sequence number and change-log epochs they were written
    with: the table takes the cut's day (its records age from it), a sequence number past the
    cut's, and epochs past the cut's (no loaded record counts as changed)."""
    assert table.num_rows == 0 and not table.queue.queued_rows
    table.cold.adopt(place)
    rows = int(cut["rows"])  # type: ignore[arg-type]
    table.day = int(cut["day"])  # type: ignore[arg-type]
    table._seq = max(table._seq, int(cut["seq"]))  # type: ignore[arg-type]
    epochs = cut["epochs"]
    assert isinstance(epochs, dict)
    for flag, field in EPOCH_FIELDS.items():
        table.changes.epoch[flag] = max(table.changes.epoch[flag], int(epochs[field]) + 1)
    table._cold_rows = rows
    if keyfilter is None:
        table._rebuild_filter(num_keys=rows + hot_rows)  # a key scan of the adopted files
    else:
        table.keyfilter = keyfilter.with_room(hot_rows)
    with table.bulk_load(hot_rows):
        yield


def import_hot(table: SsdSparseTable, payload: SparseShardData, keep_rows: int) -> int:
    """As ``import_shard`` (full) for the memory rows of a checkpoint whose cold rows the table
    adopted (:func:`adopted`): a key of the cut is in one tier only, so nothing is promoted
    (no RocksDB read); beyond ``keep_rows`` rows in memory the new rows go to disk."""
    with table.lock:
        table.check_import(payload)
        hot = split_import(table, payload, keep_rows - table.store.num_rows)
        sparse_shards.import_shard(table.store, table.pending, hot, False)
        table._touch(hot.keys)
        table._after_call()
        return int(payload.keys.shape[0])


__all__ = ["INGEST_ROWS", "adopted", "flush_ingest", "import_hot", "split_import"]
