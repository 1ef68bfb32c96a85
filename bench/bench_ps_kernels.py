"""Sparse-table kernels: the compiled path (ps_server/core/_kernels.c) against the numpy path, same
process, same table contents, same key batches.

One step = ``pull`` of 64k keys then ``push`` of their gradients (Adagrad, the CTR rule) on a
1 M-row table, in-process (no RPC): the work a server does per request. The two paths run on two
tables built from the same keys, interleaved per repetition so load drift hits both alike.
Median of ``--reps`` (>= 5), [min .. max], ratio compiled / numpy (keys/s). A second row per dim
times the compiled path with its work split over ``--threads`` table threads (default: the
servers' default, the usable CPUs up to 8) against one thread, on the same table.

Row creation (compiled path, dim 8, the default ``Uniform(-0.01, 0.01)`` initializer, whose
values are a pure function of table, seed and key; Adagrad and Adam): a table of
``--create-rows`` rows (1 M) grows to twice that by pulls of 64k keys it does not hold yet
(each pull creates its rows: initial values, optimizer state, count / unseen_days / flags, index
entries, and the row arrays' and the index's amortised growth over one doubling), interleaved
batch by batch with *updates*: pushes of gradients to 64k distinct rows the table already holds
(probe, optimizer rule, write-back; keys not just pulled, so the lookup is not remembered).
One repetition = one fresh table grown from N to 2N; the row reads creation keys/s against
update keys/s, so ``ratio >= 0.667`` is "creating a row costs at most 1.5x an update".

Run: ``.venv/bin/python bench/bench_ps_kernels.py [--json bench/results/ps_kernels.json]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Stats, report

BATCH = 64 * 1024
ROWS = 1_000_000


def creation_rows(n: int, reps: int) -> list[tuple[str, Stats, Stats, str]]:
    """Creation (pulls of new keys) against update (pushes to existing rows), see the module
    docstring; one row per optimizer rule."""
    from ps_server import Adagrad, Adam, SparseTable, SparseTableConfig, Uniform
    from ps_server.core import kernels

    kernels.ENABLED = True
    kernels.set_threads(1)
    rng = np.random.default_rng(1)
    out = []
    for rule in (Adagrad(0.05), Adam(0.001)):
        config = SparseTableConfig("c8", 8, rule, Uniform(-0.01, 0.01))
        create: list[float] = []
        update: list[float] = []
        for _ in range(reps + 1):  # the first repetition warms up
            t = SparseTable(config)
            held = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)
            for lo in range(0, n, BATCH):
                t.pull(held[lo : lo + BATCH])
            fresh = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)
            order = rng.permutation(n)
            grads = rng.standard_normal((BATCH, 8), dtype=np.float32)
            tc = tu = 0.0
            for lo in range(0, n, BATCH):
                t0 = time.perf_counter()
                t.pull(fresh[lo : lo + BATCH])
                t1 = time.perf_counter()
                keys = held[order[lo : lo + BATCH]]
                t.push(keys, grads[: keys.shape[0]])
                tc, tu = tc + t1 - t0, tu + time.perf_counter() - t1
            assert t.num_rows == 2 * n
            create.append(n / tc / 1e6)
            update.append(n / tu / 1e6)
            del t
        out.append(
            (
                f"dim 8, {rule.TYPE}, uniform init: create rows (pull of {BATCH} new keys, "
                f"{n} -> {2 * n} rows) vs update (push to {BATCH} held rows)",
                Stats.of(create[1:]),
                Stats.of(update[1:]),
                "creation/update keys/s",
            )
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", default="8,16,64")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--create-rows", type=int, default=ROWS, help="rows before growth (creation)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.reps < 5:
        p.error("--reps must be >= 5")
    from ps_server import Adagrad, SparseTable, SparseTableConfig, Uniform
    from ps_server.core import kernels
    from ps_server.server import default_table_threads

    threads = args.threads or default_table_threads()

    if kernels._c is None:
        sys.exit("the C kernels are not built (no compiler at install time): nothing to compare")
    rows = creation_rows(args.create_rows, args.reps)
    rng = np.random.default_rng(0)
    universe = rng.integers(-(2**63), 2**63 - 1, size=ROWS, dtype=np.int64)
    for dim in (int(d) for d in args.dims.split(",")):
        config = SparseTableConfig(f"k{dim}", dim, Adagrad(0.05), Uniform(-0.01, 0.01))
        tables = {}
        for fast in (True, False):
            kernels.ENABLED = fast
            t = tables[fast] = SparseTable(config)
            for lo in range(0, ROWS, BATCH):
                t.pull(universe[lo : lo + BATCH])
        batches = [
            (rng.choice(universe, BATCH), rng.standard_normal((BATCH, dim), dtype=np.float32))
            for _ in range(4)
        ]
        variants = {"compiled": (True, 1), "numpy": (False, 1), "threads": (True, threads)}
        rates: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.reps):
            for name, (fast, n) in variants.items():
                kernels.ENABLED = fast
                kernels.set_threads(n)
                t = tables[fast]
                t0 = time.perf_counter()
                for i in range(args.steps):
                    keys, grads = batches[i % len(batches)]
                    t.pull(keys)
                    t.push(keys, grads)
                rates[name].append(args.steps * BATCH / (time.perf_counter() - t0) / 1e6)
        label = f"dim {dim}, {ROWS} rows, adagrad, pull+push of {BATCH} keys (with repeats)"
        rows.append(
            (label, Stats.of(rates["compiled"]), Stats.of(rates["numpy"]), "compiled/numpy keys/s")
        )
        rows.append(
            (
                f"{label}: {threads} table threads vs 1",
                Stats.of(rates["threads"]),
                Stats.of(rates["compiled"]),
                "threads/1 thread keys/s",
            )
        )
    kernels.ENABLED = kernels._c is not None
    kernels.set_threads(1)
    report(
        "sparse table pull+push: compiled kernels vs numpy path",
        rows,
        goal="(speed-up; creation: >= 0.667)",
        json_path=args.json,
        unit="M keys/s",
    )


if __name__ == "__main__":
    main()
