"""A read-only sparse table for serving: the rows of a serving export, answered by key.

A serving export (``PSClient.export_serving`` / ``fleet.ps.export_serving``) keeps, per sparse
table, the rows whose show count reached ``min_show`` — keys, values and counts, no optimizer
state. :class:`ServingTable` holds them in a :class:`~ps_server.core.row_store.RowStore` with a
zero-width state column (the checkpoint code loads it like any sparse table) and answers
:meth:`pull`; it never creates a row.

A key it does not hold (never trained, or filtered out by ``min_show``) gets **zeros**, as
Paddle's serving does for an unknown feature: a feature seen too rarely carries no information,
and zeros are the neutral input to a sum-pooled embedding. (Its initializer's value would be
noise the model never learned from; it would also make an unknown key look trained.) Updating
it is loading a delta export on top (rows replaced or added, deleted keys removed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ps_server.config import SparseTableConfig
from ps_server.core import sparse_shards
from ps_server.core.batch_ops import pull_buffer
from ps_server.core.routing import shard_of
from ps_server.core.row_store import RowStore
from ps_server.core.shard_data import SparseShardData
from ps_server.core.table import ChangeLog, Table, TableSnapshot
from ps_server.errors import ReadOnlyServingError, TableInputError


class ServingTable(Table):
    """The rows of one sparse table of a serving export that this server owns (read-only)."""

    KIND = "sparse"

    def __init__(self, config: SparseTableConfig, shards: Iterable[int] | None = None) -> None:
        if not isinstance(config, SparseTableConfig):
            raise TypeError(f"ServingTable needs a SparseTableConfig, got {type(config).__name__}")
        super().__init__(config, shards)
        self.dim = config.dim
        self.store = RowStore(
            {
                "values": ((self.dim,), np.float32),
                "state": ((0,), np.float32),
                "count": ((), np.uint32),
                "unseen_days": ((), np.uint16),
            }
        )
        self._counters = {"pull_keys": 0, "pulls_unknown": 0}

    @property
    def num_rows(self) -> int:
        """Rows held."""
        return self.store.num_rows

    @property
    def memory_bytes(self) -> int:
        """Bytes of the row arrays and index."""
        return self.store.memory_bytes

    def stats(self) -> dict[str, Any]:
        """Sizes and counters (plain data)."""
        with self.lock:
            return {
                "table": self.name,
                "kind": self.KIND,
                "serving": True,
                "shards": len(self.shards),
                "num_rows": self.num_rows,
                "memory_bytes": self.memory_bytes,
                **self._counters,
            }

    def pull(self, keys: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """float32[n, dim]: the rows of ``keys`` (int64[n]); zeros for keys not held."""
        if not isinstance(keys, np.ndarray) or keys.dtype != np.int64 or keys.ndim != 1:
            raise TableInputError(self.name, "keys", "must be a 1-D numpy int64 array")
        out = pull_buffer(self.name, keys.shape[0], self.dim, out)
        with self.lock:
            rows = self.store.lookup(np.ascontiguousarray(keys))
            self.store.gather_into("values", rows, out)
            unknown = rows < 0
            if unknown.any():
                out[unknown] = 0.0
                self._counters["pulls_unknown"] += int(unknown.sum())
            self._counters["pull_keys"] += int(keys.shape[0])
        return out

    # -- checkpoint hooks: loading exports (writing one from a serving copy is not needed) ----
    def _snapshot(self, delta: bool, log: ChangeLog | None) -> TableSnapshot:
        raise ReadOnlyServingError(
            f"table {self.name!r} is a read-only serving copy: export from the training servers"
        )

    def import_shard(self, payload: SparseShardData, delta: bool) -> int:
        """Upsert one shard of a serving export (a delta first removes its deleted keys)."""
        if payload.shard not in self.shards:
            raise TableInputError(self.name, "shard", f"shard {payload.shard} is not owned here")
        if (
            payload.keys.shape[0]
            and (shard_of(payload.keys, self.config.num_shards) != payload.shard).any()
        ):
            raise TableInputError(
                self.name, "shard", f"the file of shard {payload.shard} holds keys of other shards"
            )
        sparse_shards.import_shard(self.store, None, payload, delta)
        return int(payload.keys.shape[0])

    def clear(self) -> None:
        """Drop every row."""
        self.store.clear()

    def mark_saved(self) -> None:
        """Nothing to track: a serving copy never changes but by loading."""
        self.store.mark_saved()


__all__ = ["ServingTable"]
