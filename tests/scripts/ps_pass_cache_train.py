"""A PS job whose DistributedEmbedding is pass-cached (``cache="pass"``): one pass of
``fleet.train_from_dataset`` over this trainer's slot file, which opens and closes the pass.

Each trainer writes ``--out``-<rank>.json: its sparse client calls during the pass, the rows of
every key before and after (after the barrier that ends the pass: both trainers' deltas are
in), and the delta its pass pushed."""

import argparse
import glob
import json

import numpy as np
import torch

import fleet
from fleet.data import Slot
from fleet.ps import pass_cache
from fleet.ps.runtime import get_client
from ps_server import SGD, Uniform

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--data", required=True)
p.add_argument("--keys", type=int, default=120)
p.add_argument("--mode", default="sync", choices=["sync", "async", "geo"])
p.add_argument("--threads", type=int, default=1, help="train_from_dataset thread_num (async)")
args = p.parse_args()

slots = [Slot("click", dense=True), Slot("a"), Slot("b")]
strategy = fleet.DistributedStrategy()
strategy.a_sync = args.mode in ("async", "geo")
if args.mode == "geo":  # the dense layer trained locally, its delta exchanged every 4 steps
    strategy.a_sync_configs = {"k_steps": 4}
fleet.init(is_collective=False, strategy=strategy)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = fleet.DistributedEmbedding(
            "emb",
            4,
            optimizer=SGD(0.2),
            initializer=Uniform(-0.1, 0.1),
            pooling="sum",
            cache="pass",
        )
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.fc(torch.cat(self.emb([batch["a"], batch["b"]]), dim=1))


model = Net()
if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
else:
    fleet.init_worker()
    client = get_client()
    keys = np.arange(args.keys, dtype=np.int64)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.fc.parameters(), lr=0.1))
    before = client.pull_sparse("emb", keys)
    ds = fleet.InMemoryDataset()
    ds.init(batch_size=32, thread_num=1, use_var=slots)
    ds.set_filelist(fleet.util.get_file_shard(sorted(glob.glob(f"{args.data}/part-*"))))
    ds.load_into_memory()
    calls = []
    pull, push = client.pull_sparse, client.push_sparse
    pull_state = client.pull_sparse_with_state  # a pass's pull, whatever the rule
    client.pull_sparse = lambda t, *a, **kw: (calls.append(["pull", t]), pull(t, *a, **kw))[1]
    client.pull_sparse_with_state = lambda t, *a, **kw: (
        calls.append(["pull", t]),
        pull_state(t, *a, **kw),
    )[1]
    client.push_sparse = lambda t, *a, **kw: (calls.append(["push", t]), push(t, *a, **kw))[1]
    pushed = {}
    delta = pass_cache.PassTable.delta

    def recorded(table):
        k, d, state = delta(table)  # SGD: no optimizer state
        pushed[table.name] = (k.tolist(), d.tolist())
        return k, d, state

    pass_cache.PassTable.delta = recorded
    stats = fleet.train_from_dataset(
        model,
        opt,
        ds,
        torch.nn.BCEWithLogitsLoss(),
        label="click",
        print_period=1000,
        thread_num=args.threads,
    )
    client.pull_sparse, client.push_sparse = pull, push
    fleet.barrier_worker()
    after = client.pull_sparse("emb", keys)
    with open(f"{args.out}-{fleet.worker_index()}.json", "w") as f:
        json.dump(
            {
                "calls": calls,
                "steps": stats.steps,
                "in_pass": pass_cache.in_pass(),
                "before": before.tolist(),
                "after": after.tolist(),
                "delta": pushed["emb"],
            },
            f,
        )
    fleet.stop_worker()
