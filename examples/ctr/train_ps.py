"""Wide & deep CTR training on the parameter server: ``fleetrun -c configs/ctr_ps.yaml``.

One script for both roles (Paddle style). Servers hold the two embedding tables (wide: dim 1,
deep: dim ``--embedding_dim``; raw 64-bit ids, no hashing into a fixed table) and the dense MLP
(Adam on the servers); trainers each generate their contiguous share of one global synthetic
dataset (:mod:`examples.ctr.data`), train with the strategy's mode, and evaluate AUC with
``fleet.metrics`` over the union of their test shares. Rank 0 prints a JSON line::

    {"examples_per_s": ..., "test_auc": ..., "bayes_auc": ..., "mode": "sync", ...}

Same model, data, initialisation scales and learning rates as the single-process baseline
(``python -m examples.ctr.baseline``), so the AUCs compare directly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet
from examples.ctr.data import CTRDataConfig, generate, roc_auc, shard
from examples.ctr.model import WideDeep
from ps_server import SGD, Adagrad, Constant, Normal

logger = logging.getLogger("ctr_ps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", type=int, default=200_000, help="global training examples")
    p.add_argument("--test", type=int, default=50_000, help="global held-out examples")
    p.add_argument("--batch_size", type=int, default=512, help="global batch (split over trainers)")
    p.add_argument("--embedding_dim", type=int, default=16)
    p.add_argument("--sparse_lr", type=float, default=0.05)
    p.add_argument("--dense_lr", type=float, default=1e-3)
    p.add_argument("--mode", choices=["sync", "async", "half_async", "geo"], default="sync")
    p.add_argument("--geo_k", type=int, default=10)
    p.add_argument("--geo_sparse_lr", type=float, default=2.0,
                   help="GEO trains rows locally with plain SGD: it needs a larger lr than Adagrad")
    p.add_argument("--max_merge", type=int, default=1,
                   help="async: steps merged into one send (a_sync_configs.max_merge_var_num)")
    p.add_argument("--prefetch", type=int, default=1,
                   help="async modes: pull the next batch's rows during this step (1) or not (0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="save the tables here at the end")
    p.add_argument("--json", default="", help="also write rank 0's result here")
    return p.parse_args(argv)


def make_strategy(args: argparse.Namespace) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    if args.mode != "sync":
        s.a_sync = True
        s.a_sync_configs = {"max_merge_var_num": args.max_merge}
    if args.mode == "half_async":
        s.a_sync_configs = {"barrier_interval": 20}
    if args.mode == "geo":
        s.a_sync_configs = {"k_steps": args.geo_k}
    return s


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    fleet.init(is_collective=False, strategy=make_strategy(args))
    torch.manual_seed(args.seed)

    def embedding(num_slots: int, dim: int) -> torch.nn.Module:
        # wide rows start at 0 (a plain bias), deep rows N(0, 0.05): as the baseline
        init = Constant(0.0) if dim == 1 else Normal(0.0, 0.05)
        rule = SGD(args.geo_sparse_lr) if args.mode == "geo" else Adagrad(args.sparse_lr)
        return fleet.DistributedEmbedding(f"ctr_dim{dim}", dim, optimizer=rule, initializer=init)

    data = CTRDataConfig(seed=args.seed)
    model = WideDeep(data.num_slots, data.num_dense, args.embedding_dim, (256, 128),
                     embedding_factory=embedding)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return

    fleet.init_worker()
    opt = fleet.distributed_optimizer(torch.optim.Adam(list(model.dense_parameters()), lr=args.dense_lr))
    rank, world = fleet.worker_index(), fleet.worker_num()
    start, count = shard(args.train, rank, world)
    train = generate(data, count, start)
    ids, dense, labels = (torch.from_numpy(train.sparse_ids), torch.from_numpy(train.dense),
                          torch.from_numpy(train.labels))
    local_batch = max(args.batch_size // world, 1)
    steps = count // local_batch  # same step count on every trainer (sync needs lockstep)
    steps = int(fleet.metrics.min(steps))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    fleet.barrier_worker()
    t0 = time.perf_counter()
    for step in range(steps):
        rows = slice(step * local_batch, (step + 1) * local_batch)
        if args.prefetch and step + 1 < steps:  # async modes: the next batch's rows arrive
            nxt = ids[(step + 1) * local_batch:(step + 2) * local_batch]  # during this step
            for emb in model.embedding_modules():
                emb.prefetch(nxt)
        loss = loss_fn(model(ids[rows], dense[rows]), labels[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        fleet.report(loss=loss, samples=local_batch)  # Prometheus / dashboard (no-op without)
        if rank == 0 and step % 100 == 0:
            logger.info("step %d/%d loss %.4f", step, steps, loss.item())
    seconds = fleet.metrics.max(time.perf_counter() - t0)
    trained = fleet.metrics.sum(steps * local_batch)
    opt.comm.flush()  # async modes: the last updates are on the servers before evaluation
    fleet.barrier_worker()

    t_start, t_count = shard(args.test, rank, world)
    test = generate(data, t_count, args.train + t_start)
    state = fleet.metrics.AucState()
    model.eval()
    with torch.no_grad():
        for lo in range(0, t_count, 8192):
            p = torch.sigmoid(model(torch.from_numpy(test.sparse_ids[lo:lo + 8192]),
                                    torch.from_numpy(test.dense[lo:lo + 8192])))
            state.update(p, test.labels[lo:lo + 8192])
    auc = fleet.metrics.auc(state.stat_pos, state.stat_neg)
    bayes = roc_auc(test.probs, test.labels)  # this trainer's share; averaged below
    bayes = float(fleet.metrics.sum(bayes)) / world
    if args.save:
        fleet.save_persistables(args.save, mode=0)
    if rank == 0:
        result = {"mode": args.mode, "trainers": world, "servers": fleet.server_num(),
                  "examples": int(trained), "train_seconds": float(seconds),
                  "examples_per_s": float(trained) / float(seconds), "test_auc": auc,
                  "bayes_auc": bayes}
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f)
    fleet.stop_worker()


if __name__ == "__main__":
    main()
