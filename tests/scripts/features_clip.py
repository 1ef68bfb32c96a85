"""Fixture for tests/test_clip.py: a tensor-parallel model (VocabParallelEmbedding ->
ColumnParallelLinear -> GELU -> RowParallelLinear -> LayerNorm, replicated LayerNorm and Row bias)
and its single-device twin get the same gradients; ``fleet.clip_grad_norm_`` on the shards must
return the norm ``torch.nn.utils.clip_grad_norm_`` returns on the dense model and leave every
shard equal to the slice of the clipped dense gradient. Also the optimizer hook
(``grad_clip = ClipGradByGlobalNorm``) through ``wrap_optimizer_features``, and for contrast what
plain ``clip_grad_norm_`` on the shards would report. Writes ``<out>/rank<N>.json``.
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
from fleet.meta_optimizers.clip import ClipGradByGlobalNorm, is_distributed
from fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fleet.parallelize.features import wrap_optimizer_features

VOCAB, DIM, HIDDEN, BATCH = 16, 8, 12, 6


def build(mp_rank: int, mp: int):
    torch.manual_seed(5)
    dense = nn.ModuleDict(
        {
            "emb": nn.Embedding(VOCAB, DIM),
            "fc1": nn.Linear(DIM, HIDDEN),
            "fc2": nn.Linear(HIDDEN, DIM),
            "norm": nn.LayerNorm(DIM),
        }
    )
    tp = nn.ModuleDict(
        {
            "emb": VocabParallelEmbedding.from_dense(dense["emb"]),
            "fc1": ColumnParallelLinear.from_dense(dense["fc1"], gather_output=False),
            "fc2": RowParallelLinear.from_dense(dense["fc2"], input_is_parallel=True),
            "norm": nn.LayerNorm(DIM),
        }
    )
    tp["norm"].load_state_dict(dense["norm"].state_dict())
    with torch.no_grad():  # a non-trivial LayerNorm
        dense["norm"].weight.uniform_(0.5, 1.5)
        tp["norm"].weight.copy_(dense["norm"].weight)
    v = slice(mp_rank * VOCAB // mp, (mp_rank + 1) * VOCAB // mp)
    h = slice(mp_rank * HIDDEN // mp, (mp_rank + 1) * HIDDEN // mp)
    # shard of each TP parameter as a function of the dense parameter
    slices = {
        "emb.weight": lambda t: t[v],
        "fc1.weight": lambda t: t[h],
        "fc1.bias": lambda t: t[h],
        "fc2.weight": lambda t: t[:, h],
        "fc2.bias": lambda t: t,
        "norm.weight": lambda t: t,
        "norm.bias": lambda t: t,
    }
    return dense, tp, slices


def forward(m: nn.ModuleDict, ids: torch.Tensor) -> torch.Tensor:
    return m["norm"](m["fc2"](F.gelu(m["fc1"](m["emb"](ids)))))


def backward_both(dense, tp, scale: float) -> None:
    ids = torch.randint(0, VOCAB, (BATCH, 3), generator=torch.Generator().manual_seed(6))
    w = torch.randn(BATCH, 3, DIM, generator=torch.Generator().manual_seed(7)) * scale
    (forward(dense, ids) * w).sum().backward()
    (forward(tp, ids) * w).sum().backward()


def grad_errs(dense, tp, slices) -> float:
    dp = dict(dense.named_parameters())
    return max(
        float((p.grad - slices[n](dp[n].grad)).abs().max()) for n, p in tp.named_parameters()
    )


def param_errs(dense, tp, slices) -> float:
    dp = dict(dense.named_parameters())
    return max(
        float((p.detach() - slices[n](dp[n].detach())).abs().max())
        for n, p in tp.named_parameters()
    )


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
    mp_rank, rank = hcg.get_model_parallel_rank(), fleet.worker_index()
    rec: dict = {"rank": rank, "cases": {}}

    for norm_type in (2.0, float("inf"), 1.0):
        dense, tp, slices = build(mp_rank, args.mp)
        backward_both(dense, tp, scale=3.0)
        # what torch's clip_grad_norm_ would see on this rank's shards alone
        naive = float(torch.nn.utils.get_total_norm([p.grad for p in tp.parameters()], norm_type))
        ref = float(torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5, norm_type))
        ours = float(fleet.clip_grad_norm_(tp.parameters(), 0.5, norm_type))
        rec["cases"][str(norm_type)] = {
            "ours": ours,
            "ref": ref,
            "naive": naive,
            "grad_err": grad_errs(dense, tp, slices),
        }

    # the optimizer hook: clipping before every SGD step, vs clip_grad_norm_ + SGD on dense
    dense, tp, slices = build(mp_rank, args.mp)
    opt = torch.optim.SGD(tp.parameters(), lr=0.1)
    opt.grad_clip = ClipGradByGlobalNorm(0.5)
    opt = wrap_optimizer_features(opt, strategy)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    norms = []
    for _ in range(3):
        backward_both(dense, tp, scale=3.0)
        norms.append(float(torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)))
        dense_opt.step()
        dense_opt.zero_grad()
        opt.step()
        norms.append(float(opt.grad_clip.last_norm))
        opt.zero_grad()
    rec["hook"] = {"param_err": param_errs(dense, tp, slices), "norms": norms}
    rec["is_distributed"] = {n: is_distributed(p) for n, p in tp.named_parameters()}

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    tdist.barrier()


if __name__ == "__main__":
    main()
