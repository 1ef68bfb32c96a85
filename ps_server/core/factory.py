"""Build the table object for a config: the one dispatch from config type to table class."""

from __future__ import annotations

from typing import Any

from ps_server.config import DenseTableConfig, SparseStorage, SparseTableConfig, TableConfig
from ps_server.core.dense_table import DenseTable
from ps_server.core.sparse_table import SparseTable
from ps_server.core.ssd_table import SsdSparseTable
from ps_server.core.table import Table


def make_table(
    config: TableConfig,
    server_index: int = 0,
    num_servers: int = 1,
    *,
    ssd_root: str | None = None,
    **kwargs: Any,
) -> Table:
    """The part of table ``config`` that server ``server_index`` of ``num_servers`` holds
    (``SparseTable``, ``SsdSparseTable`` or ``DenseTable``; ``kwargs`` go to the table class).
    ``ssd_root``: the server's SSD directory, needed by ``storage="ssd"`` tables only."""
    if isinstance(config, SparseTableConfig) and config.storage is SparseStorage.SSD:
        return SsdSparseTable.for_server(
            config, server_index, num_servers, ssd_root=ssd_root, **kwargs
        )
    if isinstance(config, SparseTableConfig):
        return SparseTable.for_server(config, server_index, num_servers, **kwargs)
    if isinstance(config, DenseTableConfig):
        return DenseTable.for_server(config, server_index, num_servers, **kwargs)
    raise TypeError(
        f"expected a SparseTableConfig or DenseTableConfig, got {type(config).__name__}"
    )


__all__ = ["make_table"]
