"""An author-paper-venue graph with planted author communities, for the metapath2vec example.

:func:`generate` builds, deterministically from a seed, a heterogeneous graph of three node types:

* ``authors`` in ``classes`` balanced communities (the label to recover);
* ``papers``: paper ``j`` has a first author (every author is the first author of at least one
  paper) and ``coauthors`` more, each from the first author's community with probability
  ``p_intra``, otherwise from a uniform random one;
* ``venues``: ``venues_per_class`` per community; a paper appears in a venue of its first
  author's community with probability ``p_intra``, otherwise in a uniform random venue.

Node ids are globally distinct int64: authors ``0 .. A-1``, then papers, then venues.
:func:`write_files` writes one ``src<TAB>dst`` file per edge type (both directions of each
relation are edge types of their own, so walks can follow a metapath such as
author-paper-venue-paper-author), and :func:`table_config` is the matching graph table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ps_server.config import GraphTableConfig

TABLE = "apv"
"""The graph table's name."""
EDGE_TYPES = (
    ("writes", "author", "paper"),
    ("written_by", "paper", "author"),
    ("published_in", "paper", "venue"),
    ("publishes", "venue", "paper"),
)
"""The edge types: each relation in both directions."""
METAPATH = ("writes", "published_in", "publishes", "written_by")
"""Author-paper-venue-paper-author (APVPA), repeated along a walk."""


@dataclass(frozen=True)
class HeteroConfig:
    """Sizes and separation of the generated graph."""

    authors: int = 2000
    papers_per_author: float = 3.0
    """Papers per author (at least 1: every author is a first author)."""
    coauthors: int = 2
    """Authors per paper besides the first."""
    venues_per_class: int = 5
    classes: int = 4
    p_intra: float = 0.8
    """Chance that a coauthor or the venue is of the first author's community."""
    train_frac: float = 0.5
    seed: int = 0


@dataclass
class HeteroGraph:
    """A generated graph: per relation, int64 (src, dst) id arrays."""

    labels: np.ndarray
    """int64 community of each author (author ``i`` has id ``i``)."""
    papers: np.ndarray
    venues: np.ndarray
    """int64 ids of the papers and venues."""
    author_paper: tuple[np.ndarray, np.ndarray]
    paper_venue: tuple[np.ndarray, np.ndarray]
    train: np.ndarray
    test: np.ndarray
    """Disjoint author ids for training and evaluation."""

    @property
    def authors(self) -> np.ndarray:
        """Every author id."""
        return np.arange(self.labels.shape[0], dtype=np.int64)

    @property
    def nodes(self) -> np.ndarray:
        """Every node id (authors, papers, venues)."""
        return np.concatenate([self.authors, self.papers, self.venues])

    def edges(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """(src, dst) of each edge type of :data:`EDGE_TYPES`."""
        (a, p), (q, v) = self.author_paper, self.paper_venue
        return {"writes": (a, p), "written_by": (p, a), "published_in": (q, v), "publishes": (v, q)}


def _of_class(rng: np.random.Generator, members: list[np.ndarray], classes: np.ndarray):
    """One uniform random member of each entry's class."""
    sizes = np.array([m.shape[0] for m in members])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    flat = np.concatenate(members)
    pick = (rng.random(classes.shape[0]) * sizes[classes]).astype(np.int64)
    return flat[offsets[classes] + pick]


def _mixed(rng: np.random.Generator, home: np.ndarray, k: int, p_intra: float) -> np.ndarray:
    """``home`` with probability ``p_intra``, otherwise a uniform random class."""
    return np.where(rng.random(home.shape[0]) < p_intra, home, rng.integers(0, k, home.shape[0]))


def generate(cfg: HeteroConfig) -> HeteroGraph:
    """The graph of ``cfg`` (the same for the same config)."""
    rng = np.random.default_rng(cfg.seed)
    a, k = cfg.authors, cfg.classes
    labels = rng.permutation(np.arange(a) % k).astype(np.int64)
    members = [np.flatnonzero(labels == c) for c in range(k)]
    n_papers = max(a, int(a * cfg.papers_per_author))
    papers = a + np.arange(n_papers, dtype=np.int64)
    first = np.concatenate([rng.permutation(a), rng.integers(0, a, n_papers - a)])
    home = labels[first]
    authors = [first]
    for _ in range(cfg.coauthors):
        authors.append(_of_class(rng, members, _mixed(rng, home, k, cfg.p_intra)))
    pa = np.unique(np.stack([np.tile(papers, len(authors)), np.concatenate(authors)], 1), axis=0)
    n_venues = k * cfg.venues_per_class
    venues = a + n_papers + np.arange(n_venues, dtype=np.int64)
    venue_class = np.arange(n_venues) % k
    by_class = [venues[venue_class == c] for c in range(k)]
    venue = _of_class(rng, by_class, _mixed(rng, home, k, cfg.p_intra))
    order = rng.permutation(a)
    n_train = int(a * cfg.train_frac)
    return HeteroGraph(
        labels=labels,
        papers=papers,
        venues=venues,
        author_paper=(pa[:, 1].copy(), pa[:, 0].copy()),
        paper_venue=(papers, venue),
        train=np.sort(order[:n_train]).astype(np.int64),
        test=np.sort(order[n_train:]).astype(np.int64),
    )


def table_config(num_shards: int = 16) -> GraphTableConfig:
    """The graph table holding :func:`write_files`' files: node types author, paper, venue and
    the edge types of :data:`EDGE_TYPES`."""
    return GraphTableConfig(
        TABLE,
        node_types=["author", "paper", "venue"],
        edge_types=list(EDGE_TYPES),
        num_shards=num_shards,
    )


def write_files(graph: HeteroGraph, directory: str) -> dict[str, str]:
    """One ``src<TAB>dst`` file per edge type under ``directory``; {edge type: path}."""
    os.makedirs(directory, exist_ok=True)
    out = {}
    for name, (src, dst) in graph.edges().items():
        path = os.path.join(directory, f"{name}.txt")
        with open(path, "w", encoding="ascii") as f:
            f.write("".join(f"{s}\t{d}\n" for s, d in zip(src.tolist(), dst.tolist())))
        out[name] = path
    return out
