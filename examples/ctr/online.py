"""Online CTR training over day/pass folders of slot files: ``fleetrun -c configs/ctr_online.yaml``.

The loop of ``fleet.train_days`` (:mod:`fleet.streaming`): for each day, for each pass folder
(``data_root/<day>/<pass>/part-*``, written by ``examples/ctr/gen_slot_files.py --days ...
--passes ...``), the model's AUC on the pass before training on it (progressive validation),
one pass of ``fleet.train_from_dataset`` over a ``fleet.data`` dataset of this trainer's files,
a delta save; at the end of a day ``end_day``, ``shrink`` and a base. Started again with the same
``--output_dir`` it resumes after the last save its donefile records. Rank 0 prints a line per
pass (progressive AUC, train AUC, examples/s) and, with ``--json``, writes one JSON line per pass.
Under fleetrun's ``--ps_checkpoint_dir`` (``ps_checkpoint:`` in ``configs/ctr_online.yaml``) the
job checkpoints itself at every pass boundary and recovers from a dead server or trainer with no
change here (``fleet.train_days`` does it; docs/ps/online-training.md).

The model (also the Paddle side of ``bench/bench_ps_paddle.py``): the 26 one-id slots pulled from
one ``DistributedEmbedding`` (dim ``--embedding_dim``, Adagrad on the servers, sum-pooled per
slot), concatenated with the 13 dense values into an MLP (``--hidden``, default 64-32) and a
logit; dense parameters Adam on the servers. One script for both roles (Paddle style).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet
from examples.ctr.slots import DENSE_SLOT, LABEL_SLOT, NUM_DENSE, SPARSE_SLOTS, make_slots
from ps_server import Adagrad, Normal

logger = logging.getLogger("ctr_online")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_root", required=True, help="day folders of pass folders of slot files")
    p.add_argument(
        "--output_dir",
        required=True,
        help="deltas, bases and the donefile (under the servers' checkpoint roots)",
    )
    p.add_argument("--days", default="", help="comma-separated days to train (default: all)")
    p.add_argument("--dataset", choices=["inmemory", "queue"], default="inmemory")
    p.add_argument(
        "--pipe_command",
        default="cat",
        help='dataset pipe_command; "python examples/ctr/reader.py" for PaddleRec lines',
    )
    p.add_argument("--reader_threads", type=int, default=1, help="dataset thread_num")
    p.add_argument("--batch_size", type=int, default=512, help="per-trainer batch")
    p.add_argument("--embedding_dim", type=int, default=8)
    p.add_argument("--hidden", default="64,32", help="MLP widths")
    p.add_argument("--sparse_lr", type=float, default=0.05)
    p.add_argument("--dense_lr", type=float, default=1e-3)
    p.add_argument(
        "--mode",
        choices=["sync", "async"],
        default="async",
        help="sync needs the same number of batches on every trainer",
    )
    p.add_argument("--shrink_unseen_days", type=int, default=30, help="-1: no shrink")
    p.add_argument("--no_progressive", action="store_true", help="skip progressive validation")
    p.add_argument(
        "--no_delta",
        action="store_true",
        help="no delta save after each pass (only the day's base)",
    )
    p.add_argument(
        "--checkpoint_dir",
        default="",
        help="also a job checkpoint (fleet.ps.checkpoint) after every save",
    )
    p.add_argument("--max_passes", type=int, default=None, help="stop after this many passes")
    p.add_argument("--print_period", type=int, default=100)
    p.add_argument(
        "--prefetch",
        type=int,
        default=1,
        help="async: pull the next batch's rows during this step (1) or not (0)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="rank 0 appends one JSON line per pass here")
    return p.parse_args(argv)


class SlotCTR(nn.Module):
    """Sum-pooled embeddings of the sparse slots + the dense slot -> MLP -> one logit. Takes a
    ``fleet.data`` batch (slot name -> tensor / jagged slot) without the label."""

    def __init__(self, embedding: nn.Module, dim: int, hidden: list[int]) -> None:
        super().__init__()
        self.embedding = embedding
        layers: list[nn.Module] = []
        width = len(SPARSE_SLOTS) * dim + NUM_DENSE
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        pooled = self.embedding([batch[name] for name in SPARSE_SLOTS])  # one pull for all slots
        x = torch.cat([*pooled, batch[DENSE_SLOT]], dim=1)
        return self.mlp(x).reshape(-1)

    def dense_parameters(self) -> list[nn.Parameter]:
        return list(self.mlp.parameters())


def bce_loss(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Logistic loss of the logits against the int64 ``click`` slot."""
    return nn.functional.binary_cross_entropy_with_logits(
        output, label.reshape(-1).to(output.dtype)
    )


def make_dataset_factory(args: argparse.Namespace):
    """``files -> dataset`` for one pass: loaded when in memory, streamed otherwise."""

    def make(files: list[str]) -> Iterable[Mapping[str, Any]]:
        ds = (
            fleet.data.InMemoryDataset()
            if args.dataset == "inmemory"
            else fleet.data.QueueDataset()
        )
        ds.init(
            batch_size=args.batch_size,
            thread_num=args.reader_threads,
            use_var=make_slots(),
            pipe_command=args.pipe_command,
        )
        ds.set_filelist(files)
        if args.dataset == "inmemory":
            ds.load_into_memory()
        return ds

    return make


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = args.mode == "async"
    fleet.init(is_collective=False, strategy=strategy)
    torch.manual_seed(args.seed)
    hidden = [int(h) for h in args.hidden.split(",") if h]
    emb = fleet.DistributedEmbedding(
        "ctr_emb",
        args.embedding_dim,
        optimizer=Adagrad(args.sparse_lr),
        initializer=Normal(0.0, 0.05),
        pooling="sum",
    )
    model = SlotCTR(emb, args.embedding_dim, hidden)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    fleet.init_worker()
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.dense_parameters(), lr=args.dense_lr))
    config = fleet.StreamingConfig(
        data_root=args.data_root,
        output_dir=args.output_dir,
        days=tuple(d for d in args.days.split(",") if d),
        progressive_validation=not args.no_progressive,
        save_delta=not args.no_delta,
        shrink_unseen_days=None if args.shrink_unseen_days < 0 else args.shrink_unseen_days,
        checkpoint_dir=args.checkpoint_dir,
        label=LABEL_SLOT,
        print_period=args.print_period,
        max_passes=args.max_passes,
    )
    rank0 = fleet.worker_index() == 0

    def on_pass(result: fleet.PassResult) -> None:
        if rank0 and args.json:
            record = {
                "day": result.day,
                "pass": result.pass_id,
                "examples": result.examples,
                "progressive_auc": result.progressive_auc,
                "train_auc": result.train_auc,
                "train_s": result.train_seconds,
                "pass_s": result.pass_seconds,
                "train_examples_per_s": result.examples_per_second,
                "pass_examples_per_s": result.examples / result.pass_seconds,
                "delta": result.save_path,
                "mode": args.mode,
                "trainers": fleet.worker_num(),
                "servers": fleet.server_num(),
            }
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def prefetch(batch: Mapping[str, Any]) -> None:  # the next batch's rows during this step
        emb.prefetch([batch[name] for name in SPARSE_SLOTS])

    trainer = fleet.StreamingTrainer(
        model,
        opt,
        bce_loss,
        make_dataset_factory(args),
        config,
        on_pass=on_pass,
        prefetch=prefetch if args.prefetch and args.mode == "async" else None,
    )
    trainer.run()
    fleet.stop_worker()


if __name__ == "__main__":
    main()
