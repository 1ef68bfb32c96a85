"""Wide & deep CTR training on the parameter server: ``fleetrun -c configs/ctr_ps.yaml``.

One script for both roles (Paddle style). Servers hold the two embedding tables (wide: dim 1,
deep: dim ``--embedding_dim``; raw 64-bit ids, no hashing into a fixed table) and the dense MLP
(Adam on the servers); trainers each generate their contiguous share of one global synthetic
dataset (:mod:`examples.ctr.data`) -- or, with ``--data_dir`` / ``--files``, read their share of
slot files (``fleet.util.get_file_shard``; files from ``examples/ctr/gen_slot_files.py``) through a
``fleet.data`` InMemoryDataset or QueueDataset -- train with the strategy's mode, and evaluate AUC
with ``fleet.metrics`` over the union of their test shares. Rank 0 prints a JSON line::

    {"examples_per_s": ..., "test_auc": ..., "bayes_auc": ..., "mode": "sync", ...}

``--storage ssd --cache_rows N`` keeps at most N rows of each table per server in memory and the
others on the servers' disks (fleetrun ``--ps_ssd_dir DIR``; ``configs/ctr_ps_ssd.yaml``).
``--pass_cache`` trains the files' pass against a trainer-local copy of its rows
(``fleet.begin_pass`` / ``fleet.end_pass``: one pull and one push per table for the pass).

Same model, data, initialisation scales and learning rates as the single-process baseline
(``python -m examples.ctr.baseline``), so the AUCs compare directly.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet
from examples.ctr.data import CTRBatch, CTRDataConfig, generate, roc_auc, shard
from examples.ctr.model import WideDeep
from examples.ctr.slots import batch_to_inputs, make_slots
from fleet.base import data_position
from ps_server import SGD, Adagrad, Constant, Normal

logger = logging.getLogger("ctr_ps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--train",
        type=int,
        default=200_000,
        help="global training examples (generated; ignored with --data_dir / --files)",
    )
    p.add_argument(
        "--data_dir",
        default="",
        help="train from the part-* slot files here instead of generated examples",
    )
    p.add_argument("--files", nargs="+", default=None, help="slot files (instead of --data_dir)")
    p.add_argument(
        "--dataset",
        choices=["inmemory", "queue"],
        default="inmemory",
        help="fleet.data dataset reading the files",
    )
    p.add_argument(
        "--pipe_command",
        default="cat",
        help='dataset pipe_command; "python examples/ctr/reader.py" for PaddleRec lines',
    )
    p.add_argument("--reader_threads", type=int, default=2, help="dataset thread_num")
    p.add_argument("--test", type=int, default=50_000, help="global held-out examples")
    p.add_argument("--batch_size", type=int, default=512, help="global batch (split over trainers)")
    p.add_argument("--embedding_dim", type=int, default=16)
    p.add_argument("--sparse_lr", type=float, default=0.05)
    p.add_argument("--dense_lr", type=float, default=1e-3)
    p.add_argument("--mode", choices=["sync", "async", "half_async", "geo"], default="sync")
    p.add_argument("--geo_k", type=int, default=10)
    p.add_argument(
        "--geo_sparse_lr",
        type=float,
        default=2.0,
        help="GEO trains rows locally with plain SGD: it needs a larger lr than Adagrad",
    )
    p.add_argument(
        "--max_merge",
        type=int,
        default=1,
        help="async: steps merged into one send (a_sync_configs.max_merge_var_num)",
    )
    p.add_argument(
        "--prefetch",
        type=int,
        default=1,
        help="async modes: pull the next batch's rows during this step (1) or not (0)",
    )
    p.add_argument(
        "--storage",
        choices=["memory", "ssd"],
        default="memory",
        help="where the tables' rows live: ssd = hot rows in memory, cold rows on the servers' "
        "disks (fleetrun --ps_ssd_dir)",
    )
    p.add_argument(
        "--cache_rows",
        type=int,
        default=0,
        help="--storage ssd: rows of each table one server keeps in memory",
    )
    p.add_argument(
        "--pass_cache",
        action="store_true",
        help="pull the pass's rows once into the trainer, train there, push the deltas once at "
        "its end (a_sync_configs.use_ps_gpu); needs --data_dir / --files, --dataset inmemory",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="save the tables here at the end")
    p.add_argument("--json", default="", help="also write rank 0's result here")
    args = p.parse_args(argv)
    if args.storage == "ssd" and args.cache_rows < 1:
        p.error("--storage ssd needs --cache_rows N (N >= 1 rows per table per server in memory)")
    if args.storage == "memory" and args.cache_rows:
        p.error("--cache_rows is for --storage ssd")
    if (
        args.pass_cache
        and not (args.data_dir or args.files)
        or (args.pass_cache and args.dataset != "inmemory")
    ):
        p.error(
            "--pass_cache builds the pass from a loaded InMemoryDataset: give --data_dir or "
            "--files (and --dataset inmemory)"
        )
    return args


def make_strategy(args: argparse.Namespace) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    if args.mode != "sync":
        s.a_sync = True
        s.a_sync_configs = {"max_merge_var_num": args.max_merge}
    if args.mode == "half_async":
        s.a_sync_configs = {"barrier_interval": 20}
    if args.mode == "geo":
        s.a_sync_configs = {"k_steps": args.geo_k}
    if args.pass_cache:  # with --mode geo: the dense part local, exchanged every --geo_k steps
        s.a_sync_configs = {"use_ps_gpu": True}
    return s


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids [B, 26], dense [B, 13], labels [B]


def count_lines(paths: list[str]) -> int:
    """Lines (= examples) in ``paths``, ``.gz`` decompressed."""
    total = 0
    for path in paths:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                total += block.count(b"\n")
    return total


def file_batches(
    args: argparse.Namespace, local_batch: int
) -> tuple[int, int, Iterator[Batch], float, Any]:
    """(examples to train, examples in the files, batches, load seconds, the dataset) of this
    trainer's share of the slot files. The two counts differ when a fleetrun job with
    --ps_checkpoint_dir resumed: the dataset then skips (and does not count) what was trained
    before."""
    files = args.files or sorted(glob.glob(os.path.join(args.data_dir, "part-*")))
    if not files:
        raise SystemExit(
            f"no slot files: --files is empty and {args.data_dir!r} has no part-* "
            "files (write them with examples/ctr/gen_slot_files.py)"
        )
    mine = fleet.util.get_file_shard(files)
    ds = fleet.data.InMemoryDataset() if args.dataset == "inmemory" else fleet.data.QueueDataset()
    ds.init(
        batch_size=local_batch,
        thread_num=args.reader_threads,
        use_var=make_slots(),
        pipe_command=args.pipe_command,
    )
    ds.set_filelist(mine)
    t0 = time.perf_counter()
    if args.dataset == "inmemory":
        ds.load_into_memory()
        count, held = int(ds.get_memory_data_size()), len(ds)
    else:  # streamed while training: sync lockstep needs the step count before the first batch
        held = count_lines(mine)  # a resumed trainer's pass skips what it trained: not counted
        count = held - data_position.skip_examples(local_batch, held)
    return count, held, (batch_to_inputs(b) for b in ds), time.perf_counter() - t0, ds


def tensor_batches(train: CTRBatch, local_batch: int) -> Iterator[Batch]:
    """Consecutive ``local_batch`` slices of generated examples (the last partial one dropped)."""
    ids, dense, labels = (
        torch.from_numpy(train.sparse_ids),
        torch.from_numpy(train.dense),
        torch.from_numpy(train.labels),
    )
    for lo in range(0, len(train) - local_batch + 1, local_batch):
        yield (
            ids[lo : lo + local_batch],
            dense[lo : lo + local_batch],
            labels[lo : lo + local_batch],
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    fleet.init(is_collective=False, strategy=make_strategy(args))
    torch.manual_seed(args.seed)

    def embedding(num_slots: int, dim: int) -> torch.nn.Module:
        # wide rows start at 0 (a plain bias), deep rows N(0, 0.05): as the baseline
        init = Constant(0.0) if dim == 1 else Normal(0.0, 0.05)
        # GEO's local row copies train with plain SGD; a pass trains rows with their own rule
        geo_rows = args.mode == "geo" and not args.pass_cache
        rule = SGD(args.geo_sparse_lr) if geo_rows else Adagrad(args.sparse_lr)
        storage = {"storage": "ssd", "cache_rows": args.cache_rows} if args.storage == "ssd" else {}
        return fleet.DistributedEmbedding(
            f"ctr_dim{dim}", dim, optimizer=rule, initializer=init, **storage
        )

    data = CTRDataConfig(seed=args.seed)
    model = WideDeep(
        data.num_slots, data.num_dense, args.embedding_dim, (256, 128), embedding_factory=embedding
    )
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return

    fleet.init_worker()
    opt = fleet.distributed_optimizer(
        torch.optim.Adam(list(model.dense_parameters()), lr=args.dense_lr)
    )
    rank, world = fleet.worker_index(), fleet.worker_num()
    local_batch = max(args.batch_size // world, 1)
    from_files = bool(args.data_dir or args.files)
    load_seconds = 0.0
    ds = None
    if from_files:
        count, held, batches, load_seconds, ds = file_batches(args, local_batch)
        test_start = int(fleet.metrics.sum(held))  # the files hold examples 0 .. (gen_slot_files)
    else:
        start, held = shard(args.train, rank, world)
        # one pass over the generated examples: a trainer resumed under --ps_checkpoint_dir
        # skips the batches it trained, as the datasets do (fleet.base.data_position)
        skip = data_position.tracker().begin_pass()
        skip = held // local_batch if skip is None else skip
        count = held - skip * local_batch  # example i is a function of i: generate the rest only
        batches = tensor_batches(generate(data, count, start + skip * local_batch), local_batch)
        test_start = args.train
    steps = count // local_batch  # what this trainer's data has left (all of it on a fresh start)
    if args.mode in ("sync", "half_async"):
        # lockstep (sync) and barriers numbered by global step (half-async) need every trainer to
        # end at the same step: the fewest any trainer's data holds. A trainer resumed at its own
        # position (half-async under --ps_checkpoint_dir) trains up to there from it.
        total = held // local_batch
        steps -= total - int(fleet.metrics.min(total))
    # async/GEO: each trainer trains what its data has left
    loss_fn = torch.nn.BCEWithLogitsLoss()
    fleet.barrier_worker()
    t0 = time.perf_counter()
    examples = 0
    if args.pass_cache:  # keys of the pass -> one pull per table -> trainer-local rows
        fleet.begin_pass(ds, label="click")
    nxt = next(batches, None)
    for step in range(steps):
        if nxt is None:
            raise RuntimeError(
                f"the data ran out after {step} of {steps} batches: a dataset must "
                "yield full batches except the last one"
            )
        ids, dense, labels = nxt
        nxt = next(batches, None) if step + 1 < steps else None
        if args.prefetch and nxt is not None:  # async modes: the next batch's rows arrive
            for emb in model.embedding_modules():  # during this step
                emb.prefetch(nxt[0])
        loss = loss_fn(model(ids, dense), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        examples += labels.shape[0]
        fleet.report(loss=loss, samples=labels.shape[0])  # Prometheus / dashboard (no-op without)
        if rank == 0 and step % 100 == 0:
            logger.info("step %d/%d loss %.4f", step, steps, loss.item())
    if args.pass_cache:  # one delta push per table, then every trainer's deltas are in
        pass_stats = fleet.end_pass()
        if rank == 0:
            logger.info(
                "pass: %d sparse RPCs, begin %.2f s, end %.2f s, %s",
                pass_stats.rpcs,
                pass_stats.begin_seconds,
                pass_stats.end_seconds,
                pass_stats.tables,
            )
    seconds = fleet.metrics.max(time.perf_counter() - t0)
    trained = fleet.metrics.sum(examples)
    load_seconds = float(fleet.metrics.max(load_seconds))
    opt.comm.flush()  # async modes: the last updates are on the servers before evaluation
    fleet.barrier_worker()

    t_start, t_count = shard(args.test, rank, world)
    test = generate(data, t_count, test_start + t_start)
    state = fleet.metrics.AucState()
    model.eval()
    with torch.no_grad():
        for lo in range(0, t_count, 8192):
            p = torch.sigmoid(
                model(
                    torch.from_numpy(test.sparse_ids[lo : lo + 8192]),
                    torch.from_numpy(test.dense[lo : lo + 8192]),
                )
            )
            state.update(p, test.labels[lo : lo + 8192])
    auc = fleet.metrics.auc(state.stat_pos, state.stat_neg)
    bayes = roc_auc(test.probs, test.labels)  # this trainer's share; averaged below
    bayes = float(fleet.metrics.sum(bayes)) / world
    if args.save:
        fleet.save_persistables(args.save, mode=0)
    if rank == 0:
        result = {
            "mode": args.mode,
            "trainers": world,
            "servers": fleet.server_num(),
            "source": args.dataset if from_files else "tensors",
            "storage": args.storage,
            "pass_cache": args.pass_cache,
            "load_seconds": load_seconds,
            "examples": int(trained),
            "train_seconds": float(seconds),
            "examples_per_s": float(trained) / float(seconds),
            "test_auc": auc,
            "bayes_auc": bayes,
        }
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f)
    fleet.stop_worker()


if __name__ == "__main__":
    main()
