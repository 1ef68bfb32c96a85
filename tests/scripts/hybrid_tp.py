"""Fixture for tests/test_tensor_parallel.py: ``fleet.init`` with ``mp_degree``/``dp_degree``,
then every tensor-parallel layer against its single-device twin (outputs and all gradients),
the RNG tracker, the hybrid groups and ``distributed_model``; writes ``<out>/rank<N>.json``.

Every rank feeds the same inputs (seeded generators); the dense reference runs on every rank.
Errors are max absolute differences (float32).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

import fleet
from collective.errors import ConfigError
from fleet.meta_parallel import (
    ColumnParallelLinear,
    ParallelCrossEntropy,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rng_state_tracker,
    model_parallel_random_seed,
)

IN, HIDDEN, OUT, VOCAB, BATCH = 8, 12, 6, 16, 5


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(tdist.get_world_size(group))]
    tdist.all_gather(parts, t.contiguous(), group=group)
    return parts


def rows(mp_rank: int, total: int, mp: int) -> slice:
    n = total // mp
    return slice(mp_rank * n, (mp_rank + 1) * n)


def check_layers(mp_rank: int, mp: int) -> dict[str, float]:
    """Forward and every gradient of each TP layer vs. the dense layer."""
    errs: dict[str, float] = {}
    x0 = torch.randn(BATCH, IN, generator=gen(1))

    # ColumnParallelLinear, gathered output
    torch.manual_seed(11)
    dense = nn.Linear(IN, HIDDEN)
    col = ColumnParallelLinear.from_dense(dense, gather_output=True)
    w_out = torch.randn(BATCH, HIDDEN, generator=gen(2))
    xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    ya, yb = col(xa), dense(xb)
    (ya * w_out).sum().backward()
    (yb * w_out).sum().backward()
    r = rows(mp_rank, HIDDEN, mp)
    errs["column.out"] = err(ya, yb)
    errs["column.grad_x"] = err(xa.grad, xb.grad)
    errs["column.grad_w"] = err(col.weight.grad, dense.weight.grad[r])
    errs["column.grad_b"] = err(col.bias.grad, dense.bias.grad[r])

    # RowParallelLinear on the full input (it slices)
    torch.manual_seed(12)
    dense = nn.Linear(IN, OUT)
    row = RowParallelLinear.from_dense(dense, input_is_parallel=False)
    w_out = torch.randn(BATCH, OUT, generator=gen(3))
    xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    ya, yb = row(xa), dense(xb)
    (ya * w_out).sum().backward()
    (yb * w_out).sum().backward()
    c = rows(mp_rank, IN, mp)
    errs["row.out"] = err(ya, yb)
    errs["row.grad_x"] = err(xa.grad, xb.grad)
    errs["row.grad_w"] = err(row.weight.grad, dense.weight.grad[:, c])
    errs["row.grad_b"] = err(row.bias.grad, dense.bias.grad)

    # Megatron MLP: Column(gather_output=False) -> GELU -> Row(input_is_parallel=True)
    torch.manual_seed(13)
    d1, d2 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
    c1 = ColumnParallelLinear.from_dense(d1, gather_output=False)
    r2 = RowParallelLinear.from_dense(d2, input_is_parallel=True)
    xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    ya, yb = r2(F.gelu(c1(xa))), d2(F.gelu(d1(xb)))
    (ya * w_out).sum().backward()
    (yb * w_out).sum().backward()
    errs["mlp.out"] = err(ya, yb)
    errs["mlp.grad_x"] = err(xa.grad, xb.grad)
    errs["mlp.grad_w1"] = err(c1.weight.grad, d1.weight.grad[r])
    errs["mlp.grad_b1"] = err(c1.bias.grad, d1.bias.grad[r])
    errs["mlp.grad_w2"] = err(r2.weight.grad, d2.weight.grad[:, r])
    errs["mlp.grad_b2"] = err(r2.bias.grad, d2.bias.grad)

    # VocabParallelEmbedding: ids from every rank's range
    torch.manual_seed(14)
    demb = nn.Embedding(VOCAB, OUT)
    vemb = VocabParallelEmbedding.from_dense(demb)
    ids = torch.randint(0, VOCAB, (BATCH, 7), generator=gen(4))
    w_emb = torch.randn(BATCH, 7, OUT, generator=gen(5))
    ya, yb = vemb(ids), demb(ids)
    (ya * w_emb).sum().backward()
    (yb * w_emb).sum().backward()
    errs["embedding.out"] = err(ya, yb)
    errs["embedding.grad_w"] = err(vemb.weight.grad, demb.weight.grad[rows(mp_rank, VOCAB, mp)])

    # ParallelCrossEntropy on vocab-sharded logits (one ignored label)
    logits = torch.randn(BATCH, VOCAB, generator=gen(6)) * 3
    label = torch.randint(0, VOCAB, (BATCH,), generator=gen(7))
    label[1] = -100
    v = rows(mp_rank, VOCAB, mp)
    la = logits[:, v].clone().requires_grad_()
    lb = logits.clone().requires_grad_()
    w_loss = torch.rand(BATCH, generator=gen(8))
    loss_a = ParallelCrossEntropy()(la, label)
    loss_b = F.cross_entropy(lb, label, reduction="none")
    (loss_a * w_loss).sum().backward()
    (loss_b * w_loss).sum().backward()
    errs["cross_entropy.loss"] = err(loss_a, loss_b)
    errs["cross_entropy.grad_logits"] = err(la.grad, lb.grad[:, v])

    # LM head: Column(gather_output=False) -> ParallelCrossEntropy vs Linear -> F.cross_entropy
    torch.manual_seed(15)
    dense = nn.Linear(IN, VOCAB)
    head = ColumnParallelLinear.from_dense(dense, gather_output=False)
    xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    loss_a = ParallelCrossEntropy()(head(xa), label).mean()
    loss_b = F.cross_entropy(dense(xb), label, reduction="none").mean()
    loss_a.backward()
    loss_b.backward()
    errs["lm_head.loss"] = err(loss_a, loss_b)
    errs["lm_head.grad_x"] = err(xa.grad, xb.grad)
    errs["lm_head.grad_w"] = err(head.weight.grad, dense.weight.grad[v])
    errs["lm_head.grad_b"] = err(head.bias.grad, dense.bias.grad[v])

    # a fresh layer holds the slice of the dense layer drawn from the same seed
    torch.manual_seed(16)
    fresh = ColumnParallelLinear(IN, HIDDEN)
    torch.manual_seed(16)
    errs["fresh_init.column"] = err(fresh.weight, nn.Linear(IN, HIDDEN).weight[r])
    return errs


def check_rng(hcg) -> dict[str, bool]:
    """Global dropout identical over the mp group, tracked dropout different; the global stream
    is not disturbed by a tracked block."""
    mp_group = hcg.get_model_parallel_group()
    model_parallel_random_seed(100)
    ones = torch.ones(256)
    global_mask = F.dropout(ones, 0.5)
    with get_rng_state_tracker().rng_state():
        local_mask = F.dropout(ones, 0.5)
    after = torch.rand(8)
    torch.manual_seed(100)
    F.dropout(ones, 0.5)
    undisturbed = torch.equal(torch.rand(8), after)
    g, loc = gather(global_mask, mp_group), gather(local_mask, mp_group)
    return {
        "global_same_over_mp": all(torch.equal(t, g[0]) for t in g),
        "tracked_differs_over_mp": all(
            not torch.equal(loc[i], loc[j]) for i in range(len(loc)) for j in range(i)
        ),
        "tracked_differs_from_global": not torch.equal(local_mask, global_mask),
        "global_stream_undisturbed": undisturbed,
    }


def check_distributed_model(hcg, mp_rank: int, mp: int) -> dict:
    """One step of a TP MLP through fleet.distributed_model: the gradients of each shard equal
    the dense model's on the whole global batch (each dp replica sees its half)."""
    dp, dp_rank = hcg.get_data_parallel_world_size(), hcg.get_data_parallel_rank()
    torch.manual_seed(21)
    d1, d2 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
    model = nn.Sequential(
        ColumnParallelLinear.from_dense(d1, gather_output=False),
        nn.ReLU(),
        RowParallelLinear.from_dense(d2, input_is_parallel=True),
    )
    wrapped = fleet.distributed_model(model)
    x = torch.randn(4 * dp, IN, generator=gen(22))
    y = torch.randn(4 * dp, OUT, generator=gen(23))
    mine = slice(dp_rank * 4, (dp_rank + 1) * 4)
    F.mse_loss(wrapped(x[mine]), y[mine]).backward()
    F.mse_loss(d2(F.relu(d1(x))), y).backward()
    r = rows(mp_rank, HIDDEN, mp)
    errs = {
        "w1": err(model[0].weight.grad, d1.weight.grad[r]),
        "b1": err(model[0].bias.grad, d1.bias.grad[r]),
        "w2": err(model[2].weight.grad, d2.weight.grad[:, r]),
        "b2": err(model[2].bias.grad, d2.bias.grad),
    }
    return {
        "is_model": wrapped is model,
        "is_ddp": isinstance(wrapped, torch.nn.parallel.DistributedDataParallel),
        "errs": errs,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--mp", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "mp_degree": args.mp}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    rank, mp_rank = fleet.worker_index(), hcg.get_model_parallel_rank()
    rec: dict = {
        "rank": rank,
        "coord": {
            "data": hcg.get_data_parallel_rank(),
            "pipe": hcg.get_stage_id(),
            "sharding": hcg.get_sharding_parallel_rank(),
            "model": mp_rank,
        },
        "sizes": [
            hcg.get_data_parallel_world_size(),
            hcg.get_pipe_parallel_world_size(),
            hcg.get_sharding_parallel_world_size(),
            hcg.get_model_parallel_world_size(),
        ],
        "group_ranks": {
            a: hcg.get_group_ranks(a) for a in ("data", "pipe", "sharding", "model", "check")
        },
    }
    # the groups really connect those ranks: the sum of the global ranks over each group
    groups = {
        "data": hcg.get_data_parallel_group(),
        "pipe": hcg.get_pipe_parallel_group(),
        "sharding": hcg.get_sharding_parallel_group(),
        "model": hcg.get_model_parallel_group(),
        "check": hcg.get_check_parallel_group(),
    }
    sums = {}
    for axis, group in groups.items():
        t = torch.tensor([float(rank)])
        tdist.all_reduce(t, group=group)
        sums[axis] = int(t.item())
    rec["group_sums"] = sums

    rec["layer_errs"] = check_layers(mp_rank, args.mp)
    try:
        ColumnParallelLinear(IN, 7)
        rec["uneven"] = ""
    except ConfigError as e:
        rec["uneven"] = str(e)
    rec["rng"] = check_rng(hcg)
    rec["distributed_model"] = check_distributed_model(hcg, mp_rank, args.mp)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    tdist.barrier()


if __name__ == "__main__":
    main()
