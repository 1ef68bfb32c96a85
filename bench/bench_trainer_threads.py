"""Would training threads inside one trainer (Paddle's ``thread_num`` hogwild workers) add
anything? The trainer-side step of the ``ps_files`` model on two Python threads against one.

What runs: the ``ps_files`` model (26 one-id slots of a ``DistributedEmbedding`` of dim 8,
sum-pooled, MLP 64-32-2, softmax cross-entropy, batch 512) over batches of the same MultiSlot
files, forward + backward + a local SGD step, each thread with its own model and its own
communicator whose client is an in-memory table (no servers, no RPC: the work a trainer's
threads would share the GIL for). One thread trains every batch; two threads each train every
other batch at the same time. Interleaved per repetition, examples/s of the whole set, median of
``--reps`` with min/max, ratio two threads / one. torch runs one intra-op thread (as fleetrun
sets ``OMP_NUM_THREADS=1`` when processes share a node): torch releases the GIL inside its ops,
so the threads overlap where the step is in torch and serialise where it is in Python.

This bounds what threads could give from above: in a job the server and the trainer's sender
and prefetch threads take their share of the same cores. Usage::

    python bench/bench_trainer_threads.py [--reps 5] [--lines 50000] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
from bench_ps_files import write_files
from common import Stats, report
from ps_files_worker import LABEL, SLOTS, SlotsMLP

import fleet
from fleet.data import Slot
from fleet.ps.communicator import Communicator
from fleet.ps.runtime import lookups_from

ROWS = 1 << 20


class LocalTable:
    """A PS client over one in-memory table (a pull is a gather, as a server's would be)."""

    def __init__(self) -> None:
        self.rows = np.random.default_rng(0).normal(0, 0.05, (ROWS, 8)).astype(np.float32)

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        return self.rows[keys % ROWS]


class LocalCommunicator(Communicator):
    """Pulls from the local table; a step drops the recorded row gradients (no servers)."""

    def step(self) -> None:
        self.pending.clear()


def train(batches: list[Any], comm: Communicator, name: str) -> None:
    """One model over ``batches``: forward, backward, SGD step."""
    with lookups_from(comm):
        model = SlotsMLP(fleet.DistributedEmbedding(name, 8, pooling="sum"), 8)
        loss_fn = torch.nn.CrossEntropyLoss()
        opt = torch.optim.SGD(model.dense_parameters(), lr=1e-3)
        for batch in batches:
            out = model({k: v for k, v in batch.items() if k != LABEL})
            loss = loss_fn(out, batch[LABEL].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()


def run(batches: list[Any], threads: int, rep: int) -> float:
    """Examples/s of ``threads`` threads training every ``threads``-th batch each."""
    parts = [batches[i::threads] for i in range(threads)]
    comms = []
    for i in range(threads):
        comm = LocalCommunicator(LocalTable(), 1, lambda: None)
        comm.add_table(f"emb_{rep}_{threads}_{i}", 8, 0.05)
        comms.append(comm)
    workers = [
        threading.Thread(target=train, args=(part, comm, f"emb_{rep}_{threads}_{i}"))
        for i, (part, comm) in enumerate(zip(parts, comms))
    ]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(len(b[LABEL]) for b in batches) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--lines", type=int, default=50_000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.reps < 5:
        p.error("--reps must be >= 5")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        files = write_files(work, 1, args.lines)
        ds = fleet.InMemoryDataset()
        ds.init(
            batch_size=512,
            thread_num=2,
            use_var=[Slot(LABEL, dense=True)] + [Slot(s) for s in SLOTS],
        )
        ds.set_filelist(files)
        ds.load_into_memory()
        batches = list(ds)
    train(batches[:20], LocalCommunicator(LocalTable(), 1, lambda: None), "warmup")
    one, two = [], []
    for rep in range(args.reps):
        order = (1, 2) if rep % 2 == 0 else (2, 1)
        for n in order:
            (one if n == 1 else two).append(run(batches, n, rep))
        print(f"[trainer_threads] rep {rep}: 1 thread {one[-1]:.0f} ex/s, 2 threads {two[-1]:.0f}")
    report(
        "Trainer threads: the ps_files step on 2 threads vs 1 (in-process, no servers)",
        [("train examples/s, 2 threads vs 1", Stats.of(two), Stats.of(one), "2 threads / 1")],
        goal="informational: > 1 means threads would add throughput",
        extra={"batches": len(batches), "lines": args.lines},
        json_path=args.json,
        unit="ex/s",
    )


if __name__ == "__main__":
    main()
