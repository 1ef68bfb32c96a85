"""A stochastic block model with planted classes, for the graph examples.

:func:`generate` builds, deterministically from a seed, an undirected graph whose nodes fall in
``classes`` balanced communities (a share ``p_intra`` of the edges joins two nodes of the same
community, the rest two of different ones) and float features that carry the class noisily
(``signal`` times a per-class centre plus standard normal noise). :func:`write_files` writes it
in Paddle's graph file formats (``src<TAB>dst`` edge lines, each undirected edge once: load them
with ``reverse=True``; ``node<TAB>id<TAB>x v v ...<TAB>label c`` node lines), and
:func:`table_config` is the matching graph table. :class:`LocalGraph` loads the same files into
one in-process :class:`~ps_server.core.graph_table.GraphTable` (the servers' CSR and sampling
code, no RPC) behind the two client calls ``NeighborLoader`` makes, for the single-process
reference runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ps_server.config import GraphTableConfig
from ps_server.core.graph_table import GraphTable

TABLE = "sbm"
"""The graph table's name in both examples."""


@dataclass(frozen=True)
class SBMConfig:
    """Sizes and separation of the generated graph."""

    nodes: int = 3000
    classes: int = 4
    avg_degree: float = 10.0
    """Mean undirected degree (``nodes * avg_degree / 2`` edges before removing duplicates)."""
    p_intra: float = 0.8
    """Share of the edges inside one community."""
    feature_dim: int = 16
    signal: float = 0.5
    """Scale of the class centres against unit noise in the features."""
    train_frac: float = 0.5
    seed: int = 0


@dataclass
class SBMGraph:
    """A generated graph: node ids ``0 .. n-1``."""

    labels: np.ndarray
    """int64 class of each node."""
    src: np.ndarray
    dst: np.ndarray
    """int64 undirected edges (``src < dst``, no duplicates)."""
    features: np.ndarray
    """float32 ``[n, feature_dim]``."""
    train: np.ndarray
    test: np.ndarray
    """Disjoint node ids for training and evaluation."""

    @property
    def ids(self) -> np.ndarray:
        """Every node id."""
        return np.arange(self.labels.shape[0], dtype=np.int64)


def generate(cfg: SBMConfig) -> SBMGraph:
    """The graph of ``cfg`` (the same for the same config)."""
    rng = np.random.default_rng(cfg.seed)
    n, k = cfg.nodes, cfg.classes
    labels = rng.permutation(np.arange(n) % k).astype(np.int64)
    members = [np.flatnonzero(labels == c) for c in range(k)]
    sizes = np.array([m.shape[0] for m in members])
    m_edges = int(n * cfg.avg_degree / 2)
    src = rng.integers(0, n, m_edges)
    intra = rng.random(m_edges) < cfg.p_intra
    other = (labels[src] + rng.integers(1, k, m_edges)) % k if k > 1 else labels[src]
    dst_class = np.where(intra, labels[src], other)
    pick = (rng.random(m_edges) * sizes[dst_class]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    flat = np.concatenate(members)
    dst = flat[offsets[dst_class] + pick]
    lo, hi = np.minimum(src, dst), np.maximum(src, dst)
    keep = lo != hi
    pairs = _sorted_unique(lo[keep] * n + hi[keep])
    centres = rng.standard_normal((k, cfg.feature_dim))
    feats = cfg.signal * centres[labels] + rng.standard_normal((n, cfg.feature_dim))
    order = rng.permutation(n)
    n_train = int(n * cfg.train_frac)
    return SBMGraph(
        labels=labels,
        src=(pairs // n).astype(np.int64),
        dst=(pairs % n).astype(np.int64),
        features=feats.astype(np.float32),
        train=np.sort(order[:n_train]).astype(np.int64),
        test=np.sort(order[n_train:]).astype(np.int64),
    )


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` by one sort (numpy's hash-based unique is ~20x slower on 10^7 keys)."""
    a = np.sort(a)
    keep = np.ones(a.shape[0], bool)
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def _write_rows(path: str, fmt: str, rows: np.ndarray, chunk: int = 1 << 18) -> None:
    """``np.savetxt(path, rows, fmt)`` with one format string per row, the same text, formatted
    from Python numbers by chunks (``savetxt`` formats numpy scalars row by row: ~3x slower)."""
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, rows.shape[0], chunk):
            columns = rows[start : start + chunk].T.tolist()
            f.write("\n".join(map(fmt.__mod__, zip(*columns))))
            f.write("\n")


def table_config(cfg: SBMConfig, num_shards: int = 16) -> GraphTableConfig:
    """The graph table holding :func:`write_files`' files: node type ``node``, edge type ``e``,
    features ``x`` (float32) and ``label`` (int64, width 1)."""
    return GraphTableConfig(
        TABLE,
        node_types=["node"],
        edge_types=["e"],
        features={"node": {"x": ("float32", cfg.feature_dim), "label": ("int64", 1)}},
        num_shards=num_shards,
    )


def write_files(graph: SBMGraph, directory: str) -> tuple[str, str]:
    """(edge file, node file) written under ``directory``."""
    os.makedirs(directory, exist_ok=True)
    edges = os.path.join(directory, "edges.txt")
    nodes = os.path.join(directory, "nodes.txt")
    _write_rows(edges, "%d\t%d", np.stack([graph.src, graph.dst], 1))
    width = graph.features.shape[1]
    rows = np.concatenate(
        [graph.ids[:, None], graph.features.astype(np.float64), graph.labels[:, None]], 1
    )
    _write_rows(nodes, "node\t%d\tx" + " %.9g" * width + "\tlabel %d", rows)
    return edges, nodes


class LocalGraph:
    """The graph files in one in-process ``GraphTable`` (the servers' CSR sampling, no RPC),
    answering ``sample_neighbors`` and ``node_features`` as ``GraphClient`` does."""

    def __init__(self, config: GraphTableConfig, edge_file: str, node_file: str) -> None:
        self.table = GraphTable(config)
        self.table.load_edges(None, edge_file, reverse=True)
        self.table.load_nodes(node_file)
        self._rng = np.random.default_rng()

    def sample_neighbors(
        self,
        table: str,
        nodes: np.ndarray,
        fanout: int,
        edge_type: str | None = None,
        weighted: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(values, offsets)`` as ``GraphClient.sample_neighbors``."""
        values, counts, _, _ = self.table.sample_neighbors(
            nodes, fanout, edge_type, weighted, self._rng
        )
        offsets = np.zeros(counts.shape[0] + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        return values, offsets

    def node_features(
        self,
        table: str,
        nodes: np.ndarray,
        names: Sequence[str] | None = None,
        node_type: str | None = None,
    ) -> dict[str, np.ndarray]:
        """``{name: [len(nodes), width]}`` as ``GraphClient.node_features``."""
        return self.table.node_features(nodes, names, node_type)[0]
