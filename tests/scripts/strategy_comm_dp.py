"""Fixture of tests/test_strategy_comm.py: fp16/bf16 all-reduce, local SGD and adaptive local SGD
through fleet.distributed_model / distributed_optimizer, each against torch's own DDP hooks and
PostLocalSGDOptimizer on the same seed; collectives counted with CommCounter.

``--case fp16|localsgd|adaptive --out DIR`` writes ``DIR/rank<N>.json``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as tdist
from strategy_comm_common import (
    flat_params,
    global_batch,
    max_diff,
    mlp,
    my_slice,
    run_fixture,
    spread,
)
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    bf16_compress_hook,
    fp16_compress_hook,
)
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel

import fleet
from fleet.meta_optimizers.comm_hooks import CommCounter
from fleet.meta_optimizers.localsgd import next_k_steps

IN = 16


def make_model() -> torch.nn.Module:
    return mlp(IN, 32, 1)


def train(
    dp: Any, opt: Any, steps: int, rank: int, world: int, *, lr_at: Any = None, set_loss: Any = None
) -> dict[str, Any]:
    """``steps`` SGD steps on this rank's slice; per step: local loss, all-reduce calls and
    bytes (CommCounter), and the cross-rank spread of the parameters after the step."""
    out: dict[str, list[Any]] = {"loss": [], "allreduce": [], "bytes": [], "spread": []}
    model = dp.module if hasattr(dp, "module") else dp
    for step in range(steps):
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
        x, y = global_batch(step, 8 * world, IN)
        with CommCounter() as counter:
            loss = torch.nn.functional.mse_loss(
                dp(my_slice(x, rank, world)), my_slice(y, rank, world)
            )
            loss.backward()
            if set_loss is not None:
                set_loss(step, loss)
            opt.step()
            opt.zero_grad()
        out["loss"].append(float(loss.detach()))
        out["allreduce"].append(counter.calls["allreduce"])
        out["bytes"].append(counter.bytes["allreduce"])
        out["spread"].append(spread(flat_params(model)))
    return out


def _fleet(strategy: fleet.DistributedStrategy, momentum: float = 0.0) -> tuple[Any, Any, Any]:
    model = make_model()
    opt = fleet.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum), strategy=strategy
    )
    return model, fleet.distributed_model(model), opt


def bf16_ref_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    # torch's hook under another name: DDP refuses the name bf16_compress_hook without NCCL.
    return bf16_compress_hook(process_group, bucket)


def case_fp16(rank: int, world: int, rec: dict[str, Any]) -> None:
    steps = 5
    for dtype, ref_hook in (("float16", fp16_compress_hook), ("bfloat16", bf16_ref_hook)):
        s = fleet.DistributedStrategy(fp16_allreduce=True, fp16_allreduce_configs={"dtype": dtype})
        model, dp, opt = _fleet(s)
        ours = train(dp, opt, steps, rank, world)
        ref_model = make_model()
        ref = DistributedDataParallel(ref_model)
        ref.register_comm_hook(None, ref_hook)
        theirs = train(ref, torch.optim.SGD(ref_model.parameters(), lr=0.05), steps, rank, world)
        rec[dtype] = {
            "vs_torch": max_diff(flat_params(model), flat_params(ref_model)),
            "bytes": ours["bytes"],
            "torch_bytes": theirs["bytes"],
            "spread": ours["spread"][-1],
        }
    model, dp, opt = _fleet(fleet.DistributedStrategy())
    plain = train(dp, opt, steps, rank, world)
    rec["fp32_bytes"] = plain["bytes"]
    rec["bucket_caps"] = list(dp.bucket_bytes_cap_list)  # last_comm_group_size_MB, fuse size
    model, dp, opt = _fleet(fleet.DistributedStrategy(fuse_all_reduce_ops=False))
    rec["unfused_allreduce"] = train(dp, opt, 3, rank, world)["allreduce"]
    rec["num_params"] = len(list(model.parameters()))


def case_localsgd(rank: int, world: int, rec: dict[str, Any]) -> None:
    k, begin, steps = 4, 2, 15
    s = fleet.DistributedStrategy(
        localsgd=True, localsgd_configs={"k_steps": k, "begin_step": begin}
    )
    model, dp, opt = _fleet(s, momentum=0.9)
    ours = train(dp, opt, steps, rank, world)
    ref_model = make_model()
    ref = DistributedDataParallel(ref_model)
    ref.register_comm_hook(
        PostLocalSGDState(
            None, None, start_localSGD_iter=begin, post_local_gradient_allreduce=False
        ),
        post_localSGD_hook,
    )
    ref_opt = PostLocalSGDOptimizer(
        torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9),
        PeriodicModelAverager(period=k, warmup_steps=begin),
    )
    theirs = train(ref, ref_opt, steps, rank, world)
    rec["loss_vs_torch"] = max(abs(a - b) for a, b in zip(ours["loss"], theirs["loss"]))
    rec["params_vs_torch"] = max_diff(flat_params(model), flat_params(ref_model))
    rec["allreduce"], rec["torch_allreduce"] = ours["allreduce"], theirs["allreduce"]
    rec["spread"] = ours["spread"]
    rec["state_dict_step"] = opt.state_dict()["step"]  # the averager's step, torch's format
    # fp16_allreduce with local SGD: the warm-up all-reduce travels in float16.
    s16 = fleet.DistributedStrategy(
        localsgd=True, fp16_allreduce=True, localsgd_configs={"k_steps": k, "begin_step": begin}
    )
    _, dp16, opt16 = _fleet(s16, momentum=0.9)
    with_fp16 = train(dp16, opt16, begin + k, rank, world)
    rec["fp16_warmup_bytes"] = with_fp16["bytes"][:begin]
    rec["fp32_warmup_bytes"] = ours["bytes"][:begin]
    rec["fp16_allreduce"] = with_fp16["allreduce"]


def case_adaptive(rank: int, world: int, rec: dict[str, Any]) -> None:
    init_k, begin = 2, 2
    s = fleet.DistributedStrategy(
        adaptive_localsgd=True,
        adaptive_localsgd_configs={"init_k_steps": init_k, "begin_step": begin},
    )
    # 1. a scripted loss sequence and learning-rate schedule, the same on every rank: the
    #    intervals must follow the rule.
    scripted = [4.0 / (1 + 0.3 * t) for t in range(40)]
    lrs = [0.05 if t < 20 else 0.01 for t in range(40)]
    _, dp, opt = _fleet(s, momentum=0.9)
    train(
        dp,
        opt,
        40,
        rank,
        world,
        lr_at=lambda t: lrs[t],
        set_loss=lambda t, loss: opt.set_loss(scripted[t]),
    )
    history = opt.averager.history
    expected, step, k = [], begin, None
    while step < 40:
        # the loss travels in the parameters' dtype (float32) through the averaging all-reduce
        loss_now = float(torch.tensor(scripted[step], dtype=torch.float32))
        k = next_k_steps(init_k, lrs[0], scripted[0], lrs[step], loss_now)
        expected.append([step, k])
        step += k
    rec["scripted_history"] = [list(h) for h in history]
    rec["scripted_expected"] = expected
    # 2. the real loss through step(closure): training converges and replicas agree after each
    #    averaging.
    model, dp, opt = _fleet(s, momentum=0.9)
    losses, spreads_after_avg = [], []
    for step in range(60):
        x, y = global_batch(step % 10, 8 * world, IN)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(
                dp(my_slice(x, rank, world)), my_slice(y, rank, world)
            )
            loss.backward()
            return loss

        losses.append(float(opt.step(closure).detach()))
        if opt.averager.history and opt.averager.history[-1][0] == step:
            spreads_after_avg.append(spread(flat_params(model)))
    mean = torch.tensor([sum(losses[:5]) / 5, sum(losses[-5:]) / 5])
    tdist.all_reduce(mean)
    rec["first_loss"], rec["last_loss"] = float(mean[0]) / world, float(mean[1]) / world
    rec["real_history"] = [list(h) for h in opt.averager.history]
    rec["spreads_after_avg"] = spreads_after_avg
    rec["finite"] = all(math.isfinite(v) for v in losses)


if __name__ == "__main__":
    run_fixture({"fp16": case_fp16, "localsgd": case_localsgd, "adaptive": case_adaptive})
