"""What iterating a dataset yields: a :class:`Batch`, slot name -> tensor or :class:`SparseBatch`.

* a dense slot: a ``[B, dim]`` tensor, float32 (int64 for an int64 slot; a label declared
  ``Slot("click", dense=True)`` is ``[B, 1]`` int64);
* a sparse slot: a :class:`SparseBatch` -- the jagged layout of ``nn.EmbeddingBag``
  (``input=values, offsets=offsets[:-1]``) and of TorchRec's ``JaggedTensor`` (``values``,
  ``lengths``, ``offsets``).

Where Paddle's executor feeds ``LoDTensor`` s (values + level-of-detail offsets) to a static
program, a torch model takes these; ``fleet.DistributedEmbedding`` takes a SparseBatch as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fleet.data.columns import Columns


@dataclass(frozen=True)
class SparseBatch:
    """A sparse slot of a batch: example ``i`` holds ``values[offsets[i]:offsets[i + 1]]``.

    Named after its role (the sparse slot of a batch), not TorchRec's ``JaggedTensor``, which it
    resembles but does not depend on: ``torchrec.JaggedTensor(values=sb.values,
    lengths=sb.lengths)`` converts it.
    """

    values: torch.Tensor
    """All values of the batch, example after example (int64 ids, or float32)."""
    lengths: torch.Tensor
    """int64 ``[B]``: values per example (0 allowed)."""
    offsets: torch.Tensor
    """int64 ``[B + 1]``: start of each example's values, then the total; ``offsets[0] == 0``."""

    @property
    def batch_size(self) -> int:
        """B, the examples in the batch."""
        return int(self.lengths.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseBatch:
        """The same batch on ``device``."""
        return SparseBatch(
            *(
                t.to(device, non_blocking=non_blocking)
                for t in (self.values, self.lengths, self.offsets)
            )
        )

    def pin_memory(self) -> SparseBatch:
        """The same batch in pinned host memory (for ``to(cuda, non_blocking=True)``)."""
        return SparseBatch(
            self.values.pin_memory(), self.lengths.pin_memory(), self.offsets.pin_memory()
        )

    def embedding_bag_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input, offsets)`` for ``nn.EmbeddingBag`` / ``F.embedding_bag`` (``offsets`` of the
        ``B`` bags, without the total)."""
        return self.values, self.offsets[:-1]

    def pool(
        self, bag: torch.nn.EmbeddingBag, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``bag(values, offsets[:-1])``: ``[B, embedding_dim]``, an empty example pooling to
        zeros (ids must be in ``range(bag.num_embeddings)``: hash or map raw ids first)."""
        return bag(self.values, self.offsets[:-1], per_sample_weights=per_sample_weights)


class Batch(dict):
    """Slot name -> ``Tensor`` (dense slot) or :class:`SparseBatch` (sparse slot), in ``use_var``
    order; a plain ``dict`` with two helpers."""

    @property
    def batch_size(self) -> int:
        """B, the examples in the batch."""
        for value in self.values():
            return value.batch_size if isinstance(value, SparseBatch) else int(value.shape[0])
        return 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The same batch on ``device``."""
        return Batch((k, v.to(device, non_blocking=non_blocking)) for k, v in self.items())


def _tensor(array: np.ndarray) -> torch.Tensor:
    # a fresh, writable copy: the batch must not alias the dataset's memory
    return torch.from_numpy(np.array(array, copy=True))


def make_batch(cols: Columns, copy: bool = True) -> Batch:
    """A :class:`Batch` of ``cols`` (copied unless ``copy=False``: then the tensors may share
    memory with ``cols``, which must be fresh arrays nobody else holds)."""
    conv: Any = _tensor if copy else (lambda a: torch.from_numpy(np.ascontiguousarray(a)))
    out = Batch()
    for slot, col in zip(cols.slots, cols.data):
        if isinstance(col, np.ndarray):
            out[slot.name] = conv(col)
        else:
            values, offsets = col
            out[slot.name] = SparseBatch(
                conv(values), torch.from_numpy(np.diff(offsets)), conv(offsets)
            )
    return out


__all__ = ["Batch", "SparseBatch", "make_batch"]
