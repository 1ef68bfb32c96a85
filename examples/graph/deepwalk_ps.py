"""DeepWalk on a graph table: ``fleetrun -c configs/deepwalk_ps.yaml``.

One script for both roles. Trainer 0 writes a stochastic block model with planted communities
(:mod:`examples.graph.sbm`, deterministic from ``--seed``) in Paddle's file formats and the
servers load it into a graph table. Each trainer walks from its share of the start nodes
(``--walks_per_node`` walks of ``--walk_length`` steps from every node, by
``GraphClient.random_walk``: the walks go from server to server, not through the trainer), turns
the walks into skip-gram pairs within ``--window``, and trains node embeddings with negative
sampling (``--negatives`` uniform random nodes per pair): the centre and context embeddings are
two :class:`fleet.DistributedEmbedding` tables on the same servers (Adagrad on the servers,
async mode). Then trainer 0 pulls every node's embedding and fits a logistic regression (torch,
``--lr_steps`` full-batch steps) on the training nodes, once on the embeddings and once on the
true community one-hot features, and prints a JSON line::

    {"acc_embedding": ..., "acc_onehot": ..., "ratio": ..., "pairs": ..., ...}

``ratio`` is the embedding's test accuracy over the one-hot features' (the label is the
community, so the one-hot features reach 1.0).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.graph.sbm import TABLE, SBMConfig, generate, table_config, write_files

logger = logging.getLogger("deepwalk_ps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3000)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--avg_degree", type=float, default=10.0)
    p.add_argument("--p_intra", type=float, default=0.8, help="share of edges inside a class")
    p.add_argument("--dim", type=int, default=32, help="embedding width")
    p.add_argument("--walks_per_node", type=int, default=4)
    p.add_argument("--walk_length", type=int, default=20)
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--negatives", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=2048, help="pairs per step per trainer")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--sparse_lr", type=float, default=0.3)
    p.add_argument("--lr_steps", type=int, default=300, help="logistic regression steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument(
        "--data_dir",
        default="",
        help="where trainer 0 writes the graph files (every server must read them; default: "
        "a temporary directory, removed after)",
    )
    p.add_argument("--json", default="", help="also write the result here")
    return p.parse_args(argv)


def skipgram_pairs(
    values: np.ndarray, offsets: np.ndarray, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """(centre, context) of every two nodes at most ``window`` apart on one walk, both ways."""
    walk = np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))
    centres, contexts = [], []
    for k in range(1, window + 1):
        same = walk[k:] == walk[:-k]
        a, b = values[:-k][same], values[k:][same]
        centres += [a, b]
        contexts += [b, a]
    return np.concatenate(centres), np.concatenate(contexts)


def walk_seed(seed: int, rank: int) -> int:
    """The walks' seed of trainer ``rank`` in the run of ``seed`` (distinct for every pair)."""
    return seed * 1_000_003 + rank


def train_skipgram(
    node_emb: torch.nn.Module,
    ctx_emb: torch.nn.Module,
    centre: np.ndarray,
    context: np.ndarray,
    pool: np.ndarray,
    args: argparse.Namespace,
    rng: np.random.Generator,
    step: Callable[[], object],
) -> int:
    """Skip-gram with negative sampling over (``centre``, ``context``) pairs: ``args.epochs``
    passes in ``rng``'s order, batches of ``args.batch_size`` pairs, ``args.negatives`` uniform
    draws from ``pool`` per pair; ``step`` sends each batch's gradients. Returns the steps."""
    steps = 0
    for epoch in range(args.epochs):
        order = rng.permutation(centre.shape[0])
        for lo in range(0, order.shape[0], args.batch_size):
            pick = order[lo : lo + args.batch_size]
            negatives = pool[rng.integers(0, pool.shape[0], (pick.shape[0], args.negatives))]
            targets = np.concatenate([context[pick, None], negatives], 1)
            u = node_emb(torch.from_numpy(centre[pick, None]))  # [B, 1, dim]
            v = ctx_emb(torch.from_numpy(targets))  # [B, 1 + negatives, dim]
            logits = (u * v).sum(-1)
            labels = torch.zeros_like(logits)
            labels[:, 0] = 1.0
            loss = F.binary_cross_entropy_with_logits(logits, labels)
            loss.backward()
            step()
            steps += 1
        logger.info("epoch %d loss %.4f", epoch, loss.item())
    return steps


def logistic_regression(
    x: np.ndarray, labels: np.ndarray, train: np.ndarray, test: np.ndarray, steps: int
) -> float:
    """Test accuracy of a multinomial logistic regression fit on ``x[train]`` (standardised,
    full-batch Adam)."""
    torch.manual_seed(0)
    feats = torch.from_numpy(x.astype(np.float32))
    feats = (feats - feats[train].mean(0)) / (feats[train].std(0) + 1e-6)
    y = torch.from_numpy(labels)
    classes = int(labels.max()) + 1
    lin = torch.nn.Linear(feats.shape[1], classes)
    opt = torch.optim.Adam(lin.parameters(), lr=0.05, weight_decay=1e-4)
    tr, te = torch.from_numpy(train), torch.from_numpy(test)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(lin(feats[tr]), y[tr]).backward()
        opt.step()
    with torch.no_grad():
        return float((lin(feats[te]).argmax(1) == y[te]).float().mean())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import fleet
    from fleet.ps.runtime import get_communicator
    from ps_server import Adagrad, Constant, Uniform
    from ps_server.graph_client import GraphClient

    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    fleet.init(is_collective=False, strategy=strategy)
    scale = 0.5 / args.dim  # word2vec's: small random centres, zero contexts
    node_emb = fleet.DistributedEmbedding(
        "deepwalk_node",
        args.dim,
        optimizer=Adagrad(args.sparse_lr),
        initializer=Uniform(-scale, scale),
        seed=args.seed,  # the initial rows depend on (table, key, seed)
    )
    ctx_emb = fleet.DistributedEmbedding(
        "deepwalk_ctx",
        args.dim,
        optimizer=Adagrad(args.sparse_lr),
        initializer=Constant(0.0),
        seed=args.seed,
    )
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    fleet.init_worker()
    cfg = SBMConfig(
        nodes=args.nodes,
        classes=args.classes,
        avg_degree=args.avg_degree,
        p_intra=args.p_intra,
        seed=args.seed,
    )
    graph = generate(cfg)
    rank, world = fleet.worker_index(), fleet.worker_num()
    client = GraphClient(fleet.server_endpoints())
    if rank == 0:
        directory = args.data_dir or tempfile.mkdtemp(prefix="deepwalk-")
        try:
            client.create_graph_table(table_config(cfg))
            edges, nodes = write_files(graph, directory)
            client.load_edges(TABLE, edges, reverse=True)
            client.load_nodes(TABLE, nodes)
        finally:
            if not args.data_dir:
                shutil.rmtree(directory, ignore_errors=True)
    fleet.barrier_worker()  # the table is loaded

    rng = np.random.default_rng([args.seed, rank])
    starts = np.tile(graph.ids, args.walks_per_node)[rank::world]
    t0 = time.perf_counter()
    values, offsets = client.random_walk(
        TABLE, starts, args.walk_length, seed=walk_seed(args.seed, rank)
    )
    walk_seconds = time.perf_counter() - t0
    centre, context = skipgram_pairs(values, offsets, args.window)
    comm = get_communicator()
    t0 = time.perf_counter()
    steps = train_skipgram(node_emb, ctx_emb, centre, context, graph.ids, args, rng, comm.step)
    comm.flush()
    train_seconds = float(fleet.metrics.max(time.perf_counter() - t0))
    pairs = int(fleet.metrics.sum(centre.shape[0])) * args.epochs
    fleet.barrier_worker()  # every trainer's updates are on the servers
    if rank == 0:
        with torch.no_grad():
            emb = node_emb(torch.from_numpy(graph.ids[:, None]))[:, 0].numpy()
        onehot = np.eye(cfg.classes, dtype=np.float32)[graph.labels]
        acc_emb = logistic_regression(emb, graph.labels, graph.train, graph.test, args.lr_steps)
        acc_hot = logistic_regression(onehot, graph.labels, graph.train, graph.test, args.lr_steps)
        result = {
            "trainers": world,
            "servers": fleet.server_num(),
            "nodes": cfg.nodes,
            "edges": int(2 * graph.src.shape[0]),
            "walks": int(args.walks_per_node * cfg.nodes),
            "walk_seconds": walk_seconds,
            "pairs": pairs,
            "steps": steps,
            "train_seconds": train_seconds,
            "acc_embedding": acc_emb,
            "acc_onehot": acc_hot,
            "ratio": acc_emb / acc_hot,
        }
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f)
    client.close()
    fleet.stop_worker()


if __name__ == "__main__":
    main()
