"""DistributedEmbedding's fused multi-slot lookup against the per-slot path, trainer side.

The CTR shape of Paddle's PS examples: 26 sparse slots of one id per example, batch 512, dim 8,
sum pooling, all in one table. Per step and path, forward + backward of the same batch:

* fused: ``emb([s_0, ..., s_25])`` -- one layout, one dedup, one pull, one pooling, one
  ``[U, dim]`` gradient recorded for the push;
* per-slot: ``[emb(s) for s in slots]`` -- 26 of each.

Then the same loss on both (the 26 outputs concatenated, times a fixed ``[208, 1]`` weight,
summed) and ``backward()``, which ends in the communicator's ``record_sparse``. What is timed is
the trainer's work: the embedding's Python, the dedup, the pooling and its backward, the
communicator's pull and record calls. No RPC: the communicator is the job's real
``SyncCommunicator`` with an in-process client whose ``pull_sparse`` reads the rows from a
``ps_server`` table in this process, all rows created before timing (a pull of existing rows).
The push (``optimizer.step()``) is not timed: both paths push the same merged gradients.

``--batches`` distinct batches (more than the layout cache holds, so no step reuses an earlier
step's layout) are run per repetition and path, the two paths interleaved per repetition (the
first of the two alternating); one warm-up repetition. Median of ``--reps`` (>= 5) per-step
times (ms), [min .. max], ratio fused / per-slot. A second, informational row does the same with
multi-id slots (1-5 ids per bag, some empty bags). One torch thread.

Run: ``.venv/bin/python bench/bench_ps_fused_lookup.py [--reps 7] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Stats, report

SLOTS = 26
DIM = 8


class _LocalClient:
    """What the communicator calls on its client, answered by an in-process table."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        return self.table.pull(keys)


def make_batches(n: int, batch: int, rng: np.random.Generator, multi: bool) -> list[dict[str, Any]]:
    """``n`` batches of :data:`SLOTS` sparse slots (fleet.data's SparseBatch). Slot ``s`` draws
    from a vocabulary of 10 .. 10^6 ids (CTR slots differ that much), its own key range."""
    from fleet.data.batch import SparseBatch

    out = []
    for _ in range(n):
        slots = {}
        for s in range(SLOTS):
            lengths = rng.integers(0, 6, batch) if multi else np.ones(batch, np.int64)
            vocab = 10 ** (1 + s % 6)
            ids = (s << 40) + rng.integers(0, vocab, int(lengths.sum()))
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            slots[f"C{s + 1}"] = SparseBatch(
                torch.from_numpy(ids.astype(np.int64)),
                torch.from_numpy(lengths.astype(np.int64)),
                torch.from_numpy(offsets.astype(np.int64)),
            )
        out.append(slots)
    return out


def measure(batch: int, batches: int, reps: int, multi: bool) -> tuple[Stats, Stats, int]:
    """(fused, per-slot) milliseconds per step, and the mean unique keys per step."""
    from fleet.ps.communicator import SyncCommunicator
    from fleet.ps.embedding import DistributedEmbedding
    from fleet.ps.runtime import lookups_from
    from ps_server.core.factory import make_table

    emb = DistributedEmbedding(f"ctr_{'multi' if multi else 'one'}", DIM, pooling="sum")
    table = make_table(emb.table_config())
    comm = SyncCommunicator(_LocalClient(table), 1, lambda: None)
    comm.add_table(emb.table, DIM, 0.01)
    data = make_batches(batches, batch, np.random.default_rng(0), multi)
    uniq = []
    for b in data:  # every row exists before timing
        keys = np.unique(np.concatenate([s.values.numpy() for s in b.values()]))
        table.pull(keys)
        uniq.append(keys.shape[0])
    weight = torch.randn(SLOTS * DIM, 1, generator=torch.Generator().manual_seed(0))

    def fused(slots: dict[str, Any]) -> list[torch.Tensor]:
        return emb(list(slots.values()))

    def per_slot(slots: dict[str, Any]) -> list[torch.Tensor]:
        return [emb(s) for s in slots.values()]

    def run(path: Any) -> float:
        total = 0.0
        for b in data:
            t0 = time.perf_counter()
            outs = path(b)
            (torch.cat(outs, dim=1) @ weight).sum().backward()
            total += time.perf_counter() - t0
            comm.pending = {}  # what optimizer.step() would push: not timed
        return total / len(data) * 1e3  # ms per step

    times: dict[Any, list[float]] = {fused: [], per_slot: []}
    with lookups_from(comm):
        for rep in range(reps + 1):
            order = (fused, per_slot) if rep % 2 == 0 else (per_slot, fused)
            for path in order:
                t = run(path)
                if rep > 0:  # the first repetition warms up
                    times[path].append(t)
    comm.close()
    return Stats.of(times[fused]), Stats.of(times[per_slot]), int(np.mean(uniq))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.reps < 5:
        p.error("--reps must be >= 5")
    torch.set_num_threads(1)
    rows = []
    extra: dict[str, Any] = {"batch": args.batch, "slots": SLOTS, "dim": DIM}
    for multi in (False, True):
        f, s, uniq = measure(args.batch, args.batches, args.reps, multi)
        kind = "multi-id (0-5 ids per bag)" if multi else "one-id"
        label = (
            f"{SLOTS} {kind} slots, batch {args.batch}, dim {DIM}: fused vs per-slot "
            "forward + backward per step"
        )
        rows.append((label, f, s, "fused / per-slot, lower is better"))
        extra[f"unique_keys_per_step_{'multi' if multi else 'one'}"] = uniq
    report(
        "DistributedEmbedding: fused multi-slot lookup vs one call per slot (trainer side)",
        rows,
        "one-id row: ratio <= 0.5",
        extra=extra,
        json_path=args.json,
        unit="ms",
    )


if __name__ == "__main__":
    main()
