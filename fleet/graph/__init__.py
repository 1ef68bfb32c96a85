"""``fleet.graph``: graph tables on the parameter servers, for GNN training from trainers.

Owns the trainer-side graph API: :class:`NeighborLoader` (multi-hop sampled subgraphs as
mini-batches for PyTorch Geometric layers, :mod:`fleet.graph.loader`) and :class:`GraphPyClient`,
Paddle's ``GraphPyClient`` method names
(``load_edge_file``, ``load_node_file``, ``random_sample_neighbors``, ``random_sample_nodes``,
``pull_graph_list``, ``get_node_feat``) over :class:`ps_server.graph_client.GraphClient`. The
tables themselves (CSR storage, sampling, file loading) live in :mod:`ps_server.core.graph_table`
and are served by :mod:`ps_server.rpc.graph_service`. May import :mod:`ps_server` and
:mod:`collective`; nothing else of fleet, and no sibling feature package imports it.

::

    from fleet.graph import GraphPyClient
    from ps_server.config import GraphTableConfig

    client = GraphPyClient(endpoints, GraphTableConfig("g", ["user", "item"],
                           [("u2i", "user", "item"), ("i2u", "item", "user")]))
    client.load_edge_file("u2i", "data/u2i-*.txt", reverse=False)
    neighbours = client.random_sample_neighbors("u2i", [1, 2, 3], 10)
"""

from __future__ import annotations

from fleet.graph.client import GraphPyClient
from fleet.graph.loader import NeighborLoader, SubgraphBatch

__all__ = ["GraphPyClient", "NeighborLoader", "SubgraphBatch"]
