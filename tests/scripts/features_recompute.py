"""Fixture for tests/test_recompute.py: a Megatron MLP block with dropout inside the
tensor-parallel region (on the sharded hidden features, under ``get_rng_state_tracker()``) and
dropout on the replicated output (global generator), at mp2. The same block is run plainly and
through ``fleet.utils.recompute`` from the same RNG states: outputs and every gradient must be
bitwise equal, and the tracker must end where the plain run left it. For contrast, torch's
checkpoint without the tracker replay gives different gradients. Also the saved-tensor bytes of
both runs. Writes ``<out>/rank<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fleet
from fleet.meta_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    get_rng_state_tracker,
    model_parallel_random_seed,
)
from fleet.meta_parallel.recompute import SavedTensorBytes

IN, HIDDEN, BATCH = 16, 64, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(IN, HIDDEN, gather_output=False)
        self.fc2 = RowParallelLinear(HIDDEN, IN, input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        with get_rng_state_tracker().rng_state():
            h = F.dropout(h, 0.3)  # different mask per mp rank
        return x + F.dropout(self.fc2(h), 0.2)  # same mask on every mp rank


def run(block: Block, mode: str) -> dict:
    model_parallel_random_seed(1234)
    x = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(9), requires_grad=True)
    block.zero_grad()
    with SavedTensorBytes() as saved:
        if mode == "plain":
            y = block(x)
        elif mode == "recompute":
            y = fleet.utils.recompute(block, x)
        else:  # torch checkpoint, no tracker replay
            y = checkpoint(block, x, use_reentrant=False)
    w = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(10))
    (y * w).sum().backward()
    return {
        "y": y.detach(),
        "grads": [x.grad.clone()] + [p.grad.clone() for p in block.parameters()],
        "tracker": get_rng_state_tracker().get_states_tracker(),
        "after": torch.rand(4),  # the global stream continues identically
        "saved_bytes": saved.bytes,
    }


def same(a: dict, b: dict) -> bool:
    return torch.equal(a["y"], b["y"]) and all(
        torch.equal(g, h) for g, h in zip(a["grads"], b["grads"])
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mp", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"mp_degree": args.mp}
    fleet.init(is_collective=True, strategy=strategy)
    rank = fleet.worker_index()
    torch.manual_seed(3)
    block = Block()
    plain, recomputed, unreplayed = (
        run(block, "plain"),
        run(block, "recompute"),
        run(block, "torch"),
    )
    rec = {
        "rank": rank,
        "recompute_equal": same(plain, recomputed),
        "tracker_equal": all(
            torch.equal(plain["tracker"][k], recomputed["tracker"][k]) for k in plain["tracker"]
        ),
        "global_equal": torch.equal(plain["after"], recomputed["after"]),
        "torch_checkpoint_equal": same(plain, unreplayed),
        "saved_bytes": {"plain": plain["saved_bytes"], "recompute": recomputed["saved_bytes"]},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    tdist.barrier()


if __name__ == "__main__":
    main()
