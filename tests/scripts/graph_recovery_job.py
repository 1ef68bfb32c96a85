"""A graph-table job for the recovery test (both roles in one script; async mode under fleetrun
with ``--ps_checkpoint_dir``).

Trainer 0 writes an edge file and a node file under ``--data_dir``, creates graph table ``g`` and
has the servers load them, then records every query node's full neighbor set (fanout above every
degree), its degree and its features (``<out>/before.json``). The trainers then train a small
model over a ``DistributedEmbedding`` on the same servers, one graph sample per step, so the
automatic checkpoints are taken while the graph is served. When ``<out>/query`` exists (the test
creates it once the killed server is back), trainer 0 asks the same questions again
(``<out>/after.json``) and every trainer stops; a trainer also stops after ``--max_seconds``.
"""

import argparse
import json
import os
import time

import numpy as np
import torch

import fleet
from ps_server import Adagrad, Uniform
from ps_server.config import GraphTableConfig
from ps_server.graph_client import GraphClient

p = argparse.ArgumentParser()
p.add_argument("--data_dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--max_seconds", type=float, default=150.0)
p.add_argument("--step_sleep", type=float, default=0.02)
args = p.parse_args()

CFG = GraphTableConfig(
    "g",
    node_types=["n"],
    edge_types=["e"],
    features={"n": {"x": ("float32", 3), "tag": ("int64", 2)}},
    num_shards=16,
)
NODES = 400

strategy = fleet.DistributedStrategy()
strategy.a_sync = True  # async: fleetrun restarts a dead server alone
fleet.init(is_collective=False, strategy=strategy)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = fleet.DistributedEmbedding(
            "emb", 4, optimizer=Adagrad(0.1), initializer=Uniform(-0.5, 0.5), pooling="sum"
        )
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids)).squeeze(-1)


model = Net()
if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
    raise SystemExit(0)

fleet.init_worker()
rank = fleet.worker_index()
client = GraphClient(fleet.server_endpoints())
ids = np.arange(NODES, dtype=np.int64) * 7919 - 10**12


def answers() -> dict:
    """Every query node's sorted neighbor list, degree and features (exact)."""
    values, offsets = client.sample_neighbors("g", ids, 10_000, "e")
    feats = client.node_features("g", ids, names=["x", "tag"])
    return {
        "neighbors": [sorted(values[offsets[i] : offsets[i + 1]].tolist()) for i in range(NODES)],
        "degree": client.degree("g", ids, "e").tolist(),
        "x": feats["x"].tolist(),
        "tag": feats["tag"].tolist(),
    }


if rank == 0 and not os.environ.get("FLEET_PS_RESUME_POSITION"):  # not a trainer restarted alone
    rng = np.random.default_rng(0)
    src = ids[rng.integers(0, NODES, 5000)]
    dst = ids[rng.integers(0, NODES, 5000)]
    w = rng.random(5000)
    os.makedirs(args.data_dir, exist_ok=True)
    edges = os.path.join(args.data_dir, "edges.txt")
    nodes = os.path.join(args.data_dir, "nodes.txt")
    with open(edges, "w") as f:
        f.writelines(f"{s}\t{d}\t{x:.6f}\n" for s, d, x in zip(src, dst, w))
    x = rng.standard_normal((NODES, 3)).astype(np.float32)
    tag = rng.integers(-(2**62), 2**62, (NODES, 2))
    with open(nodes, "w") as f:
        f.writelines(
            f"n\t{i}\tx {a[0]!r} {a[1]!r} {a[2]!r}\ttag {t[0]} {t[1]}\n"
            for i, a, t in zip(ids, x.tolist(), tag)
        )
    client.create_graph_table(CFG)
    client.load_edges("g", edges, "e", reverse=True)
    client.load_nodes("g", nodes)
    before = answers()
    assert before["x"] == x.tolist() and before["tag"] == tag.tolist()
    with open(os.path.join(args.out, "before.json"), "w") as f:
        json.dump(before, f)
fleet.barrier_worker()  # the graph is loaded

opt = fleet.distributed_optimizer(torch.optim.Adagrad(model.fc.parameters(), lr=0.1))
gen = torch.Generator().manual_seed(100 + rank)
flag = os.path.join(args.out, "query")
deadline = time.monotonic() + args.max_seconds
step = 0
while time.monotonic() < deadline and not os.path.exists(flag):
    batch = torch.randint(0, 50, (8, 3), generator=gen) * 1_000_003
    loss = torch.nn.functional.mse_loss(model(batch), torch.ones(8))
    loss.backward()
    opt.step()
    opt.zero_grad()
    client.sample_neighbors("g", ids[step % NODES : step % NODES + 8], 5, "e")
    step += 1
    time.sleep(args.step_sleep)
if rank == 0 and os.path.exists(flag):
    with open(os.path.join(args.out, "after.json"), "w") as f:
        json.dump(answers(), f)
client.close()
fleet.stop_worker()
