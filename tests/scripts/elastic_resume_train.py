"""Fixture for tests/test_elastic_resume.py: train through ``fleet.elastic.Checkpointer`` and
``ElasticSampler`` the way the resume pattern of docs/elastic/resume.md does, stop early
(``--stop_at``, a lost node: the steps after the last save are lost), resume in another job at
another world size.

``--mode dp``: SGD with momentum, plain data parallel. ``--mode s1`` / ``s2``: Adam under
sharding stage 1 / 2 over every rank (no sharding in a world of one). The global batch is
``GLOBAL_BATCH`` samples at every world size (``GLOBAL_BATCH / world`` per rank).
``--reference``: no process group, one process, the whole run uninterrupted; writes
``ref_sgd.pt`` and ``ref_adam.pt`` (the full parameters after ``--steps``).
Every rank writes ``<out>/<tag>_rank<r>.json`` (where it resumed, what it trained); the job
that reaches ``--steps`` also writes ``<out>/final_<mode>.pt`` from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

NUM_SAMPLES, FEATURES, GLOBAL_BATCH = 200, 8, 24


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, x[:, :2].sum(dim=1, keepdim=True).sin())


def make_model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    )


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=5e-3)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1) for v in model.state_dict().values()])


def train(model, opt, loader, sampler, ckpt, start, steps: int, stop_at: int, world: int) -> list:
    """The loop of docs/elastic/resume.md. Returns the (step, epoch, offset) of each step."""
    step, epoch, offset = start.step, start.epoch, start.offset
    trained = []
    while step < min(steps, stop_at):
        sampler.set_epoch(epoch, offset)
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step, offset = step + 1, offset + len(x) * world
            trained.append((step, epoch, offset))
            if ckpt is not None:
                ckpt.step(step, epoch=epoch, offset=offset, extra={"note": "from the fixture"})
            if step >= min(steps, stop_at):
                break
        else:
            epoch, offset = epoch + 1, 0
    return trained


def reference(args: argparse.Namespace) -> None:
    from fleet.elastic import ElasticSampler, ResumePoint

    dataset = make_dataset()
    for kind in ("sgd", "adam"):
        model = make_model()
        opt = make_optimizer(kind, model.parameters())
        sampler = ElasticSampler(dataset, num_replicas=1, rank=0, seed=3, drop_last=True)
        loader = DataLoader(dataset, batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True)
        train(model, opt, loader, sampler, None, ResumePoint(), args.steps, args.steps, 1)
        torch.save(flat(model), os.path.join(args.out, f"ref_{kind}.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["dp", "s1", "s2"], default="dp")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="job")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stop_at", type=int, default=10**9)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--reference", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.reference:
        reference(args)
        return

    import fleet
    from fleet.elastic import Checkpointer, ElasticSampler

    world = int(os.environ["WORLD_SIZE"])
    strategy = fleet.DistributedStrategy()
    if args.mode != "dp" and world > 1:
        strategy.hybrid_configs = {"sharding_degree": world}
        strategy.sharding = True
        strategy.sharding_configs = {"stage": int(args.mode[1])}
    fleet.init(is_collective=True, strategy=strategy)
    rank = fleet.worker_index()

    dataset = make_dataset()
    sampler = ElasticSampler(dataset, seed=3, drop_last=True)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // world, sampler=sampler, drop_last=True)
    model = fleet.distributed_model(make_model())
    kind = "sgd" if args.mode == "dp" else "adam"
    opt = fleet.distributed_optimizer(make_optimizer(kind, model.parameters()))
    ckpt = Checkpointer(model, opt, args.ckpt, every_steps=args.every, keep=2)
    start = ckpt.restore()
    trained = train(model, opt, loader, sampler, ckpt, start, args.steps, args.stop_at, world)
    rec = {
        "rank": rank,
        "world": world,
        "resumed": [start.step, start.epoch, start.offset],
        "saved_world_size": start.saved_world_size,
        "extra": start.extra,
        "trained": trained,
        "state_params": len(opt.state),
    }
    if trained and trained[-1][0] == args.steps and rank == 0:
        torch.save(flat(model), os.path.join(args.out, f"final_{args.mode}.pt"))
    with open(os.path.join(args.out, f"{args.tag}_rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    fleet.shutdown()


if __name__ == "__main__":
    main()
