"""A heterogeneous PS job's script for the tests (tests/test_heter_*.py): one script, every role.

cpu_part: a ``DistributedEmbedding`` over 3 id slots (dim 4) and a dense ``Linear(2, 4)``;
device_part: an MLP (16 -> 8 -> 1); BCE loss; SGD everywhere, so the one-process reference
(:func:`reference`) can replay the same steps with plain torch. The trainer writes
``<out>/trainer<rank>.npz`` (initial and final embedding rows, cpu dense values, the heter
workers' final dense values, losses) and prints ``{"auc": ...}`` when asked.

``--bad`` makes it a wrong script: ``no_model`` (run_heter_worker without a model),
``plain_model`` (trainers train a model that is not a HeterModel), ``shape`` (trainer 1's cut is
wider), ``worker_only`` (every non-server process takes the is_worker() path), ``fallthrough``
(the heter worker's branch is missing).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VOCAB = 50
SLOTS = 3
DIM = 4


class CpuPart(nn.Module):
    """Embeddings of the id slots, flattened, next to a dense projection of 2 features."""

    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb
        self.lin = nn.Linear(2, 4)
        self.extra = 0  # columns of zeros appended (a wrong, wider cut)

    def forward(self, ids: Any, dense: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(ids, dict):  # a batch of fleet.train_from_dataset
            ids, dense = ids["ids"], ids["dense"]
        out = torch.cat([self.emb(ids).flatten(1), self.lin(dense)], dim=1)
        return torch.cat([out, out.new_zeros(out.shape[0], self.extra)], 1) if self.extra else out


def device_part(width: int = SLOTS * DIM + 4) -> nn.Module:
    """The dense half: an MLP with one output."""
    return nn.Sequential(nn.Linear(width, 8), nn.ReLU(), nn.Linear(8, 1), nn.Flatten(0))


def build(seed: int, emb: nn.Module, width: int = SLOTS * DIM + 4) -> tuple[nn.Module, nn.Module]:
    """(cpu_part, device_part) with the dense initial values of ``seed``."""
    torch.manual_seed(seed)
    cpu = CpuPart(emb)
    return cpu, device_part(width)


def batches(seed: int, rank: int, steps: int, size: int) -> list[tuple[torch.Tensor, ...]]:
    """Trainer ``rank``'s micro-batches: ids, dense features, labels of a learnable rule."""
    weights = np.random.default_rng(seed).normal(0.0, 1.0, VOCAB)
    rng = np.random.default_rng(seed * 1000 + rank + 1)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, VOCAB, (size, SLOTS))
        dense = rng.normal(0.0, 1.0, (size, 2)).astype(np.float32)
        logit = weights[ids].sum(1) + dense[:, 0] - dense[:, 1] + rng.normal(0, 0.5, size)
        out.append(
            (
                torch.from_numpy(ids),
                torch.from_numpy(dense),
                torch.from_numpy((logit > 0).astype(np.float32)),
            )
        )
    return out


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by ranks."""
    order = np.argsort(scores)
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))


def reference(
    seed: int, trainers: int, steps: int, size: int, rows: np.ndarray, lr: float, sparse_lr: float
) -> dict[str, np.ndarray]:
    """One process running both halves on every trainer's micro-batches: step t's loss is the
    mean of the trainers' micro-batch losses (what sync mode computes)."""
    emb = nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(rows))
    cpu, dev = build(seed, emb)
    data = [batches(seed, r, steps, size) for r in range(trainers)]
    opt_sparse = torch.optim.SGD(emb.parameters(), lr=sparse_lr)
    opt = torch.optim.SGD([*cpu.lin.parameters(), *dev.parameters()], lr=lr)
    loss_fn = nn.BCEWithLogitsLoss()
    for t in range(steps):
        loss = sum(loss_fn(dev(cpu(*data[r][t][:2])), data[r][t][2]) for r in range(trainers))
        (loss / trainers).backward()
        opt_sparse.step()
        opt.step()
        opt_sparse.zero_grad()
        opt.zero_grad()
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy()  # noqa: E731
    test = [b for r in range(trainers) for b in batches(seed + 7, r, 4, 256)]
    with torch.no_grad():
        scores = np.concatenate([dev(cpu(ids, dense)).numpy() for ids, dense, _ in test])
    labels = np.concatenate([b[2].numpy() for b in test])
    return {
        "rows": emb.weight.detach().numpy(),
        "lin": flat(cpu.lin),
        "heter": flat(dev),
        "auc": np.array(auc(scores, labels)),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--k", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--sparse_lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    p.add_argument("--recovery_s", type=float, default=60.0)
    p.add_argument("--start_s", type=float, default=300.0)
    p.add_argument("--step_sleep", type=float, default=0.0)
    p.add_argument("--bad", default="")
    p.add_argument("--loop", choices=["train_step", "dataset"], default="train_step")
    p.add_argument("--save", default="", help="fleet.save_persistables here at the end")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import fleet
    from ps_server import SGD, Uniform

    strategy = fleet.DistributedStrategy()
    strategy.a_sync = args.mode == "async"
    strategy.heter_configs = {
        "max_in_flight": args.k,
        "recovery_timeout_s": args.recovery_s,
        "start_timeout_s": args.start_s,
    }
    fleet.init(is_collective=False, strategy=strategy)
    emb = fleet.DistributedEmbedding(
        "emb", DIM, optimizer=SGD(args.sparse_lr), initializer=Uniform(-0.1, 0.1)
    )
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    cpu, dev = build(args.seed, emb)
    if args.bad == "shape" and rank == 1:  # a wider cut on this trainer
        cpu.extra = 2
    plain = args.bad == "plain_model" and fleet.is_worker()  # this trainer builds no HeterModel
    model = None if plain else fleet.heter.HeterModel(cpu, dev, nn.BCEWithLogitsLoss())
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    if args.bad == "worker_only":
        fleet.init_worker()
        return
    if fleet.is_heter_worker():
        if args.bad == "fallthrough":
            return
        opt = torch.optim.SGD(dev.parameters(), lr=args.lr)
        fleet.run_heter_worker(None if args.bad == "no_model" else model, opt)
        return

    fleet.init_worker()
    opt = fleet.distributed_optimizer(torch.optim.SGD(cpu.lin.parameters(), lr=args.lr))
    client = fleet.ps.runtime.get_client()
    keys = np.arange(VOCAB, dtype=np.int64)
    initial = client.pull_sparse("emb", keys)
    losses = []
    data = batches(args.seed, rank, args.steps, args.batch)
    if args.loop == "dataset":  # fleet.train_from_dataset drives model.train_step
        stats = fleet.train_from_dataset(
            model,
            opt,
            [{"ids": i, "dense": d, "label": y} for i, d, y in data],
            nn.BCEWithLogitsLoss(),
            label="label",
            print_period=10,
        )
        print(f"trainer {rank} trained {stats.steps} steps", flush=True)
        data = []
    for step, (ids, dense, label) in enumerate(data):
        if args.bad == "plain_model":
            loss = nn.BCEWithLogitsLoss()(dev(cpu(ids, dense)), label)
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            assert model is not None
            loss = model.train_step((ids, dense), label, optimizer=opt)
        if loss is not None:
            losses.append(float(loss))
        if step % 10 == 0:
            print(f"trainer {rank} step {step}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if model is not None:
        model.flush()
        losses.append(float(model.last_loss))
        test = batches(args.seed + 7, rank, 4, 256)
        with torch.no_grad():
            scores = np.concatenate([model(ids, dense).numpy() for ids, dense, _ in test])
        labels = np.concatenate([b[2].numpy() for b in test])
        print(json.dumps({"rank": rank, "auc": auc(scores, labels)}), flush=True)
    fleet.barrier_worker()
    if args.save:
        fleet.save_persistables(args.save, mode=0)
    if args.out:
        from fleet.heter import HETER_DENSE_TABLE

        np.savez(
            os.path.join(args.out, f"trainer{rank}.npz"),
            initial=initial,
            rows=client.pull_sparse("emb", keys),
            lin=torch.cat([q.detach().reshape(-1) for q in cpu.lin.parameters()]).numpy(),
            heter=client.pull_dense(HETER_DENSE_TABLE, "dense"),
            losses=np.array(losses),
        )
    fleet.stop_worker()


if __name__ == "__main__":
    main()
