"""The Paddle side of ``bench/bench_ps_paddle.py``: PaddlePaddle 2.6.2's own parameter server
trains the day/pass stream of slot files (run by ``python -m paddle.distributed.launch
--server_num 1 --trainer_num 1`` under ``bench/.venv-paddle26``; imports neither torch nor
fleet).

The model is the bench's simple CTR model: 26 one-id slots, each a ``sparse_embedding`` of dim
8 on the PS (Adagrad, the accessor's default rule), concatenated with the 13 dense values into an
MLP 64-32-1 (dense Adam on the server), async (``strategy.a_sync = True``). Per pass, as the
online loop of ``examples/ctr/online.py``: load the pass's files into an ``InMemoryDataset``
(timed apart: parsing is excluded from examples/s), progressive AUC (``infer_from_dataset``
before training), ``train_from_dataset``, a delta save (``fleet.save_persistables(exe, dir,
mode=1)``); at the end of a day a base (mode 0) and ``fleet.shrink``. With ``--donefile 1``
trainer 0 appends one line per save to ``OUTPUT_DIR/donefile.txt`` after it returns (``day  pass
path  kind``, pass -1 for a base; what a restarted Paddle online job reads to find the last base
and the deltas after it, as ``FleetUtil.write_model_donefile`` records them). The trainer writes
one JSON line per pass to ``--out``.

Paddle 2.6.2 needs protobuf 3.20 with PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python here, and
its ``DistributedStrategy.__repr__`` imports protobuf's C extension (absent): it is replaced
below before anything prints a strategy.
"""

from __future__ import annotations

import argparse
import glob
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
NUM_DENSE = 13


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--days", required=True, help="comma-separated day folders")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--out", required=True, help="JSON lines, one per pass (trainer 0)")
    p.add_argument("--batch_size", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--sparse_lr", type=float, default=0.05)
    p.add_argument("--dense_lr", type=float, default=1e-3)
    p.add_argument("--shrink", type=int, default=1, help="shrink at the end of each day (0: off)")
    p.add_argument("--print_period", type=int, default=0, help="print the loss every N batches")
    p.add_argument("--sparse_lod", type=int, default=0, help="1: LoD id slots + sequence_pool")
    p.add_argument(
        "--shard_num", type=int, default=64, help="sparse table shards (Paddle's CPU default: 1000)"
    )
    p.add_argument(
        "--donefile",
        type=int,
        default=0,
        help="1: append a donefile line after each save (the recovery record)",
    )
    p.add_argument(
        "--optimizer",
        choices=["adam", "sgd", "adagrad"],
        default="adam",
        help="dense optimizer (Paddle's PS derives the sparse rule from it too)",
    )
    return p.parse_args()


def build(args: argparse.Namespace):
    label = paddle.static.data(name="click", shape=[-1, 1], dtype="int64", lod_level=0)
    # one id per slot: a dense [B, 1] int64 slot (with LoD slots and sequence_pool the sparse
    # rows did not learn under Paddle 2.6.2's PS here: AUC stayed ~0.5)
    lod = 1 if args.sparse_lod else 0
    sparse = [
        paddle.static.data(name=str(i), shape=[-1, 1], dtype="int64", lod_level=lod)
        for i in range(1, NUM_SPARSE + 1)
    ]
    dense = paddle.static.data(name="dense_feature", shape=[-1, NUM_DENSE], dtype="float32")
    embs = []
    for slot in sparse:
        emb = paddle.static.nn.sparse_embedding(
            input=slot,
            size=[1 << 20, args.dim],
            param_attr=paddle.ParamAttr(
                name="emb", initializer=paddle.nn.initializer.Normal(0.0, 0.05)
            ),
        )
        if lod:
            embs.append(paddle.static.nn.sequence_lod.sequence_pool(emb, pool_type="sum"))
        else:
            embs.append(paddle.reshape(emb, [-1, args.dim]))
    x = paddle.concat(embs + [dense], axis=1)
    for width in (64, 32):
        x = paddle.static.nn.fc(x, width, activation="relu")
    logit = paddle.static.nn.fc(x, 1)
    prob = paddle.nn.functional.sigmoid(logit)
    loss = paddle.mean(
        paddle.nn.functional.binary_cross_entropy_with_logits(logit, paddle.cast(label, "float32"))
    )
    auc_var, _, stats = paddle.static.auc(
        input=paddle.concat([1 - prob, prob], axis=1), label=label, num_thresholds=4095
    )
    return [label, *sparse, dense], loss, stats, auc_var


def auc_of(stats) -> float:
    """AUC from the accumulated (global) histograms, then zeroed for the next phase."""
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
    return float(area / (tp * fp)) if tp * fp > 0 else float("nan")


def append_donefile(output_dir: str, day: str, pass_id: str, path: str, kind: str) -> None:
    """One donefile line for a completed save (fsynced: a restart must find it)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "donefile.txt"), "a", encoding="utf-8") as f:
        f.write(f"{day}\t{pass_id}\t{path}\t{kind}\n")
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    args = parse_args()
    fleet.init()
    strategy = DistributedStrategy()
    strategy.a_sync = True
    t = "table_parameters.emb."
    table = {t + "shard_num": args.shard_num}  # ours: 64 shards per table
    # Paddle's default sparse rule (SparseAdaGradSGDRule: w -= lr * g * sqrt(g2sum0 / (g2sum0 +
    # g2sum)), g2sum0 = 3) is made for batch-summed gradients; the loss here is a batch mean, so
    # its learning rate is sparse_lr * batch_size (with sparse_lr alone the rows barely moved and
    # the AUC stayed ~0.5; StdAdaGradSGDRule with g2sum0 = 0 drove every row to the bound -10).
    for part in ("embed_sgd_param", "embedx_sgd_param"):
        table[f"{t}accessor.{part}.name"] = "SparseAdaGradSGDRule"
        table[f"{t}accessor.{part}.adagrad.learning_rate"] = args.sparse_lr * args.batch_size
        table[f"{t}accessor.{part}.adagrad.initial_range"] = (
            0.05 if part == "embedx_sgd_param" else 0.0
        )
        table[f"{t}accessor.{part}.adagrad.initial_g2sum"] = 3.0
        table[f"{t}accessor.{part}.adagrad.weight_bounds"] = [-10.0, 10.0]
    strategy.sparse_table_configs = {"emb": table}
    use_var, loss, stats, auc_var = build(args)
    make = {
        "adam": paddle.optimizer.Adam,
        "sgd": paddle.optimizer.SGD,
        "adagrad": paddle.optimizer.Adagrad,
    }[args.optimizer]
    opt = fleet.distributed_optimizer(make(args.dense_lr), strategy)
    opt.minimize(loss)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(paddle.static.default_startup_program())
    fleet.init_worker()
    main_program = paddle.static.default_main_program()
    out = open(args.out, "w") if fleet.worker_index() == 0 else None
    days = [d for d in args.days.split(",") if d]
    for day in days:
        passes = sorted(
            p
            for p in os.listdir(os.path.join(args.data_root, day))
            if os.path.isdir(os.path.join(args.data_root, day, p))
        )
        for pass_id in passes:
            files = sorted(glob.glob(os.path.join(args.data_root, day, pass_id, "part-*")))
            t0 = time.perf_counter()
            ds = paddle.distributed.InMemoryDataset()
            ds.init(
                batch_size=args.batch_size,
                thread_num=args.threads,
                use_var=use_var,
                pipe_command="cat",
            )
            ds.set_filelist(files)
            ds.load_into_memory()
            examples = int(ds.get_memory_data_size())
            t1 = time.perf_counter()
            exe.infer_from_dataset(main_program, ds, thread=args.threads)
            pv_auc = auc_of(stats)
            t2 = time.perf_counter()
            exe.train_from_dataset(
                main_program,
                ds,
                thread=args.threads,
                debug=False,
                **(
                    {
                        "fetch_list": [loss, auc_var],
                        "fetch_info": ["loss", "auc"],
                        "print_period": args.print_period,
                    }
                    if args.print_period
                    else {}
                ),
            )
            t3 = time.perf_counter()
            train_auc = auc_of(stats)
            delta = os.path.join(args.output_dir, day, f"delta-{pass_id}")
            fleet.save_persistables(exe, delta, mode=1)
            if args.donefile and out is not None:
                append_donefile(args.output_dir, day, pass_id, delta, "delta")
            t4 = time.perf_counter()
            ds.release_memory()
            record = {
                "day": day,
                "pass": pass_id,
                "examples": examples,
                "load_s": t1 - t0,
                "pv_s": t2 - t1,
                "train_s": t3 - t2,
                "save_s": t4 - t3,
                "progressive_auc": pv_auc,
                "train_auc": train_auc,
                "train_examples_per_s": examples / (t3 - t2),
                "pass_examples_per_s": examples / (t4 - t1),
            }
            if out is not None:
                out.write(json.dumps(record) + "\n")
                out.flush()
            print(json.dumps(record), flush=True)
        if args.shrink:
            fleet.shrink(args.shrink)
        base = os.path.join(args.output_dir, day, "base")
        fleet.save_persistables(exe, base, mode=0)
        if args.donefile and out is not None:
            append_donefile(args.output_dir, day, "-1", base, "base")
    if out is not None:  # Paddle 2.6.2's stop_worker can hang here: the bench stops the job
        out.write(json.dumps({"done": True}) + "\n")
        out.flush()
    fleet.stop_worker()
    if out is not None:
        out.close()


if __name__ == "__main__":
    sys.exit(main())
