"""Train the tiny GPT under fleet with whatever hybrid parallelism the strategy asks for
(data x tensor x pipeline on CPU gloo or GPUs).

::

    fleetrun -c configs/gpt_hybrid.yaml                     # world 4: mp2 x pp2
    fleetrun --nproc_per_node 2 examples/gpt/train.py --strategy s.yaml
    python examples/gpt/train.py                            # one process

The model is always a :class:`fleet.PipelineLayer` (one stage when ``pp_degree == 1``) run by
:class:`fleet.meta_parallel.PipelineParallel` (from ``fleet.distributed_model`` when
``pp_degree > 1``), which micro-batches (``pipeline_configs``),
averages gradients over the data-parallel group and steps the optimizer. Every data-parallel
replica trains on ``micro_batch_size * accumulate_steps`` samples of the same global batch.
Rank 0 prints the loss; the last line is a JSON summary (first/last loss, degrees, time).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet
from examples.gpt.data import MarkovTokens
from examples.gpt.model import GPTConfig, GPTLoss, gpt_layer_descs
from fleet.base.runtime import get_runtime
from fleet.base.topology import HybridCommunicateGroup, build_topology
from fleet.meta_parallel import PipelineLayer, PipelineParallel


def parse_args() -> argparse.Namespace:
    """Command line of the example."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (train_batch calls)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=16)
    p.add_argument(
        "--strategy",
        default=None,
        help="DistributedStrategy YAML file (default: the job file's strategy, else the defaults)",
    )
    p.add_argument("--log_every", type=int, default=10, help="print the loss every N steps")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    strategy = fleet.DistributedStrategy.from_yaml(args.strategy) if args.strategy else None
    fleet.init(is_collective=True, strategy=strategy)
    runtime = get_runtime("train")
    strategy = runtime.strategy
    # fleet.init builds the hybrid groups when a tensor/pipeline/sharding degree is > 1; pure
    # data parallel gets none, but the engine needs the (trivial) pipe and data groups.
    hcg = runtime.hcg or HybridCommunicateGroup(
        build_topology(strategy.hybrid_configs, tdist.get_world_size())
    )
    cfg = GPTConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_layers=args.layers,
        max_seq_len=args.seq_len,
    )
    mp_group = hcg.get_model_parallel_group()
    torch.manual_seed(1234)  # the same on every rank: TP shards and replicas start consistent
    pipe = PipelineLayer(
        gpt_layer_descs(cfg, mp_group),
        topology=hcg.topology(),
        loss_fn=GPTLoss(mp_group),
        seg_method="layer:GPTBlock",
        recompute_interval=1 if strategy.recompute else 0,
    )
    # With pp_degree > 1, fleet.distributed_model (fleet.parallelize) returns the
    # PipelineParallel engine; with one stage it would wrap DDP, so build the engine directly
    # (it micro-batches and averages gradients over the data-parallel group all the same).
    if hcg.get_pipe_parallel_world_size() > 1:
        model = fleet.distributed_model(pipe)
    else:
        model = PipelineParallel(pipe, hcg, strategy)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    pc = strategy.pipeline_configs
    local_batch = pc.micro_batch_size * pc.accumulate_steps
    data = MarkovTokens(cfg.vocab_size, args.seq_len)
    dp, dp_rank = hcg.get_data_parallel_world_size(), hcg.get_data_parallel_rank()
    rank = tdist.get_rank()
    if rank == 0:
        print(
            f"GPT {cfg}; dp={dp} mp={hcg.get_model_parallel_world_size()} "
            f"pp={hcg.get_pipe_parallel_world_size()}; {local_batch} samples per replica "
            f"({pc.accumulate_steps} x {pc.micro_batch_size}, {pc.schedule_mode})",
            flush=True,
        )
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = data.shard(step, local_batch, dp_rank, dp)
        loss = model.train_batch([x, y], opt, sched)
        fleet.report(loss=loss)  # the dashboard's loss curve (no-op without metrics)
        if dp > 1:  # report the mean over replicas
            tdist.all_reduce(loss, group=hcg.get_data_parallel_group())
            loss /= dp
        losses.append(float(loss))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        print(
            json.dumps(
                {
                    "first_loss": losses[0],
                    "last_loss": losses[-1],
                    "steps": args.steps,
                    "dp": dp,
                    "mp": hcg.get_model_parallel_world_size(),
                    "pp": hcg.get_pipe_parallel_world_size(),
                    "seconds": round(elapsed, 2),
                }
            ),
            flush=True,
        )
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
