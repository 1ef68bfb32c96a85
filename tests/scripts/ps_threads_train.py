"""A PS job trained by ``fleet.train_from_dataset`` with training threads, over slot files whose
lines carry a unique id (slot ``uid``).

A one-column table ``count`` (SGD lr 1, rows from 0) gets a gradient of exactly -1 per example
from every step that trains it, whatever the model predicts: after the epochs its row of each
uid is the number of times that example was trained, as the servers applied it (a lost or
doubled push shows). ``--until-cut`` trains more epochs until an automatic checkpoint was cut
(a fast run may end before the first interval passed). Trainer 0 writes --out (JSON): per epoch the steps, examples, mean loss
and AUC, the phase seconds, the threads that ran forwards, how often each uid was seen by a
forward, and the ``count`` rows of every uid."""

import argparse
import glob
import json
import threading
from collections import Counter

import numpy as np
import torch

import fleet
from fleet.data import Slot
from fleet.ps import auto_checkpoint
from fleet.ps.runtime import get_client, get_communicator
from ps_server import SGD, Constant, Uniform

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--data", required=True)
p.add_argument("--mode", default="async", choices=["sync", "async", "half", "geo"])
p.add_argument("--threads", type=int, default=2, help="the dataset's thread_num")
p.add_argument("--thread-num", type=int, default=None, help="train_from_dataset's thread_num")
p.add_argument("--fail-at", type=int, default=-1, help="a forward raises at this batch")
p.add_argument("--epochs", type=int, default=2)
p.add_argument(
    "--until-cut",
    action="store_true",
    help="with automatic checkpoints: train more epochs (at most 20 in all) until one was cut",
)
p.add_argument("--batch", type=int, default=32)
args = p.parse_args()

SPARSE = ["a", "b"]
slots = [
    Slot("click", dense=True, dtype="float32"),
    *(Slot(s) for s in SPARSE),
    Slot("uid"),
    Slot("x", dtype="float32", dense=True, dim=2),
]
strategy = fleet.DistributedStrategy()
if args.mode != "sync":
    strategy.a_sync = True
if args.mode == "half":
    strategy.a_sync_configs = {"barrier_interval": 5}
if args.mode == "geo":
    strategy.a_sync_configs = {"k_steps": 4}
fleet.init(is_collective=False, strategy=strategy)


class _Count(torch.autograd.Function):
    """Passes ``out`` through; the ``count`` rows get a gradient of -1 per example."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ctx.shape = rows.shape
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return -torch.ones(ctx.shape), grad


seen_uids: Counter = Counter()
forward_threads: set = set()
forwards = [0]
lock = threading.Lock()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = fleet.DistributedEmbedding(
            "emb", 4, optimizer=SGD(0.1), initializer=Uniform(-0.1, 0.1), pooling="sum"
        )
        self.count = fleet.DistributedEmbedding(
            "count", 1, optimizer=SGD(1.0), initializer=Constant(0.0), pooling="sum"
        )
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(2 * 4 + 2, 1)

    def forward(self, batch: dict) -> torch.Tensor:
        with lock:
            forwards[0] += 1
            n = forwards[0]
            forward_threads.add(threading.current_thread().name)
            seen_uids.update(batch["uid"].values.tolist())
        if n == args.fail_at:
            raise RuntimeError(f"boom in the forward of batch {n}")
        pooled = self.emb([batch[s] for s in SPARSE])
        out = self.fc(torch.cat([*pooled, batch["x"]], dim=1))
        return _Count.apply(self.count(batch["uid"]), out)


model = Net()
if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
else:
    fleet.init_worker()
    comm, client = get_communicator(), get_client()
    ds = fleet.InMemoryDataset()
    ds.init(batch_size=args.batch, thread_num=args.threads, use_var=slots)
    ds.set_filelist(sorted(glob.glob(f"{args.data}/part-*")))
    ds.load_into_memory()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.fc.parameters(), lr=0.1))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    auto = auto_checkpoint.start()
    epochs = []
    while len(epochs) < args.epochs or (
        args.until_cut and auto is not None and auto.checkpoint_step is None and len(epochs) < 20
    ):
        forward_threads.clear()
        stats = fleet.train_from_dataset(
            model, opt, ds, loss_fn, label="click", print_period=1000, thread_num=args.thread_num
        )
        epochs.append(
            {
                "steps": stats.steps,
                "examples": stats.examples,
                "loss": stats.mean_loss,
                "auc": stats.auc,
                "phase_seconds": dict(stats.phase_seconds),
                "seconds": stats.seconds,
                "threads": sorted(forward_threads),
            }
        )
    comm.flush()
    uids = np.array(sorted(seen_uids), dtype=np.int64)
    rows = client.pull_sparse("count", uids)[:, 0]
    if fleet.worker_index() == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "epochs": epochs,
                    "seen": sorted(Counter(seen_uids.values()).items()),
                    "uids": len(uids),
                    "count_rows": sorted(Counter(np.round(rows, 3).tolist()).items()),
                    "fc": [t.detach().tolist() for t in model.fc.parameters()],
                },
                f,
            )
    fleet.stop_worker()
