"""The table base class: what every table (sparse, dense, or a new kind) offers the server,
the checkpoint code and the gRPC layer.

A table holds the shards of one logical table that this server owns (``shards``), serialises its
calls with ``lock`` (one re-entrant lock per table: the gRPC server may call from many threads;
the checkpoint code holds it while it takes a snapshot and for a whole load), and exports /
imports its state one shard at a time, which is what makes N → M server resharding work.

Saving is two steps so that training waits only for a copy: :meth:`Table.snapshot` (under the
lock; a memcpy of the row arrays) returns a :class:`TableSnapshot`, whose ``export_shards()``
splits the copy into per-shard payloads later, on the checkpoint writer's thread, without the
lock. Which changes a snapshot consumes is a :class:`ChangeLog`: saves and serving exports keep
independent ones, and a recovery checkpoint consumes none.

A new kind of table subclasses :class:`Table`, sets ``KIND``, implements the abstract methods and
a shard payload type (:mod:`ps_server.core.shard_data`) that :mod:`ps_server.checkpoint.shard_file`
can encode.
"""

from __future__ import annotations

import abc
import enum
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from collective.errors import ConfigError
from ps_server.core.routing import shards_of_server


@dataclass(frozen=True)
class PushStats:
    """What one push did (returned to the caller; also summed into
    :meth:`~ps_server.core.sparse_table.SparseTable.stats`)."""

    num_keys: int
    """Keys in the request, duplicates included."""
    applied: int
    """Distinct rows the optimizer updated."""
    created: int
    """Rows created (admitted) by this push."""
    filtered: int
    """Occurrences dropped because the entry policy has not admitted their key."""
    skipped_nonfinite: int
    """Occurrences dropped for NaN/inf gradients (``nonfinite="skip"``)."""
    evicted: int
    """Rows evicted to stay within ``max_capacity``."""

    def to_dict(self) -> dict[str, int]:
        """Plain data."""
        return asdict(self)


class ChangeLog(enum.StrEnum):
    """The change tracking a snapshot reads (delta) and then resets."""

    SAVE = "save"
    """Changes since the last save or load (delta checkpoints, ``save_persistables(d, 1)``)."""
    EXPORT = "export"
    """Changes since the last serving export (delta exports); kept only after a first export."""


@dataclass(frozen=True)
class SnapshotMeta:
    """What a snapshot records besides its rows (it goes to the manifest)."""

    name: str
    kind: str
    config: Any
    dim: int
    state_dim: int
    shards: tuple[int, ...]
    delta: bool
    days_since_save: int
    """``end_day`` calls since the last save (a delta load replays them)."""


class TableSnapshot(abc.ABC):
    """A table's state at one instant, taken under its lock; :meth:`export_shards` runs later
    without the lock (on the checkpoint writer's thread)."""

    def __init__(self, meta: SnapshotMeta) -> None:
        self.meta = meta

    @abc.abstractmethod
    def export_shards(self) -> dict[int, Any]:
        """Payload per owned shard (:mod:`ps_server.core.shard_data`)."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of memory the snapshot holds (a checkpoint needs them until it is written)."""


class PayloadSnapshot(TableSnapshot):
    """A snapshot that already holds its per-shard payloads (copies): small tables (dense)."""

    def __init__(self, meta: SnapshotMeta, payloads: dict[int, Any]) -> None:
        super().__init__(meta)
        self._payloads = payloads

    def export_shards(self) -> dict[int, Any]:
        """The payloads taken at the snapshot."""
        return self._payloads

    @property
    def nbytes(self) -> int:
        """Bytes of the payloads' arrays."""
        total = 0
        for payload in self._payloads.values():
            for block in getattr(payload, "blocks", ()):
                total += int(block.values.nbytes + block.state.nbytes)
        return total


class Table(abc.ABC):
    """Base of the server-side tables.

    Subclasses set ``KIND`` (``"sparse"``, ``"dense"``) and keep ``config`` (a frozen config
    dataclass with ``name`` and ``num_shards``).
    """

    KIND: ClassVar[str] = ""

    def __init__(self, config: Any, shards: Iterable[int] | None = None) -> None:
        self.config = config
        self.name: str = config.name
        num_shards = config.num_shards
        owned = (
            tuple(range(num_shards)) if shards is None else tuple(sorted({int(s) for s in shards}))
        )
        bad = [s for s in owned if not 0 <= s < num_shards]
        if bad or not owned:
            raise ConfigError(
                f"table {self.name!r}: shards must be a non-empty subset of [0, {num_shards}), "
                f"got {list(shards) if shards is not None else None}",
                key="shards",
            )
        self.shards: tuple[int, ...] = owned
        """The shards of this table this server owns (sorted)."""
        self.lock = threading.RLock()
        """Serialises calls on this table (held by the checkpoint code for a whole save/load)."""
        self.days_since_save = 0
        """``end_day`` calls since the last save or load (replayed when a delta is loaded)."""

    @classmethod
    def for_server(cls, config: Any, server_index: int, num_servers: int, **kwargs: Any) -> Table:
        """The part of table ``config`` that server ``server_index`` of ``num_servers`` holds."""
        return cls(config, shards_of_server(server_index, num_servers, config.num_shards), **kwargs)

    @property
    @abc.abstractmethod
    def num_rows(self) -> int:
        """Rows (sparse) or blocks (dense) held."""

    @property
    @abc.abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of the arrays holding this table (allocated capacity, index included)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Plain-data counters and sizes (for logs, metrics and the gRPC Stats call)."""

    def end_day(self) -> None:
        """Close a day (ages sparse rows; nothing for tables without day-based metadata)."""
        with self.lock:
            self.days_since_save += 1

    # -- checkpoint hooks (called with ``lock`` held) -----------------------------------------
    def snapshot(self, delta: bool = False, log: ChangeLog | None = None) -> TableSnapshot:
        """This table's state now (``delta``: only what changed since change log ``log`` was
        last reset), then reset ``log`` (None: reset nothing — a recovery checkpoint). Call
        with ``lock`` held; the snapshot shares no memory with the table."""
        if delta and log is None:
            raise ValueError("a delta snapshot needs the change log it reads")
        snap = self._snapshot(delta, log)
        if log is not None:
            self.reset_changes(log)
        return snap

    def _meta(self, delta: bool) -> SnapshotMeta:
        return SnapshotMeta(
            self.name,
            self.KIND,
            self.config,
            getattr(self, "dim", 0),
            self.state_dim,
            self.shards,
            delta,
            self.days_since_save,
        )

    @abc.abstractmethod
    def _snapshot(self, delta: bool, log: ChangeLog | None) -> TableSnapshot:
        """The snapshot of :meth:`snapshot`, before any log is reset."""

    def export_shards(self, delta: bool) -> dict[int, Any]:
        """Payload per owned shard: everything (``delta=False``) or only what changed since the
        last save/load (``delta=True``); resets nothing."""
        return self._snapshot(delta, ChangeLog.SAVE if delta else None).export_shards()

    def reset_changes(self, log: ChangeLog) -> None:
        """Forget the changes change log ``log`` holds (SAVE: :meth:`mark_saved`)."""
        if log is ChangeLog.SAVE:
            self.mark_saved()

    def requeue_changes(self, log: ChangeLog, snapshot: TableSnapshot) -> None:
        """``snapshot`` (which reset ``log``) was never written: make the next delta of ``log``
        carry its changes again (takes the lock). Tables without change logs: nothing."""
        return None  # a table without change logs has nothing to requeue

    @abc.abstractmethod
    def import_shard(self, payload: Any, delta: bool) -> int:
        """Merge one shard's payload (upsert; a delta also deletes); returns rows/blocks read."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Drop every row/block (before loading a full checkpoint)."""

    def replay_end_days(self, days: int) -> None:
        """Apply ``days`` end-of-day steps (a delta load replays the saver's ``end_day`` calls)."""
        for _ in range(days):
            self.end_day()

    @abc.abstractmethod
    def mark_saved(self) -> None:
        """Forget the change tracking: everything is now as in the last save/load."""

    @property
    def state_dim(self) -> int:
        """float32 optimizer-state values per row (sparse) or per element count (dense: 0)."""
        return 0


__all__ = [
    "ChangeLog",
    "PayloadSnapshot",
    "PushStats",
    "SnapshotMeta",
    "Table",
    "TableSnapshot",
]
