"""metapath2vec on a graph table: ``fleetrun -c configs/metapath2vec_ps.yaml``.

One script for both roles. Trainer 0 writes an author-paper-venue graph with planted author
communities (:mod:`examples.graph.hetero`, deterministic from ``--seed``), one edge file per edge
type, and the servers load them into a graph table with three node types. Each trainer walks
from its share of the authors (``--walks_per_node`` walks of ``--walk_length`` steps from every
author) along the metapath author-paper-venue-paper-author, by
``GraphClient.random_walk(..., metapath=...)``: each step follows the metapath's next edge type
and the walks go from server to server, not through the trainer. The walks become skip-gram pairs
within ``--window`` over every node type (metapath2vec's homogeneous skip-gram), trained with
negative sampling (``--negatives`` uniform random nodes of any type per pair) over two
:class:`fleet.DistributedEmbedding` tables on the same servers, as the DeepWalk example does.
Then trainer 0 pulls the authors' embeddings and fits a logistic regression on the training
authors, once on the embeddings and once on the true community one-hot features, and prints a
JSON line::

    {"acc_embedding": ..., "acc_onehot": ..., "ratio": ..., "pairs": ..., ...}
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

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.graph.deepwalk_ps import (
    logistic_regression,
    skipgram_pairs,
    train_skipgram,
    walk_seed,
)
from examples.graph.hetero import METAPATH, TABLE, HeteroConfig, generate, table_config, write_files

logger = logging.getLogger("metapath2vec_ps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--authors", type=int, default=2000)
    p.add_argument("--papers_per_author", type=float, default=3.0)
    p.add_argument("--coauthors", type=int, default=2, help="authors per paper besides the first")
    p.add_argument("--venues_per_class", type=int, default=5)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--p_intra", type=float, default=0.8, help="share of links inside a community")
    p.add_argument("--dim", type=int, default=32, help="embedding width")
    p.add_argument("--walks_per_node", type=int, default=4, help="walks from every author")
    p.add_argument("--walk_length", type=int, default=16)
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
    scale = 0.5 / args.dim
    node_emb = fleet.DistributedEmbedding(
        "metapath2vec_node",
        args.dim,
        optimizer=Adagrad(args.sparse_lr),
        initializer=Uniform(-scale, scale),
        seed=args.seed,
    )
    ctx_emb = fleet.DistributedEmbedding(
        "metapath2vec_ctx",
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
    cfg = HeteroConfig(
        authors=args.authors,
        papers_per_author=args.papers_per_author,
        coauthors=args.coauthors,
        venues_per_class=args.venues_per_class,
        classes=args.classes,
        p_intra=args.p_intra,
        seed=args.seed,
    )
    graph = generate(cfg)
    rank, world = fleet.worker_index(), fleet.worker_num()
    client = GraphClient(fleet.server_endpoints())
    if rank == 0:
        directory = args.data_dir or tempfile.mkdtemp(prefix="metapath2vec-")
        try:
            client.create_graph_table(table_config())
            for edge_type, path in write_files(graph, directory).items():
                client.load_edges(TABLE, path, edge_type=edge_type)
        finally:
            if not args.data_dir:
                shutil.rmtree(directory, ignore_errors=True)
    fleet.barrier_worker()  # the table is loaded

    rng = np.random.default_rng([args.seed, rank])
    starts = np.tile(graph.authors, args.walks_per_node)[rank::world]
    t0 = time.perf_counter()
    values, offsets = client.random_walk(
        TABLE, starts, args.walk_length, metapath=list(METAPATH), seed=walk_seed(args.seed, rank)
    )
    walk_seconds = time.perf_counter() - t0
    full = int(np.count_nonzero(np.diff(offsets) == args.walk_length + 1))
    centre, context = skipgram_pairs(values, offsets, args.window)
    comm = get_communicator()
    t0 = time.perf_counter()
    steps = train_skipgram(node_emb, ctx_emb, centre, context, graph.nodes, args, rng, comm.step)
    comm.flush()
    train_seconds = float(fleet.metrics.max(time.perf_counter() - t0))
    pairs = int(fleet.metrics.sum(centre.shape[0])) * args.epochs
    full_walks = int(fleet.metrics.sum(full))
    fleet.barrier_worker()  # every trainer's updates are on the servers
    if rank == 0:
        with torch.no_grad():
            emb = node_emb(torch.from_numpy(graph.authors[:, None]))[:, 0].numpy()
        onehot = np.eye(cfg.classes, dtype=np.float32)[graph.labels]
        acc_emb = logistic_regression(emb, graph.labels, graph.train, graph.test, args.lr_steps)
        acc_hot = logistic_regression(onehot, graph.labels, graph.train, graph.test, args.lr_steps)
        result = {
            "trainers": world,
            "servers": fleet.server_num(),
            "authors": cfg.authors,
            "nodes": int(graph.nodes.shape[0]),
            "edges": int(sum(s.shape[0] for s, _ in graph.edges().values())),
            "walks": int(args.walks_per_node * cfg.authors),
            "full_length_walks": full_walks,
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
