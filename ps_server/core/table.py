"""The table base class: what every table (sparse, dense, or a new kind) offers the server,
the checkpoint code and the gRPC layer.

A table holds the shards of one logical table that this server owns (``shards``), serialises its
calls with ``lock`` (one re-entrant lock per table: the gRPC server may call from many threads;
the checkpoint code holds it for a whole save or load of the table), and exports / imports its
state one shard at a time, which is what makes N → M server resharding work.

A new kind of table subclasses :class:`Table`, sets ``KIND``, implements the abstract methods and
a shard payload type (:mod:`ps_server.core.shard_data`) that :mod:`ps_server.checkpoint.shard_file`
can encode.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterable
from typing import Any, ClassVar

from collective.errors import ConfigError
from ps_server.core.routing import shards_of_server


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
    @abc.abstractmethod
    def export_shards(self, delta: bool) -> dict[int, Any]:
        """Payload per owned shard: everything (``delta=False``) or only what changed since the
        last save/load (``delta=True``)."""

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


__all__ = ["Table"]
