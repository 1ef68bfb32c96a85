"""Paddle's ``GraphPyClient`` method names over :class:`ps_server.graph_client.GraphClient`.

One instance works on one graph table (Paddle's client is set up with one table's node and edge
types). Differences from Paddle, and why:

* results are numpy arrays, not lists of bytes: ``random_sample_neighbors`` gives one int64
  array of neighbours per node (with ``need_weight=True``, ``(ids, weights)`` pairs of arrays),
  ``get_node_feat`` one ``[len(node_ids), width]`` array per feature (Paddle: a byte string per
  node and feature);
* ``random_sample_nodes`` and ``pull_graph_list`` take no server index: they cover every
  server (``random_sample_nodes`` uniform over all nodes of the type, ``pull_graph_list`` a page
  of one fixed order of all of them). Paddle asks one server at a time; its ``step`` argument is
  accepted and ignored;
* the ``edge_type`` / ``node_type`` arguments are names of the table's config.

:attr:`GraphPyClient.client` is the full :class:`~ps_server.graph_client.GraphClient` (random walks,
degrees, edits, edge ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ps_server.config import GraphTableConfig
from ps_server.graph_client import GraphClient


class GraphPyClient:
    """Graph table ``config`` (a :class:`~ps_server.config.GraphTableConfig`, created on the
    servers if it does not exist, or a table name) on the servers at ``endpoints``; ``options``
    go to :class:`~ps_server.graph_client.GraphClient` (``token``, ``timeout_s``, ...)."""

    def __init__(
        self, endpoints: Sequence[str] | str, config: GraphTableConfig | str, **options: Any
    ) -> None:
        self.client = GraphClient(endpoints, **options)
        if isinstance(config, GraphTableConfig):
            self.client.create_graph_table(config)
            self.table = config.name
        else:
            self.table = config
            self.client.config(config)

    def load_edge_file(
        self, edge_type: str, filepath: str | Sequence[str], reverse: bool = False, **kw: Any
    ) -> dict[str, int]:
        """Edges ``src<TAB>dst[<TAB>weight]`` of ``edge_type`` from files, globs or fsspec URLs
        (``reverse``: dst->src too; ``on_error="skip"`` drops and counts bad lines)."""
        return self.client.load_edges(self.table, filepath, edge_type, reverse, **kw)

    def load_node_file(self, node_type: str, filepath: str | Sequence[str], **kw: Any) -> dict:
        """Nodes ``type<TAB>id<TAB>name v v...`` (every type in the file is loaded, as
        Paddle's; ``node_type`` is kept for its signature)."""
        return self.client.load_nodes(self.table, filepath, **kw)

    def random_sample_neighbors(
        self, edge_type: str, node_ids: Any, sample_size: int, need_weight: bool = False
    ) -> list:
        """Per node, up to ``sample_size`` distinct neighbours (every one when the degree is
        lower): an int64 array, or ``(ids, weights)`` with ``need_weight``."""
        values, offsets, *rest = self.client.sample_neighbors(
            self.table, node_ids, sample_size, edge_type, return_weights=need_weight
        )
        ids = np.split(values, offsets[1:-1])
        if not need_weight:
            return ids
        return list(zip(ids, np.split(rest[0], offsets[1:-1])))

    def random_sample_nodes(self, node_type: str, sample_size: int) -> np.ndarray:
        """``sample_size`` distinct nodes of ``node_type``, uniform over every server."""
        return self.client.random_nodes(self.table, sample_size, node_type)

    def pull_graph_list(self, node_type: str, start: int, size: int, step: int = 1) -> np.ndarray:
        """Ids ``[start, start + size)`` of every node of ``node_type`` (``step`` ignored)."""
        return self.client.pull_graph_list(self.table, start, size, node_type)

    def get_node_feat(
        self, node_type: str, node_ids: Any, feature_names: Sequence[str]
    ) -> list[np.ndarray]:
        """One ``[len(node_ids), width]`` array per feature name (zeros for unknown nodes)."""
        got = self.client.node_features(self.table, node_ids, list(feature_names), node_type)
        return [got[n] for n in feature_names]

    def close(self) -> None:
        """Close the channels."""
        self.client.close()


__all__ = ["GraphPyClient"]
