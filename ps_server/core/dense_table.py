"""Dense table: named flat float32 blocks (e.g. one per model parameter) with a server-side rule.

A block is created once by ``init(name, values)`` (the trainer that owns initialisation sends the
parameter's initial value; a second ``init`` with identical values is a no-op, with other values
an error — after a checkpoint load, ``pull`` the loaded value instead). ``push(name, grad)``
applies the table's optimizer rule to the whole block at once (state per element; Adam's step per
block, as for a torch parameter). Blocks are spread over ``num_shards`` shards by a stable hash of
their name (:func:`ps_server.core.routing.block_shard`); a server holds the blocks of its shards.
Values are stored flat: the client keeps the shapes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ps_server.config import DenseTableConfig, NonFinitePolicy
from ps_server.core.batch_ops import all_finite
from ps_server.core.routing import block_shard
from ps_server.core.shard_data import DenseBlockData, DenseShardData
from ps_server.core.table import ChangeLog, PayloadSnapshot, Table, TableSnapshot
from ps_server.errors import (
    NonFiniteGradientError,
    TableInputError,
    TableNotFoundError,
    WrongShardError,
)


@dataclass
class _Block:
    values: np.ndarray  # float32[1, numel]
    state: np.ndarray  # float32[1, state_dim(numel)]
    dirty: bool = True


class DenseTable(Table):
    """The blocks of one dense table that this server owns."""

    KIND = "dense"

    def __init__(self, config: DenseTableConfig, shards: Iterable[int] | None = None) -> None:
        """``shards``: the shards this server owns (default all)."""
        if not isinstance(config, DenseTableConfig):
            raise TypeError(f"DenseTable needs a DenseTableConfig, got {type(config).__name__}")
        super().__init__(config, shards)
        self._blocks: dict[str, _Block] = {}
        self._counters = dict.fromkeys(("pulls", "pushes", "nonfinite_skipped"), 0)

    @property
    def num_rows(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the blocks' values and optimizer state."""
        return sum(b.values.nbytes + b.state.nbytes for b in self._blocks.values())

    def stats(self) -> dict[str, Any]:
        """Sizes and cumulative counters (plain data)."""
        with self.lock:
            return {
                "table": self.name,
                "kind": self.KIND,
                "shards": len(self.shards),
                "num_blocks": len(self._blocks),
                "num_values": sum(b.values.size for b in self._blocks.values()),
                "memory_bytes": self.memory_bytes,
                **self._counters,
            }

    def names(self) -> list[str]:
        """Names of the blocks held, sorted."""
        with self.lock:
            return sorted(self._blocks)

    def _check_name(self, name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise TableInputError(self.name, "name", f"must be a non-empty string, got {name!r}")
        if len(name.encode("utf-8")) > 65535:
            raise TableInputError(self.name, "name", "must be at most 65535 bytes of UTF-8")
        shard = block_shard(name, self.config.num_shards)
        if shard not in self.shards:
            raise WrongShardError(
                self.name,
                "name",
                f"block {name!r} is in shard {shard}, which this server does not "
                "own; route blocks with ps_server.block_shard",
            )
        return name

    def _block(self, name: str) -> _Block:
        block = self._blocks.get(name)
        if block is None:
            raise TableNotFoundError(
                f"table {self.name!r}: no dense block {name!r}; create it with init(name, values) "
                f"first (this server holds {len(self._blocks)} block(s))"
            )
        return block

    def _check_array(self, field: str, values: Any, numel: int | None) -> np.ndarray:
        if not isinstance(values, np.ndarray):
            raise TableInputError(
                self.name, field, f"must be a numpy float32 array, got {type(values).__name__}"
            )
        if values.dtype != np.float32:
            raise TableInputError(
                self.name,
                field,
                f"dtype must be float32, got {values.dtype} (use .astype(np.float32))",
            )
        flat = np.ascontiguousarray(values).reshape(1, -1)
        if numel is not None and flat.shape[1] != numel:
            raise TableInputError(
                self.name, field, f"has {flat.shape[1]} elements, the block has {numel}"
            )
        return flat

    def init(self, name: str, values: np.ndarray) -> bool:
        """Create block ``name`` with ``values`` (any shape, stored flat); True if created,
        False if it already holds exactly these values; TableInputError if it holds others."""
        name = self._check_name(name)
        flat = self._check_array("values", values, None)
        if not np.isfinite(flat).all():
            raise TableInputError(self.name, "values", f"initial value of {name!r} has NaN/inf")
        with self.lock:
            existing = self._blocks.get(name)
            if existing is not None:
                if existing.values.shape == flat.shape and np.array_equal(existing.values, flat):
                    return False
                raise TableInputError(
                    self.name,
                    "values",
                    f"block {name!r} already exists with other values ({existing.values.shape[1]} "
                    f"elements, asked {flat.shape[1]}); init is idempotent only with identical "
                    "values — pull() the current value instead (e.g. after a checkpoint load)",
                )
            rule = self.config.optimizer
            state = np.empty((1, rule.state_dim(flat.shape[1])), dtype=np.float32)
            rule.init_state(state)
            self._blocks[name] = _Block(flat.copy(), state)
            return True

    def pull(self, name: str) -> np.ndarray:
        """A copy of block ``name`` (float32, flat)."""
        name = self._check_name(name)
        with self.lock:
            self._counters["pulls"] += 1
            return self._block(name).values[0].copy()

    def push(self, name: str, grad: np.ndarray) -> bool:
        """Apply ``grad`` (float32, the block's element count, any shape) to block ``name``.

        Returns False when the push was skipped for NaN/inf under ``nonfinite="skip"``.
        """
        name = self._check_name(name)
        with self.lock:
            block = self._block(name)
            g = self._check_array("grad", grad, block.values.shape[1])
            bad = 0 if all_finite(g) else int((~np.isfinite(g)).sum())
            if bad:
                if self.config.nonfinite is NonFinitePolicy.REJECT:
                    raise NonFiniteGradientError(self.name, bad, 1, field=f"grad of {name!r}")
                self._counters["nonfinite_skipped"] += 1
                return False
            self.config.optimizer.update(block.values, block.state, g, None)
            block.dirty = True
            self._counters["pushes"] += 1
            return True

    def add(self, name: str, delta: np.ndarray) -> bool:
        """Add ``delta`` (float32, the block's element count) to block ``name``, no optimizer
        rule (GEO); False when skipped for NaN/inf under ``nonfinite="skip"``."""
        name = self._check_name(name)
        with self.lock:
            block = self._block(name)
            flat = np.asarray(delta, dtype=np.float32).reshape(1, -1)
            if flat.shape[1] != block.values.shape[1]:
                raise TableInputError(
                    self.name,
                    "grad",
                    f"delta of {name!r} has {flat.shape[1]} elements, the block has "
                    f"{block.values.shape[1]}",
                )
            bad = 0 if all_finite(flat) else int((~np.isfinite(flat)).sum())
            if bad:
                if self.config.nonfinite is NonFinitePolicy.REJECT:
                    raise NonFiniteGradientError(self.name, bad, 1, field=f"delta of {name!r}")
                return False  # counted by the server (dense_nonfinite_skipped)
            block.values += flat
            block.dirty = True
            self._counters["pushes"] += 1
            return True

    def numel(self, name: str) -> int:
        """Elements of block ``name``."""
        name = self._check_name(name)
        with self.lock:
            return int(self._block(name).values.shape[1])

    def pull_slice(self, name: str, offset: int, count: int) -> tuple[np.ndarray, int]:
        """(a copy of elements ``[offset, offset + count)`` of block ``name``, the block's
        size); ``count == 0`` means up to the end. A block larger than one message is pulled in
        ranges, without copying the whole block each time."""
        name = self._check_name(name)
        with self.lock:
            values = self._block(name).values[0]
            total = int(values.shape[0])
            if offset > total:
                raise TableInputError(
                    self.name, "offset", f"{offset} is past the end of {name!r} ({total} elements)"
                )
            end = total if count == 0 else min(total, offset + count)
            self._counters["pulls"] += 1
            return values[offset:end].copy(), total

    # -- checkpoint hooks ---------------------------------------------------------------------
    def _snapshot(self, delta: bool, log: ChangeLog | None) -> PayloadSnapshot:
        """Copies of the blocks per owned shard (delta save: only those pushed or created since
        the last save; a delta export takes every block — dense blocks are small)."""
        only_dirty = delta and log is ChangeLog.SAVE
        out = {s: DenseShardData(s) for s in self.shards}
        for name in sorted(self._blocks):
            block = self._blocks[name]
            if only_dirty and not block.dirty:
                continue
            out[block_shard(name, self.config.num_shards)].blocks.append(
                DenseBlockData(name, block.values[0].copy(), block.state[0].copy())
            )
        return PayloadSnapshot(self._meta(delta), out)

    def import_shard(self, payload: DenseShardData, delta: bool) -> int:
        """Set the blocks of one shard from a checkpoint; returns blocks read."""
        rule = self.config.optimizer
        for b in payload.blocks:
            if block_shard(b.name, self.config.num_shards) != payload.shard:
                raise TableInputError(
                    self.name,
                    "shard",
                    f"block {b.name!r} found in the file of shard {payload.shard}",
                )
            want = rule.state_dim(b.values.shape[0])
            if b.state.shape[0] != want:
                raise TableInputError(
                    self.name,
                    "state",
                    f"block {b.name!r} has {b.state.shape[0]} state values, the "
                    f"optimizer {rule.TYPE!r} needs {want}",
                )
            self._blocks[b.name] = _Block(
                b.values.reshape(1, -1).astype(np.float32),
                b.state.reshape(1, -1).astype(np.float32),
                dirty=False,
            )
        return len(payload.blocks)

    def clear(self) -> None:
        """Drop every block."""
        self._blocks = {}

    def requeue_changes(self, log: ChangeLog, snapshot: TableSnapshot) -> None:
        """A lost delta save: every block counts as changed again (exports take all blocks)."""
        if log is ChangeLog.SAVE:
            with self.lock:
                for b in self._blocks.values():
                    b.dirty = True

    def mark_saved(self) -> None:
        """Forget the dirty marks."""
        for b in self._blocks.values():
            b.dirty = False
        self.days_since_save = 0


__all__ = ["DenseTable"]
