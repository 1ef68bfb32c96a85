"""The tiny GPT, described as a :class:`fleet.PipelineLayer` layer list.

::

    [embed] [positions] [block] x num_layers [final LayerNorm] [embed, used as the unembedding]

* ``embed``: a ``VocabParallelEmbedding`` (vocabulary rows split over the model-parallel ranks),
  a ``SharedLayerDesc`` used twice: as the input embedding on the first stage and, through
  :func:`tied_logits`, as the output projection on the last stage (tied weights; the pipeline
  engine sums the two stages' gradients).
* :class:`GPTBlock`: pre-LayerNorm causal self-attention whose q/k/v are
  ``ColumnParallelLinear(gather_output=False)`` (each model-parallel rank owns ``heads / mp``
  whole heads, since a column shard holds contiguous output rows) and whose output projection is
  a ``RowParallelLinear(input_is_parallel=True)``; then a Megatron MLP (Column -> GELU -> Row).
* the loss (:class:`GPTLoss`) is ``ParallelCrossEntropy`` on the vocabulary-parallel logits.

No dropout: the example is deterministic so runs at different degrees can be compared.
Every layer takes ``mp_group`` (the model-parallel group of fleet's hybrid topology).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from fleet.meta_parallel import (
    ColumnParallelLinear,
    LayerDesc,
    ParallelCrossEntropy,
    RowParallelLinear,
    SharedLayerDesc,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the tiny GPT."""

    vocab_size: int = 128
    """Tokens in the vocabulary (divisible by the model-parallel degree)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention heads (divisible by the model-parallel degree)."""
    num_layers: int = 4
    """Transformer blocks."""
    max_seq_len: int = 32
    """Longest sequence the position embedding covers."""


class _CopyToModelParallel(torch.autograd.Function):
    """Forward identity; backward sums the gradient over the model-parallel ranks (the hidden
    state feeds every rank's vocabulary shard of the tied unembedding)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        if tdist.get_world_size(ctx.group) > 1:
            tdist.all_reduce(grad, group=ctx.group)
        return grad, None


class TokenEmbedding(VocabParallelEmbedding):
    """The vocabulary-parallel token embedding, initialised N(0, 0.02^2) as in GPT-2."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mp_group: Any = None) -> None:
        super().__init__(num_embeddings, embedding_dim, mp_group=mp_group)
        with torch.no_grad():
            self.weight.mul_(0.02)


def tied_logits(embedding: VocabParallelEmbedding, h: torch.Tensor) -> torch.Tensor:
    """The unembedding: ``h @ E_r^T``, this rank's vocabulary slice of the logits."""
    return _CopyToModelParallel.apply(h, embedding.mp_group) @ embedding.weight.t()


class PositionEmbedding(nn.Module):
    """Adds a learned position embedding (replicated over the model-parallel ranks)."""

    def __init__(self, max_seq_len: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_seq_len, hidden_size) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


class GPTBlock(nn.Module):
    """Pre-LN transformer block with tensor-parallel attention and MLP."""

    def __init__(self, cfg: GPTConfig, mp_group: Any = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.ln1 = nn.LayerNorm(h)
        self.q = ColumnParallelLinear(h, h, gather_output=False, mp_group=mp_group)
        self.k = ColumnParallelLinear(h, h, gather_output=False, mp_group=mp_group)
        self.v = ColumnParallelLinear(h, h, gather_output=False, mp_group=mp_group)
        self.proj = RowParallelLinear(h, h, input_is_parallel=True, mp_group=mp_group)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = ColumnParallelLinear(h, 4 * h, gather_output=False, mp_group=mp_group)
        self.fc2 = RowParallelLinear(4 * h, h, input_is_parallel=True, mp_group=mp_group)
        mp = self.q.mp_degree
        if cfg.num_heads % mp:
            from collective.errors import ConfigError

            raise ConfigError(
                f"num_heads={cfg.num_heads} does not divide by the model-parallel degree {mp}",
                key="num_heads",
            )
        self.local_heads = cfg.num_heads // mp
        self.head_dim = h // cfg.num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln1(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            heads(self.q(y)), heads(self.k(y)), heads(self.v(y)), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPTLoss(nn.Module):
    """Mean token cross entropy of vocabulary-parallel logits ``[B, S, V/mp]``."""

    def __init__(self, mp_group: Any = None) -> None:
        super().__init__()
        self.ce = ParallelCrossEntropy(mp_group=mp_group)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.ce(logits, labels).mean()


def gpt_layer_descs(cfg: GPTConfig, mp_group: Any = None) -> list[Any]:
    """The GPT as a layer list for ``fleet.PipelineLayer`` (cut with ``seg_method="layer:GPTBlock"``
    to balance the blocks over the stages)."""
    embed = ("embed", TokenEmbedding)
    return [
        SharedLayerDesc(*embed, None, "weight", cfg.vocab_size, cfg.hidden_size, mp_group=mp_group),
        LayerDesc(PositionEmbedding, cfg.max_seq_len, cfg.hidden_size),
        *[LayerDesc(GPTBlock, cfg, mp_group=mp_group) for _ in range(cfg.num_layers)],
        LayerDesc(nn.LayerNorm, cfg.hidden_size),
        SharedLayerDesc(
            *embed, tied_logits, "weight", cfg.vocab_size, cfg.hidden_size, mp_group=mp_group
        ),
    ]


__all__ = [
    "GPTBlock",
    "GPTConfig",
    "GPTLoss",
    "PositionEmbedding",
    "TokenEmbedding",
    "gpt_layer_descs",
    "tied_logits",
]
