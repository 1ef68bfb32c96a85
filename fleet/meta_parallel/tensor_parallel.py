"""Tensor-parallel (Megatron-style) layers over the model-parallel group, Paddle's
``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` and
``ParallelCrossEntropy``.

Shard layout (torch weight layout ``[out, in]``; ``mp`` ranks, this rank ``r``):

* :class:`ColumnParallelLinear` holds output rows ``r*out/mp .. (r+1)*out/mp`` of the weight and
  the same slice of the bias; its output is that slice of the features (all of them when
  ``gather_output``).
* :class:`RowParallelLinear` holds input columns ``r*in/mp .. (r+1)*in/mp`` of the weight and the
  whole bias (added once, after the all-reduce); its input is that slice of the features
  (``input_is_parallel``) or the whole input, which it slices.
* :class:`VocabParallelEmbedding` holds the contiguous vocabulary rows ``r*V/mp .. (r+1)*V/mp``.
* :class:`ParallelCrossEntropy` takes logits split like a ColumnParallelLinear output (vocabulary
  slice of rank ``r``) and the full labels.

Sizes must divide by ``mp`` (ConfigError naming them otherwise). A fresh layer draws the *full*
weight from torch's global generator exactly as the single-device layer would and keeps its
slice, so a TP model seeded like a dense one holds the same numbers; ``from_dense`` copies the
slice of an existing ``nn.Linear`` / ``nn.Embedding``.

The communication is four pairs of ``torch.autograd.Function`` (identity / all-reduce,
split / gather), as in Megatron-LM. torch's ``torch.distributed.nn.functional.all_reduce``
is not used because its backward all-reduces the gradient again; tensor parallelism needs the
conjugate (identity) because the loss after the reduction is replicated, not summed, over ranks.
DTensor's ``parallelize_module`` is not used because the Paddle API (and its classmethod-free
construction inside a model's ``__init__``) wants layers that own their shard.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from collective.errors import ConfigError
from fleet.base.runtime import get_hybrid_communicate_group


def _default_mp_group(mp_group: Any) -> Any:
    if mp_group is not None:
        return mp_group
    return get_hybrid_communicate_group().get_model_parallel_group()


def _shard_size(total: int, world: int, what: str) -> int:
    if total % world:
        raise ConfigError(
            f"{what}={total} does not divide by the model-parallel degree {world}; choose a "
            f"multiple of {world} (e.g. {math.ceil(total / world) * world})",
            key=what,
        )
    return total // world


# ---- communication with autograd ---------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    if tdist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    tdist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = tdist.get_world_size(group)
    if world == 1:
        return x
    size = _shard_size(x.shape[-1], world, "last dimension")
    return x.narrow(-1, tdist.get_rank(group) * size, size).contiguous()


def _gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = tdist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    tdist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _CopyToModelParallel(torch.autograd.Function):
    """Forward identity; backward all-reduce (the input feeds every rank's shard)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromModelParallel(torch.autograd.Function):
    """Forward all-reduce (sum of partial results); backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToModelParallel(torch.autograd.Function):
    """Forward keep this rank's slice of the last dim; backward gather the slices."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _GatherFromModelParallel(torch.autograd.Function):
    """Forward gather the last-dim slices of every rank; backward keep this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


# ---- layers --------------------------------------------------------------------------------------


class _ParallelLayer(nn.Module):
    def __init__(self, mp_group: Any) -> None:
        super().__init__()
        self.mp_group = _default_mp_group(mp_group)
        self.mp_rank = tdist.get_rank(self.mp_group)
        self.mp_degree = tdist.get_world_size(self.mp_group)


def _mark_distributed(layer: _ParallelLayer, axis: int, *params: nn.Parameter | None) -> None:
    """Paddle's ``param.is_distributed``: this tensor is one mp rank's shard (global-norm
    clipping, fleet.meta_optimizers.clip, sums it over the model-parallel group; replicated ones count once),
    and Paddle's ``param.split_axis``: the dimension the full tensor is split along, in mp-rank
    order (fleet.checkpoint re-slices shards with it when the mp degree changes)."""
    for p in params:
        if p is not None and layer.mp_degree > 1:
            p.is_distributed = True  # shadows torch's Tensor.is_distributed() on this instance
            p.split_axis = axis


def _keep_global_rng() -> Any:
    """``from_dense`` overwrites the fresh layer's init: do not let it advance the global RNG."""
    return torch.random.fork_rng(devices=[])


def _dense_linear_init(out_features: int, in_features: int, bias: bool) -> nn.Linear:
    """A full nn.Linear drawn from the global generator (what the dense model would hold)."""
    return nn.Linear(in_features, out_features, bias=bias)


class ColumnParallelLinear(_ParallelLayer):
    """``y = x W^T + b`` with ``W``'s output rows split over the model-parallel ranks.

    ``gather_output``: return all ``out_features`` (all-gather); False returns this rank's slice,
    to feed a :class:`RowParallelLinear` with ``input_is_parallel=True`` or a
    :class:`ParallelCrossEntropy`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        mp_group: Any = None,
    ) -> None:
        super().__init__(mp_group)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _shard_size(out_features, self.mp_degree, "out_features")
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank)) if bias else None
        _mark_distributed(self, 0, self.weight, self.bias)
        self._load_dense(_dense_linear_init(out_features, in_features, bias))

    @classmethod
    def from_dense(
        cls, linear: nn.Linear, gather_output: bool = True, mp_group: Any = None
    ) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (same dtype)."""
        with _keep_global_rng():
            layer = cls(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                gather_output,
                mp_group,
            ).to(linear.weight.dtype)
        layer._load_dense(linear)
        return layer

    @torch.no_grad()
    def _load_dense(self, linear: nn.Linear) -> None:
        rows = slice(self.mp_rank * self.out_per_rank, (self.mp_rank + 1) * self.out_per_rank)
        self.weight.copy_(linear.weight[rows])
        if self.bias is not None:
            self.bias.copy_(linear.bias[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(_CopyToModelParallel.apply(x, self.mp_group), self.weight, self.bias)
        return _GatherFromModelParallel.apply(y, self.mp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_per_rank} on mp rank {self.mp_rank}), gather_output={self.gather_output}"
        )


class RowParallelLinear(_ParallelLayer):
    """``y = x W^T + b`` with ``W``'s input columns split over the model-parallel ranks; the
    partial products are all-reduced and the (replicated) bias added once.

    ``input_is_parallel``: the input is already this rank's slice of the features (the output
    of a ``ColumnParallelLinear(gather_output=False)``); False slices the full input here.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        mp_group: Any = None,
    ) -> None:
        super().__init__(mp_group)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _shard_size(in_features, self.mp_degree, "in_features")
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _mark_distributed(self, 1, self.weight)  # the bias is replicated
        self._load_dense(_dense_linear_init(out_features, in_features, bias))

    @classmethod
    def from_dense(
        cls, linear: nn.Linear, input_is_parallel: bool = False, mp_group: Any = None
    ) -> RowParallelLinear:
        """This rank's shard of ``linear`` (same dtype)."""
        with _keep_global_rng():
            layer = cls(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                input_is_parallel,
                mp_group,
            ).to(linear.weight.dtype)
        layer._load_dense(linear)
        return layer

    @torch.no_grad()
    def _load_dense(self, linear: nn.Linear) -> None:
        cols = slice(self.mp_rank * self.in_per_rank, (self.mp_rank + 1) * self.in_per_rank)
        self.weight.copy_(linear.weight[:, cols])
        if self.bias is not None:
            self.bias.copy_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = _ScatterToModelParallel.apply(x, self.mp_group)
        y = _ReduceFromModelParallel.apply(F.linear(x, self.weight), self.mp_group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_per_rank} on mp rank {self.mp_rank}), "
            f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(_ParallelLayer):
    """``nn.Embedding`` with the vocabulary rows split over the model-parallel ranks: each rank
    looks up the ids in its range (zeros elsewhere) and the results are all-reduced."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mp_group: Any = None) -> None:
        super().__init__(mp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_per_rank = _shard_size(num_embeddings, self.mp_degree, "num_embeddings")
        self.vocab_start = self.mp_rank * self.vocab_per_rank
        self.vocab_end = self.vocab_start + self.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, embedding_dim))
        _mark_distributed(self, 0, self.weight)
        self._load_dense(nn.Embedding(num_embeddings, embedding_dim))

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, mp_group: Any = None) -> VocabParallelEmbedding:
        """This rank's vocabulary rows of ``embedding`` (same dtype; padding_idx is not kept)."""
        with _keep_global_rng():
            layer = cls(embedding.num_embeddings, embedding.embedding_dim, mp_group).to(
                embedding.weight.dtype
            )
        layer._load_dense(embedding)
        return layer

    @torch.no_grad()
    def _load_dense(self, embedding: nn.Embedding) -> None:
        self.weight.copy_(embedding.weight[self.vocab_start : self.vocab_end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromModelParallel.apply(out, self.mp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}.."
            f"{self.vocab_end - 1} on mp rank {self.mp_rank})"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits whose vocabulary is split over ``group`` (Megatron-LM's)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, label: torch.Tensor, group: Any, ignore_index: int
    ) -> torch.Tensor:
        vocab_per_rank = logits.shape[-1]
        start = tdist.get_rank(group) * vocab_per_rank
        logits_max = logits.detach().amax(dim=-1)
        if tdist.get_world_size(group) > 1:
            tdist.all_reduce(logits_max, op=tdist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (label < start) | (label >= start + vocab_per_rank)
        local = (label - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        picked, sum_exp = _all_reduce(picked, group), _all_reduce(sum_exp, group)
        ignored = label == ignore_index
        loss = (sum_exp.log() - picked).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), outside | ignored, local, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, not_here, local, ignored = ctx.saved_tensors
        grad_logits = softmax.clone()
        onehot = (~not_here).to(softmax.dtype).unsqueeze(-1)
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -onehot)
        grad_logits *= grad.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad_logits, None, None, None


class ParallelCrossEntropy(nn.Module):
    """Per-sample cross entropy (``reduction='none'``) of vocabulary-parallel logits
    ``[..., V/mp]`` against full labels ``[...]``; labels equal to ``ignore_index`` give 0."""

    def __init__(self, mp_group: Any = None, ignore_index: int = -100) -> None:
        super().__init__()
        self.mp_group = _default_mp_group(mp_group)
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if label.shape != logits.shape[:-1]:
            raise ConfigError(
                f"labels of shape {tuple(label.shape)} do not match logits of shape "
                f"{tuple(logits.shape)}; expected labels {tuple(logits.shape[:-1])}",
                key="label",
            )
        return _VocabParallelCrossEntropy.apply(logits, label, self.mp_group, self.ignore_index)


__all__ = [
    "ColumnParallelLinear",
    "ParallelCrossEntropy",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]
