"""GraphSAGE node classification on a graph table: ``fleetrun -c configs/graphsage_ps.yaml``.

One script for both roles. The graph is a stochastic block model with planted classes
(:mod:`examples.graph.sbm`, deterministic from ``--seed``); trainer 0 writes it in Paddle's file
formats and the servers load it into a graph table (each server keeps the nodes and out-edges it
owns). Every trainer then trains a 2-layer GraphSAGE (mean aggregation, written in plain torch:
PyTorch Geometric is optional) on :class:`fleet.graph.NeighborLoader` batches of its share of the
training nodes (fanouts ``--fanouts``, default ``10 5``); the dense parameters live on the
servers (sync mode: every step applies the mean of the trainers' gradients with Adam), so the
trainers are data-parallel over one global batch. Test accuracy is counted over every trainer's
share of the test nodes. Rank 0 prints a JSON line::

    {"test_acc": ..., "train_seconds": ..., "steps": ..., "trainers": 2, "servers": 2, ...}

``python examples/graph/graphsage_ps.py --local`` trains the same model in one process: the
same files in one in-process graph table (the servers' CSR sampling code, no RPC), the same
sampler settings, global batch and optimizer (torch's Adam).
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
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.graph.sbm import TABLE, LocalGraph, SBMConfig, generate, table_config, write_files
from fleet.graph import NeighborLoader

logger = logging.getLogger("graphsage_ps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3000)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--avg_degree", type=float, default=10.0)
    p.add_argument("--p_intra", type=float, default=0.8, help="share of edges inside a class")
    p.add_argument("--feature_dim", type=int, default=16)
    p.add_argument("--signal", type=float, default=0.5, help="class signal in the features")
    p.add_argument("--fanouts", type=int, nargs="+", default=[10, 5])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=128, help="global (split over trainers)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument(
        "--data_dir",
        default="",
        help="where trainer 0 writes the graph files "
        "(every server must read them; default: a temporary directory, removed after)",
    )
    p.add_argument("--local", action="store_true", help="one process, no servers")
    p.add_argument("--json", default="", help="also write the result here")
    return p.parse_args(argv)


def sbm_config(args: argparse.Namespace) -> SBMConfig:
    return SBMConfig(
        nodes=args.nodes,
        classes=args.classes,
        avg_degree=args.avg_degree,
        p_intra=args.p_intra,
        feature_dim=args.feature_dim,
        signal=args.signal,
        seed=args.seed,
    )


class SAGELayer(nn.Module):
    """GraphSAGE with mean aggregation: ``W_self h_i + W_nb mean_{j -> i} h_j``."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.lin_self = nn.Linear(dim_in, dim_out)
        self.lin_nb = nn.Linear(dim_in, dim_out, bias=False)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index  # row 0 the sampled neighbour, row 1 the node it was sampled for
        agg = torch.zeros_like(x).index_add_(0, dst, x[src])
        deg = torch.bincount(dst, minlength=x.shape[0]).clamp(min=1).unsqueeze(1)
        return self.lin_self(x) + self.lin_nb(agg / deg)


class GraphSAGE(nn.Module):
    """Two SAGE layers (ReLU between); ``out[:batch_size]`` are the seeds' logits."""

    def __init__(self, dim_in: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.conv1 = SAGELayer(dim_in, hidden)
        self.conv2 = SAGELayer(hidden, classes)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


def make_loader(
    client: Any, args: argparse.Namespace, seeds: np.ndarray, batch: int, shuffle: bool
) -> NeighborLoader:
    return NeighborLoader(
        client,
        TABLE,
        seeds,
        fanouts=args.fanouts,
        batch_size=batch,
        features=["x"],
        label="label",
        shuffle=shuffle,
        seed=args.seed,
    )


def train(
    model: GraphSAGE, loader: NeighborLoader, epochs: int, step: Callable[[], None]
) -> tuple[int, float]:
    """(steps, seconds) of ``epochs`` passes over ``loader``; ``step`` applies the gradients."""
    steps, t0 = 0, time.perf_counter()
    model.train()
    for epoch in range(epochs):
        for batch in loader:
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size])
            loss.backward()
            step()
            steps += 1
        logger.info("epoch %d loss %.4f", epoch, loss.item())
    return steps, time.perf_counter() - t0


@torch.no_grad()
def correct(model: GraphSAGE, loader: NeighborLoader) -> int:
    """Test nodes of ``loader`` classified right."""
    model.eval()
    hits = 0
    for batch in loader:
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        hits += int((out.argmax(1) == batch.y[: batch.batch_size]).sum())
    return hits


def run_local(args: argparse.Namespace) -> dict:
    """Train and evaluate in this process (no servers)."""
    cfg = sbm_config(args)
    graph = generate(cfg)
    directory = args.data_dir or tempfile.mkdtemp(prefix="graphsage-")
    try:
        t0 = time.perf_counter()
        local = LocalGraph(table_config(cfg), *write_files(graph, directory))
        load_seconds = time.perf_counter() - t0
    finally:
        if not args.data_dir:
            shutil.rmtree(directory, ignore_errors=True)
    torch.manual_seed(args.seed)
    model = GraphSAGE(cfg.feature_dim, args.hidden, cfg.classes)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    steps, seconds = train(
        model, make_loader(local, args, graph.train, args.batch_size, True), args.epochs, step
    )
    hits = correct(model, make_loader(local, args, graph.test, 1024, False))
    return {
        "mode": "local",
        "nodes": cfg.nodes,
        "edges": int(2 * graph.src.shape[0]),
        "fanouts": args.fanouts,
        "load_seconds": load_seconds,
        "train_seconds": seconds,
        "steps": steps,
        "test_acc": hits / graph.test.shape[0],
    }


def run_ps(args: argparse.Namespace) -> dict | None:
    """The fleetrun job: servers serve, trainers train; rank 0's result (None elsewhere)."""
    import fleet
    from ps_server.graph_client import GraphClient

    fleet.init(is_collective=False, strategy=fleet.DistributedStrategy())
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return None
    fleet.init_worker()
    cfg = sbm_config(args)
    graph = generate(cfg)
    rank, world = fleet.worker_index(), fleet.worker_num()
    client = GraphClient(fleet.server_endpoints())
    load_seconds = 0.0
    if rank == 0:
        directory = args.data_dir or tempfile.mkdtemp(prefix="graphsage-")
        try:
            t0 = time.perf_counter()
            edges, nodes = write_files(graph, directory)
            client.create_graph_table(table_config(cfg))
            client.load_edges(TABLE, edges, reverse=True)
            client.load_nodes(TABLE, nodes)
            load_seconds = time.perf_counter() - t0
        finally:
            if not args.data_dir:
                shutil.rmtree(directory, ignore_errors=True)
    fleet.barrier_worker()  # the table is loaded

    torch.manual_seed(args.seed)  # rank 0's initial values are the servers' anyway
    model = GraphSAGE(cfg.feature_dim, args.hidden, cfg.classes)
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=args.lr))

    def step() -> None:
        opt.step()
        opt.zero_grad()

    # sync mode steps in lockstep: every trainer gets as many training nodes
    share = graph.train.shape[0] // world
    mine = graph.train[rank::world][:share]
    local_batch = max(args.batch_size // world, 1)
    fleet.barrier_worker()
    steps, seconds = train(
        model, make_loader(client, args, mine, local_batch, True), args.epochs, step
    )
    seconds = float(fleet.metrics.max(seconds))
    hits = correct(model, make_loader(client, args, graph.test[rank::world], 1024, False))
    acc = float(fleet.metrics.sum(hits)) / graph.test.shape[0]
    client.close()
    result = {
        "mode": "ps",
        "trainers": world,
        "servers": fleet.server_num(),
        "nodes": cfg.nodes,
        "edges": int(2 * graph.src.shape[0]),
        "fanouts": args.fanouts,
        "load_seconds": load_seconds,
        "train_seconds": seconds,
        "steps": steps,
        "test_acc": acc,
    }
    fleet.stop_worker()
    return result if rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result = run_local(args) if args.local else run_ps(args)
    if result is None:
        return
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
