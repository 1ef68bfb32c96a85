"""A small parameter-server training job (both roles in one script, as in Paddle).

Every trainer takes its contiguous slice of one fixed global batch per step, so W trainers with
batch b see the same data as 1 trainer with batch W*b. Trainer 0 writes the final embedding
rows of every key and the dense parameters to --out (JSON)."""

import argparse
import json

import numpy as np
import torch

import fleet
from ps_server import SGD, Uniform

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--global_batch", type=int, default=16)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--mode", default="sync", choices=["sync", "async", "half_async", "geo"])
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--vocab", type=int, default=40)
p.add_argument("--save", default="")
p.add_argument("--geo_k", type=int, default=2)
p.add_argument("--load", default="", help="servers start from this checkpoint")
p.add_argument(
    "--key_steps", type=int, default=-1, help="report keys of this many steps (default: --steps)"
)
args = p.parse_args()

strategy = fleet.DistributedStrategy()
if args.mode != "sync":
    strategy.a_sync = True
if args.mode == "half_async":
    strategy.a_sync_configs = {"barrier_interval": 2}
if args.mode == "geo":
    strategy.a_sync_configs = {"k_steps": args.geo_k}
fleet.init(is_collective=False, strategy=strategy)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = fleet.DistributedEmbedding(
            "emb", 4, optimizer=SGD(args.lr), initializer=Uniform(-0.5, 0.5), pooling="sum"
        )
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids)).squeeze(-1)


model = Net()
if fleet.is_server():
    fleet.init_server(args.load or None)
    fleet.run_server()
else:
    fleet.init_worker()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.fc.parameters(), lr=args.lr))
    rank, world = fleet.worker_index(), fleet.worker_num()
    b = args.global_batch // world
    gen = torch.Generator().manual_seed(1234)
    keys_seen = set()
    for step in range(max(args.steps, args.key_steps)):
        ids = (
            torch.randint(-args.vocab, args.vocab, (args.global_batch, 3), generator=gen)
            * 1_000_003
        )
        y = torch.randn(args.global_batch, generator=gen)
        mine = slice(rank * b, (rank + 1) * b)
        keys_seen.update(ids.reshape(-1).tolist())
        if step >= args.steps:
            continue
        loss = torch.nn.functional.mse_loss(model(ids[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
    if args.save:
        fleet.save_persistables(args.save, mode=0)
    fleet.barrier_worker()
    if rank == 0:
        from fleet.ps.runtime import get_client

        keys = np.array(sorted(keys_seen), dtype=np.int64)
        rows = get_client().pull_sparse("emb", keys)
        out = {
            "keys": keys.tolist(),
            "rows": rows.tolist(),
            "fc": [p.detach().reshape(-1).tolist() for p in model.fc.parameters()],
        }
        with open(args.out, "w") as f:
            json.dump(out, f)
    fleet.stop_worker()
