"""``fleet.util``: helpers that depend on the trainer's place in the job.

:func:`get_file_shard` splits a file list the way Paddle's ``fleet.util.get_file_shard`` does:
contiguous blocks by rank, the first ``len(files) % worker_num`` trainers get one file more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from collective.errors import ConfigError
from fleet.base.runtime import get_runtime

T = TypeVar("T")


def shard_files(files: Sequence[T], rank: int, world_size: int) -> list[T]:
    """The contiguous block of ``files`` that trainer ``rank`` of ``world_size`` reads.

    Blocks are ``len(files) // world_size`` long; the first ``len(files) % world_size`` ranks get
    one extra. Ranks past the end of a short list get an empty list.
    """
    if isinstance(files, (str, bytes)) or not isinstance(files, Sequence):
        raise ConfigError(
            f"expected a list of file names, got {type(files).__name__} {files!r}", key="files"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}", key="rank")
    block, extra = divmod(len(files), world_size)
    begin = rank * block + min(rank, extra)
    end = begin + block + (1 if rank < extra else 0)
    return list(files[begin:end])


def get_file_shard(files: Sequence[T]) -> list[T]:
    """This trainer's share of ``files`` (see :func:`shard_files`); needs ``fleet.init`` first."""
    env = get_runtime("util.get_file_shard()").env
    return shard_files(files, env.rank, env.world_size)


__all__ = ["get_file_shard", "shard_files"]
