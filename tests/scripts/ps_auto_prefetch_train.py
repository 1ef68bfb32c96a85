"""A PS job over slot files that counts where its sparse pulls ran: in the training thread (the
forward waited for the servers) or in the prefetch threads (pulled while a step trained).

Two epochs over an InMemoryDataset: the first with the hand-written loop ``for batch in ds``,
the second with ``fleet.train_from_dataset``. Trainer 0 writes --out (JSON): the losses, the
pulls per thread kind and epoch, the final rows of a fixed key set and the dense parameters."""

import argparse
import glob
import json
import threading

import numpy as np
import torch

import fleet
from fleet.data import Slot
from fleet.ps.auto_prefetch import PREFETCHER
from fleet.ps.runtime import get_client, get_communicator
from ps_server import SGD, Uniform

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--data", required=True)
p.add_argument("--mode", default="async", choices=["sync", "async"])
p.add_argument("--prefetch", type=int, default=1)
p.add_argument("--batch", type=int, default=64)
args = p.parse_args()

SPARSE = ["a", "b", "c"]
slots = [
    Slot("click", dense=True),
    *(Slot(s) for s in SPARSE),
    Slot("x", dtype="float32", dense=True, dim=2),
]
strategy = fleet.DistributedStrategy()
if args.mode == "async":
    strategy.a_sync = True
    strategy.a_sync_configs = {"prefetch": bool(args.prefetch)}
fleet.init(is_collective=False, strategy=strategy)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = fleet.DistributedEmbedding(
            "emb", 4, optimizer=SGD(0.1), initializer=Uniform(-0.1, 0.1), pooling="sum"
        )
        self.x = fleet.DistributedEmbedding(
            "x_emb", 4, optimizer=SGD(0.1), initializer=Uniform(-0.1, 0.1), pooling="sum"
        )
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3 * 4 + 4 + 2, 1)

    def forward(self, batch: dict) -> torch.Tensor:
        pooled = self.emb([batch[s] for s in SPARSE])  # one slot list, one table
        single = self.x(batch["a"])  # one slot, another table
        return self.fc(torch.cat([*pooled, single, batch["x"]], dim=1))


model = Net()
if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
else:
    fleet.init_worker()
    comm, client = get_communicator(), get_client()
    pulls = {"train": 0, "prefetch": 0}
    pull = client.pull_sparse

    def counted(*a, **kw):
        kind = (
            "prefetch" if threading.current_thread().name.startswith("fleet-prefetch") else "train"
        )
        pulls[kind] += 1
        return pull(*a, **kw)

    client.pull_sparse = counted
    ds = fleet.InMemoryDataset()
    ds.init(batch_size=args.batch, thread_num=1, use_var=slots)
    ds.set_filelist(sorted(glob.glob(f"{args.data}/part-*")))
    ds.load_into_memory()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.fc.parameters(), lr=0.1))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses, epochs = [], []
    batches = 0
    for batch in ds:  # the guide's own loop
        out = model({k: v for k, v in batch.items() if k != "click"})
        loss = loss_fn(out, batch["click"].float())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        batches += 1
    epochs.append({"batches": batches, **pulls})
    pulls.update(train=0, prefetch=0)
    stats = fleet.train_from_dataset(model, opt, ds, loss_fn, label="click", print_period=1000)
    epochs.append({"batches": stats.steps, **pulls, "loss": stats.mean_loss, "auc": stats.auc})
    comm.flush()
    client.pull_sparse = pull
    keys = np.arange(0, 40, dtype=np.int64)
    if fleet.worker_index() == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "epochs": epochs,
                    "prefetched": PREFETCHER.prefetched,
                    "rows": client.pull_sparse("emb", keys).tolist(),
                    "fc": [t.detach().tolist() for t in model.fc.parameters()],
                },
                f,
            )
    fleet.stop_worker()
