"""Wide & deep CTR as a heterogeneous PS job: ``fleetrun -c configs/ctr_heter.yaml``.

The model of :mod:`examples.ctr.train_ps`, cut in two (``fleet.heter.HeterModel``):

* **CPU trainers** generate their share of the data and run the embeddings: the wide rows (dim 1)
  summed over the slots (pooling) and the deep rows flattened next to the dense features. These
  ``DistributedEmbedding`` tables live on the parameter servers (Adagrad there).
* **The heter worker** runs the dense network: ``wide + dense_linear(dense) + MLP(deep)``, its
  backward and the update of its parameters (Adam, on the servers' dense table
  ``__heter_dense__``), on its device (``--heter_devices``; cpu on this machine).

One script for every role. Rank 0 prints a JSON line::

    {"examples_per_s": ..., "test_auc": ..., "bayes_auc": ..., "mode": "sync", ...}

Same data, initialisation and learning rates as the one-process baseline and ``train_ps.py``,
so the AUCs compare directly.

``--server_cpus``, ``--trainer_cpus`` and ``--heter_cpus`` pin each role's process to CPUs
(``"1"``, ``"0,2-3"``) when it starts: on one host, a heter worker on cores of its own stands in
for the device machine (``--heter_cpus 1 --server_cpus 0 --trainer_cpus 0``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet
from collective.errors import ConfigError
from examples.ctr.data import CTRDataConfig, generate, roc_auc, shard
from examples.ctr.model import WideDeep
from examples.ctr.train_ps import tensor_batches
from ps_server import Adagrad, Constant, Normal

logger = logging.getLogger("ctr_heter")


class CpuHalf(nn.Module):
    """The CPU trainers' half: embeddings and pooling. Activations: the deep input
    ``[B, slots * dim + dense]``, the pooled wide term ``[B]`` and the dense features."""

    def __init__(self, model: WideDeep) -> None:
        super().__init__()
        self.wide, self.deep = model.wide, model.deep

    def forward(
        self, ids: torch.Tensor, dense: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wide = self.wide(ids).sum(dim=(1, 2))
        return torch.cat([self.deep(ids).flatten(1), dense], dim=1), wide, dense


class DeviceHalf(nn.Module):
    """The heter worker's half: the dense linear term and the MLP."""

    def __init__(self, model: WideDeep) -> None:
        super().__init__()
        self.dense_linear, self.mlp = model.dense_linear, model.mlp

    def forward(
        self, deep_in: torch.Tensor, wide: torch.Tensor, dense: torch.Tensor
    ) -> torch.Tensor:
        return wide + self.dense_linear(dense).squeeze(-1) + self.mlp(deep_in).squeeze(-1)


ROLES = ("server", "trainer", "heter")


def parse_cpus(text: str, option: str = "cpus") -> set[int]:
    """A CPU list as ``taskset -c`` writes it (``"1"``, ``"0,2-3"``) as a set of CPU numbers."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ConfigError(
            f"{text!r} is not a CPU list; write CPU numbers and ranges, e.g. 1 or 0,2-3",
            key=option,
        ) from None
    return cpus


def role_cpus(args: argparse.Namespace, role: str) -> set[int] | None:
    """The CPUs ``role`` (``server``, ``trainer`` or ``heter``) is pinned to; None: not pinned."""
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; one of {', '.join(ROLES)}", key="role")
    text = getattr(args, f"{role}_cpus")
    return parse_cpus(text, f"--{role}_cpus") if text else None


def pin_role(args: argparse.Namespace, role: str) -> set[int] | None:
    """Pin every thread of this process to ``role``'s CPUs (``taskset -a``); the threads it
    starts later inherit them. Returns the CPUs, None when the role is not pinned."""
    cpus = role_cpus(args, role)
    if cpus is None:
        return None
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ConfigError(
            f"CPUs {sorted(cpus - allowed)} are not among this process's CPUs {sorted(allowed)}; "
            "pick CPUs from those (see nproc, taskset -p)",
            key=f"--{role}_cpus",
        )
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread, inherited by the threads it starts
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended
            pass
    return cpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", type=int, default=200_000, help="global training examples")
    p.add_argument("--test", type=int, default=50_000, help="global held-out examples")
    p.add_argument("--batch_size", type=int, default=512, help="global batch (split over trainers)")
    p.add_argument("--embedding_dim", type=int, default=16)
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 128], help="MLP widths")
    p.add_argument("--sparse_lr", type=float, default=0.05)
    p.add_argument("--dense_lr", type=float, default=1e-3)
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument(
        "--max_in_flight",
        type=int,
        default=2,
        help="async: micro-batches a trainer keeps at its heter worker (the staleness bound)",
    )
    p.add_argument(
        "--dense_pull_interval",
        type=int,
        default=8,
        help="async: the heter worker pulls the servers' dense values every this many pushes",
    )
    p.add_argument(
        "--intra_op_threads",
        type=int,
        default=0,
        help="a CPU heter worker's intra-op threads (0: the CPUs it may use)",
    )
    for role, what in (
        ("server", "the parameter servers"),
        ("trainer", "the CPU trainers"),
        ("heter", "the heter workers"),
    ):
        p.add_argument(
            f"--{role}_cpus",
            default="",
            metavar="LIST",
            help=f"pin {what} to these CPUs, e.g. 1 or 0,2-3 (default: not pinned)",
        )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write rank 0's result here")
    return p.parse_args(argv)


def make_strategy(args: argparse.Namespace) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    if args.mode == "async":
        s.a_sync = True
        s.heter_configs = {
            "max_in_flight": args.max_in_flight,
            "dense_pull_interval": args.dense_pull_interval,
            "intra_op_threads": args.intra_op_threads,
        }
    return s


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    fleet.init(is_collective=False, strategy=make_strategy(args))
    role = "server" if fleet.is_server() else "heter" if fleet.is_heter_worker() else "trainer"
    cpus = pin_role(args, role)
    if cpus is not None:
        logger.info("%s pinned to CPUs %s", role, ",".join(map(str, sorted(cpus))))
    torch.manual_seed(args.seed)

    def embedding(num_slots: int, dim: int) -> nn.Module:
        init = Constant(0.0) if dim == 1 else Normal(0.0, 0.05)  # as the baseline
        return fleet.DistributedEmbedding(
            f"ctr_dim{dim}", dim, optimizer=Adagrad(args.sparse_lr), initializer=init
        )

    data = CTRDataConfig(seed=args.seed)
    whole = WideDeep(
        data.num_slots, data.num_dense, args.embedding_dim, args.hidden, embedding_factory=embedding
    )
    model = fleet.heter.HeterModel(CpuHalf(whole), DeviceHalf(whole), nn.BCEWithLogitsLoss())
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    if fleet.is_heter_worker():
        opt = torch.optim.Adam(model.device_part.parameters(), lr=args.dense_lr)
        fleet.run_heter_worker(model, opt)
        return

    fleet.init_worker()
    rank, world = fleet.worker_index(), fleet.worker_num()
    local_batch = max(args.batch_size // world, 1)
    start, held = shard(args.train, rank, world)
    steps = held // local_batch
    if args.mode == "sync":  # lockstep: every trainer ends at the same step
        steps = int(fleet.metrics.min(steps))
    batches = tensor_batches(generate(data, steps * local_batch, start), local_batch)
    fleet.barrier_worker()
    t0 = time.perf_counter()
    examples = 0
    for step, (ids, dense, labels) in enumerate(batches):
        loss = model.train_step((ids, dense), labels)
        examples += labels.shape[0]
        if loss is not None:
            fleet.report(loss=loss, samples=labels.shape[0])
        if rank == 0 and step % 100 == 0 and loss is not None:
            logger.info("step %d/%d loss %.4f", step, steps, float(loss))
    model.flush()  # async: the micro-batches still in flight
    seconds = fleet.metrics.max(time.perf_counter() - t0)
    trained = fleet.metrics.sum(examples)
    fleet.barrier_worker()

    t_start, t_count = shard(args.test, rank, world)
    test = generate(data, t_count, args.train + t_start)
    state = fleet.metrics.AucState()
    with torch.no_grad():
        for lo in range(0, t_count, 8192):
            logits = model(
                torch.from_numpy(test.sparse_ids[lo : lo + 8192]),
                torch.from_numpy(test.dense[lo : lo + 8192]),
            )
            state.update(torch.sigmoid(logits), test.labels[lo : lo + 8192])
    auc = fleet.metrics.auc(state.stat_pos, state.stat_neg)
    bayes = float(fleet.metrics.sum(roc_auc(test.probs, test.labels))) / world
    if rank == 0:
        result = {
            "mode": args.mode,
            "trainers": world,
            "servers": fleet.server_num(),
            "heter_workers": fleet.heter_worker_num(),
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
