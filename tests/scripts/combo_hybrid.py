"""Fixture for tests/test_strategy_hybrid_combos.py: the hybrid combinations, each
trained through fleet.init / fleet.distributed_model / fleet.distributed_optimizer against a
single-process reference on the full batch; one job runs several cases (``fleet.init`` again
with the next strategy: same hybrid degrees, the process group stays up). Writes
``<out>/rank<N>.json``: ``{case: record}``.

``--layout tp`` (world 4, sharding 2 x mp 2, a tensor-parallel MLP): ``s3_clip`` stage 3 (FSDP2 over
the TP layers) with a global-norm clip, ``s1_clip`` / ``s2_clip`` stage 1/2 with the clip, ``o2_s1``
/ ``o2_s2`` / ``o2_s3`` AMP O2 bfloat16, ``fp16_s2`` / ``fp16_s3`` float16 loss scaling with
stage 2 / 3 and an overflow on one replica (the scaler not made distributed: sharding agrees on
inf/nan itself).
``--layout pp`` (world 4, pp 2 x sharding 2, a 2-stage PipelineLayer): ``s3`` stage 3 (FSDP2 over
each stage), ``s3_tied`` the same with an embedding tied between the first and the last stage, ``s1_clip`` stage 1 with the clip, ``fp16_s1`` float16 loss scaling with stage 1 and
an overflow on one replica, ``o2_s3`` AMP O2 with stage 3.

float32 cases must match to 1e-5; float16/bfloat16 ones to their precision (the test says).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

import fleet
from collective.errors import FleetNotImplementedError
from fleet.base.runtime import get_runtime
from fleet.checkpoint import load_checkpoint, save_checkpoint
from fleet.meta_optimizers.amp import GradScaler, MasterWeightOptimizer, autocast
from fleet.meta_optimizers.sharding import ShardedOptimizer
from fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear
from fleet.meta_parallel.pipeline_layer import LayerDesc, PipelineLayer, SharedLayerDesc
from fleet.strategy.configs import AmpConfig

IN, HIDDEN, OUT, STEPS, PER, VOCAB = 8, 16, 8, 3, 4, 12
CLIP = 0.05
FP16_AMP = {
    "dtype": "float16",
    "init_loss_scaling": 1024.0,
    "decr_ratio": 0.5,
    "decr_every_n_nan_or_inf": 1,
    "incr_every_n_steps": 2,
}
OVERFLOW_STEP = 1


def batch(
    step: int, size: int, overflow_rows: slice | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(size, IN, generator=g), torch.randn(size, OUT, generator=g)
    if overflow_rows is not None and step == OVERFLOW_STEP:
        y[overflow_rows] = 1e4  # float16 gradients of these rows overflow at scale 1024
    return x, y


def strategy_for(args: argparse.Namespace, case: str) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": args.mp, "pp_degree": args.pp, "sharding_degree": 2}
    s.sharding = True
    stage = int(re.search(r"s(\d)", case).group(1))  # type: ignore[union-attr]
    s.sharding_configs = {"stage": stage, "segment_broadcast_MB": 0.0005}
    if args.pp > 1:
        s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
    if case.startswith("o2"):
        s.amp = True
        s.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    if case.startswith("fp16"):
        s.amp = True
        s.amp_configs = dict(FP16_AMP)
    return s


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's value on this rank (FSDP2's DTensor gathered over the sharding mesh)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def make_optimizer(case: str, params: Any) -> torch.optim.Optimizer:
    if case.startswith("s") and "clip" not in case:
        opt = torch.optim.Adam(params, lr=1e-2)
    else:
        # momentum SGD: low-precision gradient errors stay lr-sized (Adam's sign-like update
        # of a near-zero gradient turns bfloat16 noise into lr-sized steps either way)
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if "clip" in case:
        opt.grad_clip = fleet.ClipGradByGlobalNorm(CLIP)
    return opt


def replica(hcg: Any) -> tuple[int, int]:
    """(index, count) of this rank among the data replicas (dp x sharding)."""
    sh = hcg.get_sharding_parallel_world_size()
    return (
        hcg.get_data_parallel_rank() * sh + hcg.get_sharding_parallel_rank(),
        hcg.get_data_parallel_world_size() * sh,
    )


def master_bytes(opt: Any) -> int:
    """float32 master-weight bytes this rank holds (AMP O2)."""
    inner: Any = opt
    while inner is not None and not isinstance(inner, MasterWeightOptimizer):
        inner = inner.__dict__.get("_inner")
    if inner is None:
        return 0
    return sum(m.numel() * 4 for m in inner._masters.values())


class Reference:
    """The dense model on one process, the full batch, torch's clip and the same scaler."""

    def __init__(self, case: str, model: nn.Module) -> None:
        self.case, self.model = case, model
        self.opt = make_optimizer(case, model.parameters())
        self.opt.grad_clip = None
        self.scaler = (
            GradScaler.from_config(AmpConfig(**FP16_AMP)) if case.startswith("fp16") else None
        )
        self.norms: list[float] = []
        self.skipped: list[bool] = []
        self.scales: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> None:
        self.opt.zero_grad()
        if self.scaler is not None:
            with autocast(AmpConfig(**FP16_AMP), "cpu"):
                out = self.model(x)
            self.scaler.scale(loss_fn(out.float(), y)).backward()
            self.scaler.unscale_(self.opt)
            self.skipped.append(bool(self.scaler.found_inf(self.opt)))
            self.scaler.step(self.opt)
            self.scaler.update()
            self.scales.append(self.scaler.get_scale())
            return
        loss_fn(self.model(x), y).backward()
        if "clip" in self.case:
            self.norms.append(float(nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)))
        self.opt.step()


def checkpoint_round_trip(path: str, model: Any, opt: Any, params: list[Any]) -> float:
    """Save, scramble, load: the largest parameter change (0.0 when the load restored all)."""
    save_checkpoint(path, model, opt)
    before = [local(p).clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.mul_(-3.0)
    load_checkpoint(path, model, opt)
    return max(float((local(p) - b).abs().max()) for p, b in zip(params, before))


def case_tp(args: argparse.Namespace, case: str) -> dict[str, Any]:
    hcg = get_runtime("test").hcg
    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    torch.manual_seed(3)
    dense = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    model = nn.Sequential(
        ColumnParallelLinear.from_dense(dense[0], gather_output=False),
        nn.Tanh(),
        RowParallelLinear.from_dense(dense[2], input_is_parallel=True),
    )
    ref = Reference(case, dense)
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(make_optimizer(case, model.parameters()))
    scaler = GradScaler.from_config(AmpConfig(**FP16_AMP)) if case.startswith("fp16") else None
    idx, count = replica(hcg)
    rows = slice(idx * PER, (idx + 1) * PER)
    overflow = slice(PER, 2 * PER) if scaler is not None else None  # replica 1's rows
    rec: dict[str, Any] = {
        "model_type": type(model).__name__,
        "norms": [],
        "skipped": [],
        "scales": [],
    }
    for step in range(STEPS):
        x, y = batch(step, PER * count, overflow)
        out = model(x[rows])
        rec["out_dtype"] = str(out.dtype)
        loss = nn.functional.mse_loss(out.float(), y[rows])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            rec["skipped"].append(bool(scaler.found_inf(opt)))
            scaler.step(opt)
            scaler.update()
            rec["scales"].append(scaler.get_scale())
        else:
            loss.backward()
            opt.step()
        clip = getattr(opt, "grad_clip", None)
        if clip is not None and clip.last_norm is not None:
            rec["norms"].append(float(clip.last_norm))
        opt.zero_grad()
        ref.step(x, y, nn.functional.mse_loss)
    rec["ref_norms"], rec["ref_skipped"], rec["ref_scales"] = ref.norms, ref.skipped, ref.scales
    module = model.module if hasattr(model, "module") else model
    if args.ckpt and case == "s3_clip":
        try:
            rec["ckpt_err"] = checkpoint_round_trip(
                os.path.join(args.out, "ckpt_tp"), model, opt, list(module.parameters())
            )
        except FleetNotImplementedError as e:
            rec["ckpt_err"] = f"{type(e).__name__}: {e}"[:300]
    h = HIDDEN // mp
    sl = slice(mp_rank * h, (mp_rank + 1) * h)
    pairs = {
        "col.w": (module[0].weight, dense[0].weight[sl]),
        "col.b": (module[0].bias, dense[0].bias[sl]),
        "row.w": (module[2].weight, dense[2].weight[:, sl]),
        "row.b": (module[2].bias, dense[2].bias),
    }
    rec["errs"] = {
        k: float((local(p).float() - r.detach()).abs().max()) for k, (p, r) in pairs.items()
    }
    rec["param_dtype"] = str(module[0].weight.dtype)
    inner = getattr(opt, "inner_optimizer", opt)
    if isinstance(inner, ShardedOptimizer):
        # AMP O2: the float32 masters of the owned parameters, compared with the reference
        owned = {id(p) for p in inner.owned_params()}
        mw: Any = inner.inner_optimizer
        masters = mw._masters if isinstance(mw, MasterWeightOptimizer) else {}
        rec["master_errs"] = {
            k: float((masters[id(p)] - r.detach()).abs().max())
            for k, (p, r) in pairs.items()
            if id(p) in masters
        }
        rec["masters_only_owned"] = set(masters) <= owned
    rec["master_bytes"] = master_bytes(opt)
    rec["local_param_bytes"] = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in module.parameters()
    )
    rec["dense_param_bytes"] = sum(p.numel() * 4 for p in dense.parameters())
    return rec


def unembed(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t()


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def pp_model(case: str) -> tuple[list[Any], Any]:
    if case == "s3_tied":  # a tied embedding on the first and the last stage
        return [
            SharedLayerDesc("embed", nn.Embedding, None, "weight", VOCAB, HIDDEN),
            LayerDesc(nn.Linear, HIDDEN, HIDDEN),
            LayerDesc(nn.Tanh),
            LayerDesc(nn.Linear, HIDDEN, HIDDEN),
            LayerDesc(nn.Tanh),
            SharedLayerDesc("embed", nn.Embedding, unembed, "weight", VOCAB, HIDDEN),
        ], token_loss
    return [
        LayerDesc(nn.Linear, IN, HIDDEN),
        LayerDesc(nn.Tanh),
        LayerDesc(nn.Linear, HIDDEN, HIDDEN),
        LayerDesc(nn.Tanh),
        LayerDesc(nn.Linear, HIDDEN, HIDDEN),
        LayerDesc(nn.Tanh),
        LayerDesc(nn.Linear, HIDDEN, OUT),
    ], nn.functional.mse_loss


def case_pp(args: argparse.Namespace, case: str) -> dict[str, Any]:
    hcg = get_runtime("test").hcg
    descs, loss_fn = pp_model(case)
    torch.manual_seed(7)
    dense = PipelineLayer(descs, num_stages=1, stage_id=0, loss_fn=loss_fn)
    pipe = PipelineLayer(descs, topology=hcg.topology(), loss_fn=loss_fn)
    pipe.load_state_dict({k: v for k, v in dense.state_dict().items() if k in pipe.state_dict()})
    names = dict(pipe.named_parameters())
    ref = Reference(case, dense)
    model = fleet.distributed_model(pipe)
    opt = fleet.distributed_optimizer(make_optimizer(case, model.parameters()))
    scaler = None
    if case.startswith("fp16"):
        scaler = fleet.distributed_scaler(GradScaler.from_config(AmpConfig(**FP16_AMP)))
    idx, count = replica(hcg)
    n = 2 * 2  # micro_batch_size * accumulate_steps
    rows = slice(idx * n, (idx + 1) * n)
    overflow = slice(n, 2 * n) if scaler is not None else None
    rec: dict[str, Any] = {
        "model_type": type(model).__name__,
        "norms": [],
        "scales": [],
        "stage_type": type(pipe).__name__,
    }
    for step in range(STEPS):
        x, y = batch(step, n * count, overflow)
        if case == "s3_tied":  # token ids and next-token labels
            x, y = (x.abs() * 7).long() % VOCAB, (y.abs() * 7).long() % VOCAB
        model.train_batch([x[rows], y[rows]], opt, scaler=scaler)
        if scaler is not None:
            rec["scales"].append(scaler.get_scale())
        clip = getattr(opt, "grad_clip", None)
        if clip is not None and clip.last_norm is not None:
            rec["norms"].append(float(clip.last_norm))
        ref.step(x, y, loss_fn)
    rec["ref_norms"], rec["ref_skipped"], rec["ref_scales"] = ref.norms, ref.skipped, ref.scales
    ref_state = dense.state_dict()
    if args.ckpt and case == "s3":
        rec["ckpt_err"] = checkpoint_round_trip(
            os.path.join(args.out, "ckpt_pp"), model, opt, list(pipe.parameters())
        )
    rec["errs"] = {
        k: float((local(p).float() - ref_state[k]).abs().max()) for k, p in pipe.named_parameters()
    }
    rec["names"] = sorted(names)
    rec["master_bytes"] = master_bytes(opt)
    rec["local_param_bytes"] = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in pipe.parameters()
    )
    rec["stage_param_bytes"] = sum(p.numel() * 4 for p in names.values())
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", choices=["tp", "pp"], required=True)
    ap.add_argument("--cases", required=True, help="comma-separated case names")
    ap.add_argument(
        "--ckpt",
        action="store_true",
        help="checkpoint round trip of the s3 cases (s3_clip: refused clearly)",
    )
    args = ap.parse_args()
    args.mp, args.pp = (2, 1) if args.layout == "tp" else (1, 2)
    recs: dict[str, Any] = {}
    for case in args.cases.split(","):
        fleet.init(is_collective=True, strategy=strategy_for(args, case))
        recs[case] = (case_tp if args.layout == "tp" else case_pp)(args, case)
    rank = fleet.worker_index()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(recs, f)


if __name__ == "__main__":
    main()
    # tear the process group down before interpreter exit (gloo + FSDP2 at exit: see
    # tests/scripts/compose_hybrid.py)
    if tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
