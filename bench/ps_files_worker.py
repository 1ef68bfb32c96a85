"""The fleetrun side of ``bench/bench_ps_files.py``: a parameter-server job script (``fleetrun
--server_num 1 --worker_num 1 bench/ps_files_worker.py ...``) that trains a few epochs over one
set of MultiSlot files, with default settings (no prefetch or other tuning by hand).

Model, as the Paddle side (``bench/ps_files_paddle_worker.py``): 26 one-id slots looked up in
one ``fleet.DistributedEmbedding`` of dim 8 (Adagrad 0.05 on the server, ``pooling="sum"``, one
pull for all slots), concatenated (208) into an MLP 64-32-2 (Adam 1e-3 on the server),
softmax cross-entropy on the 2 logits, async (``strategy.a_sync = True``).

The files are loaded once into a ``fleet.InMemoryDataset`` (``thread_num`` =
``--threads``; timed apart, excluded from examples/s); then per epoch, timed alone:

* ``--variant tfd``: ``fleet.train_from_dataset(model, opt, ds, torch.nn.CrossEntropyLoss(),
  label="click", print_period=100)`` as docs/ps/datasets.md shows it (its progress lines in
  the trainer's log), so with the dataset's ``thread_num`` training threads (hogwild, as
  Paddle's; ``--thread_num`` overrides it); the epoch's AUC is the ``TrainStats``'
  ``local_auc`` (one trainer: the job's AUC);
* ``--variant loop``: the guide's loop ``for batch in ds: out = model(batch minus click); loss
  = ...; loss.backward(); opt.step(); opt.zero_grad()`` (one thread), the AUC of the softmax's class-1
  probability in a ``fleet.metrics.AucState`` (4096 buckets) made per epoch.

Trainer 0 writes one JSON line per epoch to ``--out``; an exception in training writes
``{"error": "..."}`` there before it propagates, so the bench can say what failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import fleet
from fleet.data import Slot
from ps_server import Adagrad, Normal

LABEL = "click"
SLOTS = tuple(str(i) for i in range(1, 27))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", required=True, help="comma-separated MultiSlot files")
    p.add_argument("--out", required=True, help="JSON lines, one per epoch (trainer 0)")
    p.add_argument("--variant", choices=["tfd", "loop"], required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="the dataset's thread_num")
    p.add_argument(
        "--thread_num",
        type=int,
        default=None,
        help="train_from_dataset's training threads (default: the dataset's thread_num)",
    )
    p.add_argument("--batch_size", type=int, default=512)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--sparse_lr", type=float, default=0.05)
    p.add_argument("--dense_lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class SlotsMLP(nn.Module):
    """Sum-pooled embeddings of the 26 slots, concatenated, into an MLP 64-32-2 (logits)."""

    def __init__(self, emb: nn.Module, dim: int) -> None:
        super().__init__()
        self.emb = emb
        self.mlp = nn.Sequential(
            nn.Linear(len(SLOTS) * dim, 64),
            nn.ReLU(),
            nn.Linear(64, 32),
            nn.ReLU(),
            nn.Linear(32, 2),
        )

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        pooled = self.emb([batch[s] for s in SLOTS])  # one pull for all slots
        return self.mlp(torch.cat(pooled, dim=1))

    def dense_parameters(self) -> list[nn.Parameter]:
        return list(self.mlp.parameters())


def epoch_tfd(model: nn.Module, opt: Any, ds: Any, thread_num: int | None = None) -> float:
    """One epoch of ``fleet.train_from_dataset`` as the docs show it (training threads: the
    dataset's ``thread_num`` unless ``thread_num`` is given); its AUC."""
    stats = fleet.train_from_dataset(
        model,
        opt,
        ds,
        torch.nn.CrossEntropyLoss(),
        label=LABEL,
        print_period=100,
        thread_num=thread_num,
    )
    return float(stats.local_auc)


def epoch_loop(model: nn.Module, opt: Any, ds: Any, thread_num: int | None = None) -> float:
    """One epoch of the guide's loop; the AUC of the class-1 probability over it."""
    loss_fn = nn.CrossEntropyLoss()
    state = fleet.metrics.AucState()
    model.train()
    for batch in ds:
        label = batch[LABEL].reshape(-1)
        out = model({k: v for k, v in batch.items() if k != LABEL})
        loss = loss_fn(out, label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            state.update(torch.softmax(out, dim=1)[:, 1], label)
    return float(state.local_auc())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    fleet.init(is_collective=False, strategy=strategy)
    torch.manual_seed(args.seed)
    emb = fleet.DistributedEmbedding(
        "emb",
        args.dim,
        optimizer=Adagrad(args.sparse_lr),
        initializer=Normal(0.0, 0.05),
        pooling="sum",
    )
    model = SlotsMLP(emb, args.dim)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    fleet.init_worker()
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.dense_parameters(), lr=args.dense_lr))
    out = open(args.out, "w", encoding="utf-8") if fleet.worker_index() == 0 else None

    def write(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()

    t0 = time.perf_counter()
    ds = fleet.InMemoryDataset()
    ds.init(
        batch_size=args.batch_size,
        thread_num=args.threads,
        use_var=[Slot(LABEL, dense=True), *(Slot(s) for s in SLOTS)],
        pipe_command="cat",
    )
    ds.set_filelist([f for f in args.files.split(",") if f])
    ds.load_into_memory()
    examples = int(ds.get_memory_data_size())
    load_s = time.perf_counter() - t0
    run_epoch = epoch_tfd if args.variant == "tfd" else epoch_loop
    try:
        for epoch in range(1, args.epochs + 1):
            t1 = time.perf_counter()
            auc = run_epoch(model, opt, ds, args.thread_num)
            train_s = time.perf_counter() - t1
            write(
                {
                    "epoch": epoch,
                    "examples": examples,
                    "load_s": load_s,
                    "train_s": train_s,
                    "examples_per_s": examples / train_s,
                    "auc": auc,
                }
            )
    except Exception as err:
        write({"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]})
        raise
    finally:
        if out is not None:
            out.close()
    fleet.stop_worker()


if __name__ == "__main__":
    sys.exit(main())
