"""What a table exports and imports per shard: the payload types of its checkpoint hooks
(:meth:`~ps_server.core.table.Table.export_shards` / ``import_shard``).

Plain numpy data, no file format: :mod:`ps_server.checkpoint.shard_file` encodes these to bytes
and back, so the tables (core) never import the checkpoint code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SparseShardData:
    """One shard of a sparse table, as written to / read from a shard file."""

    shard: int
    keys: np.ndarray  # int64[R]
    values: np.ndarray  # float32[R, dim]
    state: np.ndarray  # float32[R, state_dim]
    count: np.ndarray  # uint32[R]
    unseen_days: np.ndarray  # uint16[R]
    flags: np.ndarray  # uint8[R]
    pending_keys: np.ndarray  # int64[P]
    pending_count: np.ndarray  # uint32[P]
    pending_unseen_days: np.ndarray  # uint16[P]
    pending_flags: np.ndarray  # uint8[P]
    deleted_keys: np.ndarray  # int64[D]
    deleted_pending_keys: np.ndarray  # int64[E]


@dataclass
class DenseBlockData:
    """One named block of a dense table."""

    name: str
    values: np.ndarray  # float32[numel]
    state: np.ndarray  # float32[state length]


@dataclass
class DenseShardData:
    """The blocks of a dense table that hash to one shard."""

    shard: int
    blocks: list[DenseBlockData] = field(default_factory=list)


__all__ = ["DenseBlockData", "DenseShardData", "SparseShardData"]
