"""Serving exports on disk: loading a base export and its deltas into read-only tables.

A serving export is a checkpoint directory of kind ``serving`` (layout:
:mod:`ps_server.checkpoint.manifest`; committed with ``checkpoint.json`` like any checkpoint,
:mod:`ps_server.checkpoint.series`): per sparse table the rows whose show count is at least the
export's ``min_show`` (keys, values, counts; no optimizer state), the dense tables whole, and in
``checkpoint.json`` under ``extra`` what the caller described (``model_config``: tables, slots,
anything JSON), the dense parameters' layout, ``min_show``, and ``follows`` (the export a delta
was taken after).

A base export (``mode="all"``) holds every row; a delta (``mode="delta"``) the rows changed since
the previous export of the same servers and the keys deleted since. :func:`load_serving` loads a
base and then its deltas in order — the way a daily base and hourly deltas update a serving
copy; a delta whose ``follows`` is not the directory loaded before it is refused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from ps_server.checkpoint.manifest import read_checkpoint
from ps_server.checkpoint.save_load import load
from ps_server.checkpoint.series import CheckpointRecord, Verify, verify
from ps_server.config import SparseTableConfig
from ps_server.core.factory import make_table
from ps_server.core.routing import shards_of_server
from ps_server.core.serving_table import ServingTable
from ps_server.core.table import Table
from ps_server.errors import CheckpointError

logger = logging.getLogger(__name__)


def _serving_table(config: object, server_index: int, num_servers: int) -> Table:
    if isinstance(config, SparseTableConfig):
        shards = shards_of_server(server_index, num_servers, config.num_shards)
        return ServingTable(config, shards)
    return make_table(config, server_index, num_servers)


def check_chain(records: Sequence[CheckpointRecord]) -> None:
    """CheckpointError unless ``records`` are serving exports: one base, then deltas each taken
    right after the one before it."""
    for i, rec in enumerate(records):
        if rec.kind != "serving":
            raise CheckpointError(
                f"{rec.directory} is a {rec.kind}, not a serving export (export one with "
                "fleet.ps.export_serving / PSClient.export_serving)"
            )
        want = "all" if i == 0 else "delta"
        if rec.mode != want:
            raise CheckpointError(
                f"{rec.directory}: a {rec.mode} export where a {want} export is needed (serve a "
                "base export first, then its deltas in the order they were exported)"
            )
        follows = rec.extra.get("follows")
        if i and follows and follows != records[i - 1].name:
            raise CheckpointError(
                f"{rec.directory}: this delta follows export {follows!r}, not "
                f"{records[i - 1].name!r}: pass the deltas in the order they were exported"
            )


def load_serving(
    directories: Sequence[str | os.PathLike], server_index: int = 0, num_servers: int = 1
) -> tuple[dict[str, Table], list[CheckpointRecord]]:
    """Read-only tables of server ``server_index`` of ``num_servers`` (any count: the shards are
    re-spread) from a base export and its deltas (in order). Each export must be committed;
    every file read is checked against its size and CRC-32. Returns (tables, the records)."""
    if not directories:
        raise CheckpointError("name at least one serving export directory")
    records = [verify(Path(d), Verify.MANIFESTS) for d in directories]
    check_chain(records)
    info = read_checkpoint(records[0].directory)
    tables = {
        name: _serving_table(e.config, server_index, num_servers)
        for name, e in sorted(info.tables.items())
    }
    for rec in records:
        rows = load(rec.directory, tables, kind="serving")
        logger.info("serving: loaded %s export %s: %s", rec.mode, rec.directory, rows)
    return tables, records


__all__ = ["check_chain", "load_serving"]
