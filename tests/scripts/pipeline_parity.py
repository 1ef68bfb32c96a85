"""Fixture for tests/test_pipeline_parallel.py: ``fleet.init`` with ``pp_degree`` (and
``dp_degree`` / ``mp_degree``), then several pipeline scenarios against the non-pipelined model;
writes ``<out>/rank<N>.json``.

For every scenario the reference is the same layer list as a single-stage PipelineLayer (the
whole model on every rank, tied layers one module), trained on the *global* batch with the same
optimizer; the pipeline stage starts from the reference's weights (parameter names are the same)
and trains on this data-parallel rank's share. Recorded: the largest loss difference over the
steps and the largest parameter difference after them (float32, max abs).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

import fleet
from collective.errors import ConfigError
from fleet.base.runtime import get_runtime
from fleet.base.topology import HybridCommunicateGroup, build_topology
from fleet.meta_parallel import (
    ColumnParallelLinear,
    LayerDesc,
    PipelineLayer,
    PipelineParallel,
    RowParallelLinear,
    SharedLayerDesc,
)
from fleet.meta_parallel.pp_memory import SavedActivationMeter

VOCAB, HIDDEN, SEQ = 32, 16, 5


class Block(nn.Module):
    """A residual tanh block."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def unembed(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t()


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make_model(kind: str) -> tuple[list[Any], Any]:
    if kind == "mlp":
        return [
            LayerDesc(nn.Linear, 8, HIDDEN),
            LayerDesc(nn.Tanh),
            LayerDesc(nn.Linear, HIDDEN, HIDDEN),
            LayerDesc(nn.Tanh),
            double,
            LayerDesc(nn.Linear, HIDDEN, HIDDEN),
            nn.Tanh(),
            LayerDesc(nn.Linear, HIDDEN, 4),
        ], nn.MSELoss()
    if kind == "tied":
        return [
            SharedLayerDesc("embed", nn.Embedding, None, "weight", VOCAB, HIDDEN),
            LayerDesc(Block, HIDDEN),
            LayerDesc(Block, HIDDEN),
            LayerDesc(Block, HIDDEN),
            SharedLayerDesc("embed", nn.Embedding, unembed, "weight", VOCAB, HIDDEN),
        ], token_loss
    if kind == "tp":
        return [
            LayerDesc(nn.Linear, 8, HIDDEN),
            LayerDesc(ColumnParallelLinear, HIDDEN, 32, gather_output=False),
            LayerDesc(nn.GELU),
            LayerDesc(RowParallelLinear, 32, HIDDEN, input_is_parallel=True),
            LayerDesc(ColumnParallelLinear, HIDDEN, 32, gather_output=False),
            LayerDesc(nn.GELU),
            LayerDesc(RowParallelLinear, 32, HIDDEN, input_is_parallel=True),
            LayerDesc(nn.Linear, HIDDEN, 4),
        ], nn.MSELoss()
    raise ValueError(kind)


def make_batch(kind: str, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "tied":
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        return x, torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)


def strategy_for(mbs: int, acc: int, schedule: str) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.pipeline_configs = {
        "micro_batch_size": mbs,
        "accumulate_steps": acc,
        "schedule_mode": schedule,
    }
    return s


def parity(
    hcg: Any,
    kind: str,
    schedule: str,
    seg: str = "uniform",
    recompute: int = 0,
    mbs: int = 2,
    acc: int = 4,
    steps: int = 3,
) -> dict[str, Any]:
    """Train pipeline and reference side by side; the largest differences."""
    descs, loss_fn = make_model(kind)
    torch.manual_seed(7)
    ref = PipelineLayer(descs, num_stages=1, stage_id=0, loss_fn=loss_fn)
    pipe = PipelineLayer(
        descs,
        topology=hcg.topology(),
        loss_fn=loss_fn,
        seg_method=seg,
        recompute_interval=recompute,
    )
    ref_state = ref.state_dict()
    init = {k: v.clone() for k, v in ref_state.items()}
    pipe.load_state_dict({k: ref_state[k] for k in pipe.state_dict()})
    model = PipelineParallel(pipe, hcg, strategy_for(mbs, acc, schedule))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    dp, dp_rank = hcg.get_data_parallel_world_size(), hcg.get_data_parallel_rank()
    local = mbs * acc
    loss_err, losses = 0.0, []
    for step in range(steps):
        x, y = make_batch(kind, local * dp, step)
        xl, yl = (
            x[dp_rank * local : (dp_rank + 1) * local],
            y[dp_rank * local : (dp_rank + 1) * local],
        )
        loss = model.train_batch([xl, yl], opt, sched)
        with torch.no_grad():
            ref_local = loss_fn(ref(xl), yl)
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_opt.step()
        ref_sched.step()
        loss_err = max(loss_err, abs(float(loss) - float(ref_local)))
        losses.append(float(loss))
    ref_state = ref.state_dict()
    param_err = max(float((v - ref_state[k]).abs().max()) for k, v in pipe.state_dict().items())
    moved = max(float((v - init[k]).abs().max()) for k, v in ref_state.items())
    with torch.no_grad():
        ev = model.eval_batch(make_batch(kind, local, 99))
        ref_ev = loss_fn(ref(make_batch(kind, local, 99)[0]), make_batch(kind, local, 99)[1])
    with torch.no_grad():  # outputs instead of the loss: the last stage gets the logits
        xe = make_batch(kind, local, 99)[0]
        outs = model.eval_batch([xe, None], compute_loss=False)
        out_err = float((outs - ref(xe)).abs().max()) if outs is not None else 0.0
    return {
        "out_err": out_err,
        "has_out": outs is not None,
        "loss_err": loss_err,
        "param_err": param_err,
        "eval_err": abs(float(ev) - float(ref_ev)),
        "losses": losses,
        "moved": moved,
        "range": list(pipe.stage_layer_range()),
        "shared": sorted(pipe.shared_layers.keys()),
        "n_params": len(pipe.state_dict()),
    }


def memory(hcg: Any, schedule: str, acc: int) -> int:
    """Peak bytes of saved activations on this stage during one train_batch."""
    descs = (
        [LayerDesc(nn.Linear, 8, 64)]
        + [LayerDesc(Block, 64) for _ in range(6)]
        + [LayerDesc(nn.Linear, 64, 4)]
    )
    torch.manual_seed(3)
    pipe = PipelineLayer(descs, topology=hcg.topology(), loss_fn=nn.MSELoss())
    model = PipelineParallel(pipe, hcg, strategy_for(4, acc, schedule))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y = make_batch("mlp", 4 * acc, 0)
    with SavedActivationMeter(pipe.parameters()) as meter:
        model.train_batch([x, y], opt)
    return meter.peak_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--mp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--scenarios", default="mlp")
    args = ap.parse_args()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "mp_degree": args.mp, "pp_degree": args.pp}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = get_runtime("test").hcg
    if hcg is None:  # fleet.init builds the groups only for tensor parallelism so far
        hcg = HybridCommunicateGroup(
            build_topology(strategy.hybrid_configs, tdist.get_world_size())
        )
    rec: dict[str, Any] = {"rank": tdist.get_rank(), "stage": hcg.get_stage_id(), "runs": {}}
    for name in args.scenarios.split(","):
        if name == "badbatch":
            descs, loss_fn = make_model("mlp")
            pipe = PipelineLayer(descs, topology=hcg.topology(), loss_fn=loss_fn)
            model = PipelineParallel(pipe, hcg, strategy_for(2, 4, "1F1B"))
            try:
                model.train_batch(
                    list(make_batch("mlp", 6, 0)), torch.optim.SGD(pipe.parameters(), lr=0.1)
                )
                rec["badbatch"] = "no error"
            except ConfigError as exc:
                rec["badbatch"] = str(exc)
        elif name == "distmodel":  # fleet.distributed_model picks the pipeline engine
            descs, loss_fn = make_model("mlp")
            pipe = PipelineLayer(descs, topology=hcg.topology(), loss_fn=loss_fn)
            model = fleet.distributed_model(pipe)
            loss = model.train_batch(
                list(make_batch("mlp", 1, 0)), torch.optim.SGD(pipe.parameters(), lr=0.1)
            )
            rec["distmodel"] = [type(model).__name__, float(loss)]
        elif name == "memory":
            rec["memory"] = {
                f"{s}/{m}": memory(hcg, s, m) for s in ("1F1B", "FThenB") for m in (4, 16)
            }
        else:  # kind:schedule[:seg[:recompute]]
            kind, schedule, *rest = name.split(":")
            seg = {"regex": "layer:Block", "uniform": "uniform"}[rest[0]] if rest else "uniform"
            recompute = int(rest[1]) if len(rest) > 1 else 0
            rec["runs"][name] = parity(hcg, kind, schedule, seg, recompute)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rec['rank']}.json"), "w") as f:
        json.dump(rec, f)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
