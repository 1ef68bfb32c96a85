"""Fixture for tests/test_hybrid_compose.py: hybrid layouts through fleet.distributed_model /
fleet.distributed_optimizer (one fleet.parallelize), each against single-process training on
the full batch; writes ``<out>/rank<N>.json``.

``--case tp``: a tensor-parallel MLP (ColumnParallelLinear -> Tanh -> RowParallelLinear) at
``dp x sharding x mp``; every rank compares its shard with the slice of the dense reference,
then saves a hybrid checkpoint, scrambles its parameters and loads it back.
``--case pp``: a 2-stage PipelineLayer at ``pp x sharding`` (stage from ``--stage``), trained
with ``train_batch``; every stage compares its parameters with the reference's.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

import fleet
from fleet.base.runtime import get_runtime
from fleet.checkpoint import load_checkpoint, save_checkpoint
from fleet.meta_optimizers.sharding import ShardedOptimizer
from fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear
from fleet.meta_parallel.pipeline_layer import LayerDesc, PipelineLayer

IN, HIDDEN, OUT, STEPS = 8, 16, 4, 3


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(size, IN, generator=g)
    return x, torch.randn(size, OUT, generator=g)


def replica_index(hcg) -> tuple[int, int]:
    """(index, count) of this rank among the ranks that hold the same model shard."""
    dp, sh = hcg.get_data_parallel_world_size(), hcg.get_sharding_parallel_world_size()
    return hcg.get_data_parallel_rank() * sh + hcg.get_sharding_parallel_rank(), dp * sh


def case_tp(hcg, rec: dict, ckpt: str) -> None:
    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    torch.manual_seed(3)
    dense = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    model = nn.Sequential(
        ColumnParallelLinear.from_dense(dense[0], gather_output=False),
        nn.Tanh(),
        RowParallelLinear.from_dense(dense[2], input_is_parallel=True),
    )
    ref_opt = torch.optim.Adam(dense.parameters(), lr=1e-2)
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    rec["model_type"] = type(model).__name__
    rec["sharded"] = isinstance(opt.inner_optimizer, ShardedOptimizer)
    idx, count = replica_index(hcg)
    per = 4
    for step in range(STEPS):
        x, y = batch(step, per * count)
        xs, ys = x[idx * per : (idx + 1) * per], y[idx * per : (idx + 1) * per]
        nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        nn.functional.mse_loss(dense(x), y).backward()
        ref_opt.step()
    module = model.module if hasattr(model, "module") else model
    h = HIDDEN // mp
    rows = slice(mp_rank * h, (mp_rank + 1) * h)
    errs = {
        "col.w": module[0].weight - dense[0].weight[rows],
        "col.b": module[0].bias - dense[0].bias[rows],
        "row.w": module[2].weight - dense[2].weight[:, rows],
        "row.b": module[2].bias - dense[2].bias,
    }
    rec["errs"] = {k: float(v.detach().abs().max()) for k, v in errs.items()}
    # Checkpoint round trip at the same layout (each mp rank saves and loads its own shard).
    save_checkpoint(ckpt, model, opt)
    before = [p.detach().clone() for p in module.parameters()]
    state_before = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(-3.0)
    for st in opt.state.values():
        for v in st.values():
            v.mul_(-3.0) if isinstance(v, torch.Tensor) else None
    load_checkpoint(ckpt, model, opt)
    rec["ckpt_param_err"] = max(
        float((p.detach() - b).abs().max()) for p, b in zip(module.parameters(), before)
    )
    after = opt.state[opt.param_groups[0]["params"][0]]
    rec["ckpt_state_err"] = max(float((after[k] - v).abs().max()) for k, v in state_before.items())


def case_pp(hcg, rec: dict, args) -> None:
    descs = [
        LayerDesc(nn.Linear, IN, HIDDEN),
        LayerDesc(nn.Tanh),
        LayerDesc(nn.Linear, HIDDEN, HIDDEN),
        LayerDesc(nn.Tanh),
        LayerDesc(nn.Linear, HIDDEN, HIDDEN),
        LayerDesc(nn.Tanh),
        LayerDesc(nn.Linear, HIDDEN, OUT),
    ]
    torch.manual_seed(7)
    ref = PipelineLayer(descs, num_stages=1, stage_id=0, loss_fn=nn.MSELoss())
    pipe = PipelineLayer(descs, topology=hcg.topology(), loss_fn=nn.MSELoss())
    pipe.load_state_dict({k: v for k, v in ref.state_dict().items() if k in pipe.state_dict()})
    model = fleet.distributed_model(pipe)
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    rec["model_type"] = type(model).__name__
    rec["sharded"] = isinstance(opt.inner_optimizer, ShardedOptimizer)
    idx, count = replica_index(hcg)
    local = 2 * 2  # micro_batch_size * accumulate_steps
    for step in range(STEPS):
        x, y = batch(step, local * count)
        model.train_batch(
            [x[idx * local : (idx + 1) * local], y[idx * local : (idx + 1) * local]], opt
        )
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    ref_state = ref.state_dict()
    rec["names"] = sorted(pipe.state_dict())
    rec["errs"] = {k: float((v - ref_state[k]).abs().max()) for k, v in pipe.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", choices=["tp", "pp"], required=True)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--mp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sharding", type=int, default=1)
    ap.add_argument("--stage", type=int, default=1)
    args = ap.parse_args()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": args.dp,
        "mp_degree": args.mp,
        "pp_degree": args.pp,
        "sharding_degree": args.sharding,
    }
    if args.sharding > 1:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": args.stage}
    if args.pp > 1:
        strategy.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = get_runtime("test").hcg
    rec: dict = {
        "rank": fleet.worker_index(),
        "coord": hcg.topology().get_coord(fleet.worker_index()),
    }
    if args.case == "tp":
        case_tp(hcg, rec, os.path.join(args.out, "ckpt"))
    else:
        case_pp(hcg, rec, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{fleet.worker_index()}.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
    # tear the process group down before interpreter exit: left to the destructors, gloo + FSDP2
    # sometimes abort at exit ("terminate called without an active exception"), seen once in CI
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
