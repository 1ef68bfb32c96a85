"""Fixture for tests/test_hybrid_checkpoint.py: save a hybrid checkpoint at one tensor-/pipeline-
parallel layout and load it at another (fleet.checkpoint re-slices the TP shards).

The model is a PipelineLayer (one stage at ``--pp 1``) with a tied weight and a Megatron MLP::

    0 tied Linear(H, H) -> 1 ColumnParallelLinear(H, 2H) -> 2 Tanh -> 3 RowParallelLinear(2H, H)
    -> 4 Tanh -> 5 the tied weight again (h @ W^T)

At ``--pp 2`` stage 0 runs entries 0-2 and stage 1 entries 3-5, so both stages hold the tied
weight. ``--dense`` (load, one process) builds the same model from plain ``nn.Linear`` layers.

``--mode save``: train ``--steps`` steps, ``fleet.save_checkpoint``, train ``CONTINUE`` more;
rank 0 writes ``saved.pt`` (full parameters and Adam state at the checkpoint, TP shards
concatenated along their split axis) and ``expected.pt`` (full parameters after the
continuation) into ``--out``.
``--mode load``: build the model from another seed, ``fleet.load_checkpoint``, compare with
``saved.pt``, train ``CONTINUE`` steps, compare with ``expected.pt``; every rank writes
``load_rank<N>.json``. The global batch is the same at every layout.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as tdist
from torch import nn

import fleet
from collective.errors import ConfigError
from fleet.base.runtime import get_runtime
from fleet.checkpoint import load_checkpoint, save_checkpoint
from fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear
from fleet.meta_parallel.pipeline_layer import LayerDesc, PipelineLayer, SharedLayerDesc

H, BATCH, CONTINUE = 8, 8, 1


def tied_head(linear: nn.Linear, h: torch.Tensor) -> torch.Tensor:
    return h @ linear.weight.t()


def build(dense: bool, hcg, h: int = H) -> PipelineLayer:
    # one process: no hybrid group to default to, the TP layers run on the world (of one)
    group = {"mp_group": tdist.group.WORLD} if hcg is None else {}
    col = (
        LayerDesc(nn.Linear, h, 2 * h)
        if dense
        else LayerDesc(ColumnParallelLinear, h, 2 * h, gather_output=False, **group)
    )
    row = (
        LayerDesc(nn.Linear, 2 * h, h)
        if dense
        else LayerDesc(RowParallelLinear, 2 * h, h, input_is_parallel=True, **group)
    )
    descs = [
        SharedLayerDesc("tied", nn.Linear, None, "weight", h, h),
        col,
        LayerDesc(nn.Tanh),
        row,
        LayerDesc(nn.Tanh),
        SharedLayerDesc("tied", nn.Linear, tied_head, "weight", h, h),
    ]
    if hcg is None:  # one process, every degree 1
        return PipelineLayer(descs, num_stages=1, stage_id=0, loss_fn=nn.MSELoss())
    return PipelineLayer(descs, topology=hcg.topology(), loss_fn=nn.MSELoss())


class _Single:
    """The hybrid group's queries for one process (fleet.init leaves no hcg then)."""

    def __getattr__(self, name: str):
        return lambda: 1 if name.endswith("world_size") else 0


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(BATCH, H, generator=g), torch.randn(BATCH, H, generator=g)


def train(model, opt, hcg, first: int, steps: int) -> None:
    sh = hcg.get_sharding_parallel_world_size()
    count = hcg.get_data_parallel_world_size() * sh
    idx = hcg.get_data_parallel_rank() * sh + hcg.get_sharding_parallel_rank()
    per = BATCH // count
    for step in range(first, first + steps):
        x, y = batch(step)
        xs, ys = x[idx * per : (idx + 1) * per], y[idx * per : (idx + 1) * per]
        if hcg.get_pipe_parallel_world_size() > 1:
            model.train_batch([xs, ys], opt)
        else:
            nn.functional.mse_loss(model(xs), ys).backward()
            opt.step()
            opt.zero_grad()


def full_state(model, opt, hcg) -> tuple[dict, dict]:
    """(parameters, Adam state) of the whole model, on every rank: every rank contributes what
    it holds; TP shards are concatenated in mp-rank order along their ``split_axis``."""
    module = model
    while hasattr(module, "module") or type(module).__name__ == "PipelineParallel":
        module = module.module if hasattr(module, "module") else module.layers
    mp_rank = hcg.get_model_parallel_rank()
    names = {id(p): n for n, p in module.named_parameters()}
    mine: dict = {}
    for n, p in module.named_parameters():
        mine[("param", n)] = (mp_rank, getattr(p, "split_axis", None), p.detach().clone())
    for p, st in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            if id(p) in names and key in st:
                mine[(key, names[id(p)])] = (
                    mp_rank,
                    getattr(p, "split_axis", None),
                    st[key].detach().clone(),
                )
    parts: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(parts, mine)
    shards: dict = {}
    for part in parts:
        for k, (r, axis, t) in part.items():
            # the lowest rank's copy: the first pipeline stage holding a shared layer
            shards.setdefault(k, {}).setdefault(r, (axis, t))
    params, state = {}, {}
    for (kind, n), by_rank in shards.items():
        axis = next(iter(by_rank.values()))[0]
        ts = [by_rank[r][1] for r in sorted(by_rank)]
        full = ts[0] if axis is None else torch.cat(ts, dim=axis)
        (params if kind == "param" else state)[f"{n}" if kind == "param" else f"{n}.{kind}"] = full
    return params, state


def max_err(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["save", "load"], required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sharding", type=int, default=1)
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "mp_degree": args.mp,
        "pp_degree": args.pp,
        "sharding_degree": args.sharding,
    }
    if args.sharding > 1:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": 1}
    if args.pp > 1:
        per = BATCH // args.sharding
        strategy.pipeline_configs = {"micro_batch_size": per // 2, "accumulate_steps": 2}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = get_runtime("test").hcg
    rank = fleet.worker_index()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(5 if args.mode == "save" else 999)  # load: not the checkpoint's values
    model = fleet.distributed_model(build(args.dense, hcg))
    hcg = hcg or _Single()
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))

    if args.mode == "save":
        train(model, opt, hcg, 0, args.steps)
        save_checkpoint(args.ckpt, model, opt)
        saved = full_state(model, opt, hcg)
        train(model, opt, hcg, args.steps, CONTINUE)
        expected = full_state(model, opt, hcg)[0]
        if rank == 0:
            torch.save(saved, os.path.join(args.out, "saved.pt"))
            torch.save(expected, os.path.join(args.out, "expected.pt"))
        return

    load_checkpoint(args.ckpt, model, opt)
    params, state = full_state(model, opt, hcg)
    saved_params, saved_state = torch.load(os.path.join(args.out, "saved.pt"))
    rec: dict = {
        "rank": rank,
        "names": sorted(params),
        "state_names": sorted(state),
        "param_err": max_err(params, saved_params),
        "state_err": max_err(state, saved_state),
    }
    train(model, opt, hcg, args.steps, CONTINUE)
    expected = torch.load(os.path.join(args.out, "expected.pt"))
    rec["continue_err"] = max_err(full_state(model, opt, hcg)[0], expected)
    if tdist.get_world_size() == 1:  # a model of other sizes is refused, naming the shapes
        try:
            load_checkpoint(args.ckpt, build(args.dense, None, 2 * H))
        except ConfigError as err:
            rec["wrong_shape"] = str(err)
    with open(os.path.join(args.out, f"load_rank{rank}.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
    if tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
