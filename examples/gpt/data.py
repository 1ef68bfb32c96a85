"""Synthetic tokens for the tiny GPT: sequences from a fixed random Markov chain.

Each token is drawn from a sparse transition table (``branching`` likely successors per token),
so the next token is predictable and a working model's loss falls from ``log(vocab)`` towards
``log(branching)``. Batches are a pure function of ``(seed, step)``: every rank generates the same
global batch and takes its data-parallel share, so runs at different degrees see the same data.
"""

from __future__ import annotations

import torch


class MarkovTokens:
    """Token batches ``(inputs, labels)`` of shape ``[batch, seq_len]`` (labels = next tokens)."""

    def __init__(self, vocab_size: int, seq_len: int, branching: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        choice = torch.randint(0, self.successors.shape[1], (batch_size, self.seq_len), generator=g)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def shard(
        self, step: int, batch_size: int, rank: int, world: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Data-parallel rank ``rank``'s ``batch_size`` samples of the global batch."""
        x, y = self.batch(step, batch_size * world)
        part = slice(rank * batch_size, (rank + 1) * batch_size)
        return x[part], y[part]


__all__ = ["MarkovTokens"]
