"""Data-parallel training with fleet: a small MLP classifier on a synthetic dataset.

Run on 2 CPU processes (or GPUs)::

    fleetrun --nproc_per_node 2 examples/dp/train.py --steps 300
    fleetrun --nproc_per_node 2 examples/dp/train.py --strategy configs/strategy_dp.yaml
    python examples/dp/train.py            # a world of one, no launcher
    fleetrun -c configs/dp_elastic.yaml    # elastic: 1 to 2 nodes, resumes from checkpoints

The dataset is generated deterministically (same on every rank): points in 32-D labelled by a
fixed random "teacher" network, so the task is learnable and the loss visibly falls. Each rank
reads its own share through a ``DistributedSampler``; ``fleet.distributed_model`` all-reduces
the gradients, so every rank holds the same model. Rank 0 prints the loss averaged over ranks.

``--elastic``: the job may be restarted at another world size (``fleetrun --nnodes MIN:MAX``);
every ``--save_every`` steps ``fleet.elastic.Checkpointer`` saves the model, the optimizer, the
step and the data position under ``--ckpt_dir``, and a (re)started job resumes from the newest
checkpoint there, reading the rest of the epoch through ``fleet.elastic.ElasticSampler`` split
over the ranks it has now (docs/elastic/resume.md).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import collective as dist
import fleet

NUM_FEATURES, NUM_CLASSES, NUM_SAMPLES = 32, 4, 8192


def make_dataset(seed: int = 0) -> TensorDataset:
    """Inputs ~ N(0, 1); labels = argmax of a fixed random two-layer teacher network."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=g)
    w1 = torch.randn(NUM_FEATURES, 64, generator=g) / NUM_FEATURES**0.5
    w2 = torch.randn(64, NUM_CLASSES, generator=g) / 8.0
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return TensorDataset(x, y)


def make_model() -> torch.nn.Module:
    """The student: a 3-layer MLP (same initial weights on every rank; DDP also broadcasts)."""
    torch.manual_seed(42)
    return torch.nn.Sequential(
        torch.nn.Linear(NUM_FEATURES, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, NUM_CLASSES),
    )


def parse_args() -> argparse.Namespace:
    """Command line of the example."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer calls (micro-steps)")
    p.add_argument("--batch_size", type=int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--strategy", default=None, help="DistributedStrategy YAML file")
    p.add_argument("--log_every", type=int, default=25, help="print the loss every N steps")
    p.add_argument(
        "--elastic",
        action="store_true",
        help="resume from / save checkpoints in --ckpt_dir (an elastic job)",
    )
    p.add_argument(
        "--ckpt_dir",
        default="log/dp-elastic/ckpt",
        help="--elastic: the checkpoint directory every rank sees",
    )
    p.add_argument(
        "--save_every", type=int, default=25, help="--elastic: save a checkpoint every N steps"
    )
    return p.parse_args()


@fleet.record
def main() -> None:
    """Train and report; exits non-zero if the loss did not fall."""
    args = parse_args()
    strategy = fleet.DistributedStrategy.from_yaml(args.strategy) if args.strategy else None
    fleet.init(is_collective=True, strategy=strategy)
    rank, world = fleet.worker_index(), fleet.worker_num()
    device = torch.device(f"cuda:{fleet.local_rank()}" if torch.cuda.is_available() else "cpu")

    dataset = make_dataset()
    sampler: DistributedSampler
    if args.elastic:  # its position in an epoch carries over to another world size
        sampler = fleet.elastic.ElasticSampler(dataset, shuffle=True, seed=0, drop_last=True)
    else:
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = fleet.distributed_model(make_model().to(device))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
    step, epoch, offset, first, last = 0, 0, 0, None, None
    ckpt = None
    if args.elastic:
        ckpt = fleet.elastic.Checkpointer(model, opt, args.ckpt_dir, every_steps=args.save_every)
        resume = ckpt.restore()  # the newest checkpoint, at whatever world size saved it
        step, epoch, offset = resume.step, resume.epoch, resume.offset
        first = resume.extra.get("first_loss")  # the job's first loss, for the check below
        if fleet.is_first_worker() and resume.path:
            print(
                f"resumed from {resume.path}: step {step}, epoch {epoch}, sample {offset} "
                f"(saved by {resume.saved_world_size} worker(s), now {world})",
                flush=True,
            )
    if fleet.is_first_worker():
        print(
            f"training on {world} worker(s), {device}, batch {args.batch_size}/rank, "
            f"{args.steps} steps",
            flush=True,
        )

    set_loss = getattr(opt, "set_loss", None)  # local SGD optimizers only
    start = time.perf_counter()
    while step < args.steps:
        if ckpt is not None:
            sampler.set_epoch(epoch, offset)  # the rest of the epoch, over today's ranks
        else:
            sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if set_loss is not None:
                set_loss(loss)  # adaptive local SGD's averaging interval follows the loss
            opt.step()
            opt.zero_grad()
            fleet.report(loss=loss)  # the dashboard's loss curve (no-op without metrics)
            step, offset = step + 1, offset + len(x) * world
            if step == 1 or step % args.log_every == 0 or step == args.steps:
                mean = loss.detach().clone()
                dist.all_reduce(mean, op=dist.ReduceOp.AVG)
                last = float(mean)
                first = last if first is None else first
                if fleet.is_first_worker():
                    print(f"step {step:4d}  epoch {epoch}  loss {last:.4f}", flush=True)
            if ckpt is not None:
                ckpt.step(step, epoch=epoch, offset=offset, extra={"first_loss": first})
            if step >= args.steps:
                break
        else:
            epoch, offset = epoch + 1, 0

    with torch.no_grad():
        x, y = dataset.tensors
        acc = (model.module(x.to(device)).argmax(dim=1) == y.to(device)).float().mean()
    if last is None and ckpt is not None:  # resumed from the last step: nothing left to train
        if fleet.is_first_worker():
            print(f"done: already trained {step} steps, accuracy {float(acc):.3f}", flush=True)
        return
    if fleet.is_first_worker():
        print(
            f"done: loss {first:.4f} -> {last:.4f}, accuracy {float(acc):.3f}, "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
    fleet.barrier_worker()
    if last is None or first is None or not last < first:
        raise SystemExit(f"loss did not fall: {first} -> {last}")


if __name__ == "__main__":
    main()
