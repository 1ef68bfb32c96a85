"""Wide & deep CTR model over single-id categorical slots and dense features, with a pluggable
embedding.

The model never touches an embedding table itself: it asks an **embedding factory**
``(num_slots, dim) -> nn.Module`` for two modules, each mapping int64 ids ``[B, num_slots]`` to
float ``[B, num_slots, dim]``:

* the *wide* (linear) part: ``dim = 1``, one weight per id, summed over the slots;
* the *deep* part: ``dim = embedding_dim``, concatenated with the dense features into an MLP.

:class:`HashedEmbedding` (the single-process baseline) hashes the raw 64-bit ids into a fixed
``nn.Embedding(num_rows, dim, sparse=True)``; a parameter-server embedding plugs in the same way
and pulls the rows of the raw ids from the servers. The MLP and the dense linear term are ordinary
dense parameters (:meth:`WideDeep.dense_parameters`); the embeddings' parameters
(:meth:`WideDeep.sparse_parameters`) get sparse gradients for a sparse-capable optimiser.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

EmbeddingFactory = Callable[[int, int], nn.Module]
"""``(num_slots, dim) -> module`` mapping int64 ids ``[B, num_slots]`` to float
``[B, num_slots, dim]``."""

DEFAULT_HASH_ROWS = 1 << 20
"""Rows of the baseline's hashed table (shared by all slots): 2**20 = 1,048,576. The default data
(26 slots x 100k Zipf ranks) uses far fewer distinct ids in 200k examples (~0.5M), so collisions
stay rare; at dim 16 the deep table is 64 MiB of float32."""


class HashedEmbedding(nn.Module):
    """One ``nn.Embedding(num_rows, dim, sparse=True)`` shared by every slot; id ``x`` uses row
    ``x mod num_rows`` (Python's non-negative modulo, so negative ids are fine).

    The modulo is the whole hash: it assumes well-spread ids, which the generator's splitmix64
    ids are (and which are distinct across slots, so slots do not need their own tables).
    Hash real ids (e.g. feature strings) before feeding them.
    """

    def __init__(
        self,
        num_slots: int,
        dim: int,
        num_rows: int = DEFAULT_HASH_ROWS,
        init_std: float | None = None,
    ) -> None:
        """``num_slots``: ids per example; ``dim``: row width; ``num_rows``: table rows;
        ``init_std``: std of the N(0, std) initial rows (default: 0 for dim 1 — the wide part
        starts as a plain bias — else 0.05)."""
        super().__init__()
        if num_rows < 1 or dim < 1 or num_slots < 1:
            raise ValueError(
                f"HashedEmbedding needs num_rows, dim, num_slots >= 1, got {num_rows}, {dim}, "
                f"{num_slots}"
            )
        self.num_slots = num_slots
        self.num_rows = num_rows
        self.table = nn.Embedding(num_rows, dim, sparse=True)
        std = (0.0 if dim == 1 else 0.05) if init_std is None else init_std
        with torch.no_grad():
            if std > 0:
                self.table.weight.normal_(0.0, std)
            else:
                self.table.weight.zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ids ``[B, num_slots]`` -> ``[B, num_slots, dim]``."""
        return self.table(torch.remainder(ids, self.num_rows))


def hashed_embedding_factory(num_rows: int = DEFAULT_HASH_ROWS) -> EmbeddingFactory:
    """A factory of :class:`HashedEmbedding` with ``num_rows`` rows per table."""
    return functools.partial(HashedEmbedding, num_rows=num_rows)


class WideDeep(nn.Module):
    """``logit = sum_slots wide(id) + w . dense + b + MLP([deep(ids) flattened, dense])``."""

    def __init__(
        self,
        num_slots: int = 26,
        num_dense: int = 13,
        embedding_dim: int = 16,
        hidden_dims: Sequence[int] = (256, 128),
        embedding_factory: EmbeddingFactory | None = None,
    ) -> None:
        """``num_slots`` / ``num_dense``: input widths; ``embedding_dim``: deep embedding width;
        ``hidden_dims``: MLP hidden layer widths (ReLU); ``embedding_factory``: builds the wide
        (dim 1) and deep embeddings (default :func:`hashed_embedding_factory`)."""
        super().__init__()
        factory = embedding_factory or hashed_embedding_factory()
        self.num_slots = num_slots
        self.num_dense = num_dense
        self.wide = factory(num_slots, 1)
        self.deep = factory(num_slots, embedding_dim)
        self.dense_linear = nn.Linear(num_dense, 1)
        layers: list[nn.Module] = []
        width = num_slots * embedding_dim + num_dense
        for hidden in hidden_dims:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, sparse_ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, num_slots]`` ids and float ``[B, num_dense]`` features -> logits ``[B]``."""
        wide = self.wide(sparse_ids).sum(dim=(1, 2)) + self.dense_linear(dense).squeeze(-1)
        deep_in = torch.cat([self.deep(sparse_ids).flatten(1), dense], dim=1)
        return wide + self.mlp(deep_in).squeeze(-1)

    def embedding_modules(self) -> list[nn.Module]:
        """The modules built by the embedding factory (wide, deep)."""
        return [self.wide, self.deep]

    def sparse_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of the embedding modules (sparse gradients with HashedEmbedding)."""
        for module in self.embedding_modules():
            yield from module.parameters()

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Every other parameter (MLP, dense linear term): ordinary dense gradients."""
        sparse = {id(p) for p in self.sparse_parameters()}
        for p in self.parameters():
            if id(p) not in sparse:
                yield p


__all__ = [
    "DEFAULT_HASH_ROWS",
    "EmbeddingFactory",
    "HashedEmbedding",
    "WideDeep",
    "hashed_embedding_factory",
]
