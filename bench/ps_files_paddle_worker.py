"""The Paddle side of ``bench/bench_ps_files.py``: PaddlePaddle 2.6.2's own parameter server
trains a few epochs over one set of MultiSlot files (run by ``python -m
paddle.distributed.launch --server_num 1 --trainer_num 1`` under ``bench/.venv-paddle26``;
imports neither torch nor fleet).

Model: 26 one-id slots, each a ``sparse_embedding`` of dim 8 on the PS (one table ``emb``;
with one id per slot the sum pooling is the row itself), concatenated (26 x 8 = 208) into an
MLP 64-32-2 (dense Adam on the server), softmax cross-entropy on the 2 logits, async
(``strategy.a_sync = True``). The files are loaded once into an ``InMemoryDataset``
(``thread_num`` = ``--threads``; timed apart, excluded from examples/s); then per epoch one
``exe.train_from_dataset(program, dataset, thread=--threads)``, timed alone, and the AUC of the
softmax's class-1 probability from ``paddle.static.auc``'s histograms over that epoch (read,
then zeroed, after the call). Trainer 0 writes one JSON line per epoch to ``--out`` and a last
``{"done": true}``: Paddle 2.6.2's ``fleet.stop_worker()`` does not return here, so the bench
stops the job once it sees that line.

Paddle 2.6.2 needs protobuf 3.20 with PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python here, and
its ``DistributedStrategy.__repr__`` imports protobuf's C extension (absent): it is replaced
below before anything prints a strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

import numpy as np  # noqa: E402
import paddle  # noqa: E402

paddle.enable_static()
import paddle.distributed.fleet as fleet  # noqa: E402
from paddle.distributed.fleet.base.distributed_strategy import DistributedStrategy  # noqa: E402

DistributedStrategy.__repr__ = lambda self: f"DistributedStrategy(a_sync={self.a_sync})"

NUM_SPARSE = 26


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--files", required=True, help="comma-separated MultiSlot files")
    p.add_argument("--out", required=True, help="JSON lines, one per epoch (trainer 0)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="dataset and train_from_dataset threads")
    p.add_argument("--batch_size", type=int, default=512)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--sparse_lr", type=float, default=0.05)
    p.add_argument("--dense_lr", type=float, default=1e-3)
    p.add_argument(
        "--shard_num", type=int, default=64, help="sparse table shards (Paddle's CPU default: 1000)"
    )
    return p.parse_args()


def build(args: argparse.Namespace):
    """The program's inputs (``use_var`` order: click, 1 .. 26), loss and AUC statistics."""
    label = paddle.static.data(name="click", shape=[-1, 1], dtype="int64", lod_level=0)
    # one id per slot: a dense [B, 1] int64 slot (with LoD slots and sequence_pool the sparse
    # rows did not learn under Paddle 2.6.2's PS: bench_ps_paddle_worker.py)
    sparse = [
        paddle.static.data(name=str(i), shape=[-1, 1], dtype="int64", lod_level=0)
        for i in range(1, NUM_SPARSE + 1)
    ]
    embs = []
    for slot in sparse:
        emb = paddle.static.nn.sparse_embedding(
            input=slot,
            size=[1 << 20, args.dim],
            param_attr=paddle.ParamAttr(
                name="emb", initializer=paddle.nn.initializer.Normal(0.0, 0.05)
            ),
        )
        embs.append(paddle.reshape(emb, [-1, args.dim]))
    x = paddle.concat(embs, axis=1)
    for width in (64, 32):
        x = paddle.static.nn.fc(x, width, activation="relu")
    logits = paddle.static.nn.fc(x, 2)
    loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, label))
    prob = paddle.nn.functional.softmax(logits)
    _, _, stats = paddle.static.auc(input=prob, label=label, num_thresholds=4095)
    return [label, *sparse], loss, stats


def auc_of(stats) -> tuple[float, int]:
    """AUC from the accumulated histograms (4096 buckets) and the examples in them, then
    zeroed for the next epoch."""
    scope = paddle.static.global_scope()
    pos = np.array(scope.find_var(stats[2].name).get_tensor()).reshape(-1).astype(np.float64)
    neg = np.array(scope.find_var(stats[3].name).get_tensor()).reshape(-1).astype(np.float64)
    for var in stats:
        t = scope.find_var(var.name).get_tensor()
        t.set(np.zeros_like(np.array(t)), paddle.CPUPlace())
    area = tp = fp = 0.0
    for i in range(len(pos) - 1, -1, -1):
        ntp, nfp = tp + pos[i], fp + neg[i]
        area += (nfp - fp) * (tp + ntp) / 2
        tp, fp = ntp, nfp
    return (float(area / (tp * fp)) if tp * fp > 0 else float("nan")), int(tp + fp)


def sparse_table_config(args: argparse.Namespace) -> dict:
    """The ``emb`` table: 64 shards (ours' default) and Paddle's default sparse rule
    (SparseAdaGradSGDRule) with the settings bench_ps_paddle_worker.py explains: its rule is made
    for batch-summed gradients and the loss here is a batch mean, so its learning rate is
    ``sparse_lr * batch_size``."""
    t = "table_parameters.emb."
    table: dict = {t + "shard_num": args.shard_num}
    for part in ("embed_sgd_param", "embedx_sgd_param"):
        table[f"{t}accessor.{part}.name"] = "SparseAdaGradSGDRule"
        table[f"{t}accessor.{part}.adagrad.learning_rate"] = args.sparse_lr * args.batch_size
        table[f"{t}accessor.{part}.adagrad.initial_range"] = (
            0.05 if part == "embedx_sgd_param" else 0.0
        )
        table[f"{t}accessor.{part}.adagrad.initial_g2sum"] = 3.0
        table[f"{t}accessor.{part}.adagrad.weight_bounds"] = [-10.0, 10.0]
    return table


def main() -> None:
    args = parse_args()
    fleet.init()
    strategy = DistributedStrategy()
    strategy.a_sync = True
    strategy.sparse_table_configs = {"emb": sparse_table_config(args)}
    use_var, loss, stats = build(args)
    opt = fleet.distributed_optimizer(paddle.optimizer.Adam(args.dense_lr), strategy)
    opt.minimize(loss)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(paddle.static.default_startup_program())
    fleet.init_worker()
    program = paddle.static.default_main_program()
    out = open(args.out, "w") if fleet.worker_index() == 0 else None
    t0 = time.perf_counter()
    ds = paddle.distributed.InMemoryDataset()
    ds.init(
        batch_size=args.batch_size, thread_num=args.threads, use_var=use_var, pipe_command="cat"
    )
    ds.set_filelist([f for f in args.files.split(",") if f])
    ds.load_into_memory()
    examples = int(ds.get_memory_data_size())
    load_s = time.perf_counter() - t0
    for epoch in range(1, args.epochs + 1):
        t1 = time.perf_counter()
        exe.train_from_dataset(program, ds, thread=args.threads, debug=False)
        train_s = time.perf_counter() - t1
        auc, counted = auc_of(stats)
        record = {
            "epoch": epoch,
            "examples": examples,
            "load_s": load_s,
            "train_s": train_s,
            "examples_per_s": examples / train_s,
            "auc": auc,
            "auc_examples": counted,  # == examples: the threads' histograms are the shared ones
        }
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()
        print(json.dumps(record), flush=True)
    if out is not None:  # Paddle 2.6.2's stop_worker does not return here: the bench stops the job
        out.write(json.dumps({"done": True}) + "\n")
        out.flush()
    fleet.stop_worker()


if __name__ == "__main__":
    sys.exit(main())
