"""Fixture of tests/test_strategy_comm.py: DGC through fleet on 2 ranks.

Dense steps before ``rampup_begin_step`` equal torch DDP + momentum SGD; every sparse step's
exchanged gradient equals a reference built here from the all-gathered dense accumulations
(momentum correction, weight decay, top-k per rank, mean); bytes per step at sparsity 0.999
against a dense DDP step (CommCounter); the replicas stay identical and the loss falls.

``--case dgc --out DIR`` writes ``DIR/rank<N>.json``.
"""

from __future__ import annotations

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
from torch.nn.parallel import DistributedDataParallel

import fleet
from fleet.base.runtime import get_runtime
from fleet.meta_optimizers.comm_hooks import CommCounter
from fleet.meta_optimizers.dgc import is_compressed, sparsity_at, top_k_count

IN = 64
BEGIN, RAMPUP, SCHEDULE = 2, 4, [0.75, 0.9, 0.99, 0.999]
LR, MOMENTUM, WD = 0.05, 0.9, 1e-3


def make_model() -> torch.nn.Module:
    # 64x256 and 256x128 weights are compressed (>= 16384 elements), the rest is dense
    return mlp(IN, 256, 128, 1)


def loss_of(model: Any, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = global_batch(step, 8 * world, IN)
    return torch.nn.functional.mse_loss(model(my_slice(x, rank, world)), my_slice(y, rank, world))


def reference_grads(
    model: torch.nn.Module, state: Any, opt: Any, step: int, rank: int, world: int
) -> dict[int, torch.Tensor]:
    """What the sparse exchange must give each parameter at ``step``, computed from scratch."""
    params = list(model.parameters())
    local = torch.autograd.grad(loss_of(model, step, rank, world), params)
    sparsity = sparsity_at(step - BEGIN, RAMPUP, SCHEDULE)
    out = {}
    for p, g in zip(params, local):
        g = g.reshape(-1)
        if is_compressed(p):
            if p in state.u:
                u, v = state.u[p].clone(), state.v[p].clone()
            else:
                u = opt.state[p]["momentum_buffer"].reshape(-1).clone()
                v = torch.zeros_like(u)
            u = MOMENTUM * u + (g + WD * p.detach().reshape(-1))
            v = v + u
            k = top_k_count(p.numel(), sparsity)
            sent = torch.zeros_like(v)
            idx = v.abs().topk(k).indices
            sent[idx] = v[idx]
        else:
            sent = g.clone()
        everyone = [torch.zeros_like(sent) for _ in range(world)]
        tdist.all_gather(everyone, sent)
        out[id(p)] = torch.stack(everyone).mean(dim=0)
    return out


def case_dgc(rank: int, world: int, rec: dict[str, Any]) -> None:
    steps = 12
    s = fleet.DistributedStrategy(
        dgc=True,
        dgc_configs={"rampup_begin_step": BEGIN, "rampup_step": RAMPUP, "sparsity": SCHEDULE},
    )
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    # the model first this time (the other fixtures wrap the optimizer first): the DGC hook and
    # the optimizer are linked whichever comes first
    get_runtime("dgc fixture").strategy = s
    dp = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(sgd)
    state = dp.comm_hook_state
    ref_model = make_model()
    ref = DistributedDataParallel(ref_model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)

    dense_vs_ddp, exchange_err, sparse_bytes, dense_bytes, losses, spreads = [], [], [], [], [], []
    density: list[float] = []
    for step in range(steps):
        expected = reference_grads(model, state, sgd, step, rank, world) if step >= BEGIN else None
        with CommCounter() as counter:
            loss = loss_of(dp, step, rank, world)
            loss.backward()
        if expected is not None:
            exchange_err.append(
                max(max_diff(p.grad.reshape(-1), expected[id(p)]) for p in model.parameters())
            )
            if sparsity_at(step - BEGIN, RAMPUP, SCHEDULE) == 0.999:
                sparse_bytes.append(counter.total_bytes)
                density.append(
                    max(
                        float((p.grad != 0).float().mean())
                        for p in model.parameters()
                        if is_compressed(p)
                    )
                )
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        spreads.append(spread(flat_params(model)))
        if step < BEGIN + 4:  # plain DDP + momentum SGD alongside, for the dense steps and bytes
            with CommCounter() as ddp_counter:
                loss_of(ref, step, rank, world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            dense_bytes.append(ddp_counter.total_bytes)
            if step < BEGIN:
                dense_vs_ddp.append(max_diff(flat_params(model), flat_params(ref_model)))
    rec.update(
        dense_vs_ddp=dense_vs_ddp,
        exchange_err=exchange_err,
        sparse_bytes=sparse_bytes,
        dense_bytes=dense_bytes[-1],
        spreads=spreads,
        grad_density=density,
    )
    # the loss falls over more sparse steps
    for step in range(steps, 80):
        loss = loss_of(dp, step % 8, rank, world)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    mean = torch.tensor([sum(losses[:4]) / 4, sum(losses[-4:]) / 4])
    tdist.all_reduce(mean)
    rec["first_loss"], rec["last_loss"] = float(mean[0]) / world, float(mean[1]) / world
    rec["final_spread"] = spread(flat_params(model))
    rec["compressed"] = [n for n, p in model.named_parameters() if is_compressed(p)]


if __name__ == "__main__":
    run_fixture({"dgc": case_dgc})
