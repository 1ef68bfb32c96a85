"""Memory per row and pull/push throughput of the parameter-server sparse table, same run.

Builds a ``SparseTable`` (dim 8, Adagrad) of 1 M rows with three key indexes and prints

* bytes per row — the table's own accounting (``memory_bytes``: allocated capacity of every
  array) and what ``tracemalloc`` sees — against the payload (key 8 B + values 4*dim + Adagrad
  g2sum 4*dim + count 4 B + unseen_days 2 B = 78 B), as a ratio (goal <= 1.5);
* pull / push rows per second at 64k-key batches (random existing keys, distinct per batch) and
  pull-with-create rows per second (64k new keys), median [min .. max] of >= 5 repetitions, the
  indexes timed alternately within each repetition so machine load hits all alike.

Indexes: ``HashIndex`` (chosen: numpy open addressing), ``DictIndex`` (a Python dict key -> row,
the plain peer) and ``SortedIndex`` below (sorted keys + searchsorted, inserts merged in; defined
here only to measure the option).

Usage: ``python bench/bench_ps_memory.py [--rows 1000000] [--batch 65536] [--reps 7] [--json PATH]``
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Stats, machine_info

from ps_server import Adagrad, SparseTable, SparseTableConfig, Uniform
from ps_server.core.hash_index import DictIndex, HashIndex

DIM = 8


class SortedIndex:
    """Sorted keys + row ids, looked up with searchsorted; inserts merged in (O(table) each)."""

    def __init__(self) -> None:
        self._keys = np.zeros(0, dtype=np.int64)
        self._rows = np.zeros(0, dtype=np.int32)

    @property
    def memory_bytes(self) -> int:
        return int(self._keys.nbytes + self._rows.nbytes)

    def lookup(self, query: np.ndarray, stored_keys: np.ndarray) -> np.ndarray:
        if self._keys.shape[0] == 0:
            return np.full(query.shape[0], -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._keys, query), self._keys.shape[0] - 1)
        hit = self._keys[pos] == query
        return np.where(hit, self._rows[pos], -1).astype(np.int64)

    def insert(self, query: np.ndarray, rows: np.ndarray, stored_keys: np.ndarray) -> None:
        order = np.argsort(query)
        pos = np.searchsorted(self._keys, query[order])
        self._keys = np.insert(self._keys, pos, query[order])
        self._rows = np.insert(self._rows, pos, rows[order].astype(np.int32))

    def remove(self, query: np.ndarray, stored_keys: np.ndarray) -> np.ndarray:
        rows = self.lookup(query, stored_keys)
        keep = ~np.isin(self._keys, query)
        self._keys, self._rows = self._keys[keep], self._rows[keep]
        return rows

    def rebuild(self, rows: np.ndarray, stored_keys: np.ndarray) -> None:
        keys = stored_keys[rows]
        order = np.argsort(keys)
        self._keys, self._rows = keys[order], rows[order].astype(np.int32)


INDEXES: dict[str, Callable[[], Any]] = {
    "hash (chosen)": HashIndex,
    "dict": DictIndex,
    "sorted": SortedIndex,
}


def make_table(factory: Callable[[], Any]) -> SparseTable:
    cfg = SparseTableConfig("bench", DIM, Adagrad(lr=0.05), Uniform(-0.01, 0.01), num_shards=64)
    return SparseTable(cfg, index_factory=factory)


def fill(table: SparseTable, keys: np.ndarray, batch: int) -> float:
    """Pull every key once (creating its row); returns seconds."""
    t0 = time.perf_counter()
    for i in range(0, keys.shape[0], batch):
        table.pull(keys[i : i + batch])
    return time.perf_counter() - t0


def measure_memory(name: str, keys: np.ndarray, batch: int) -> dict[str, float]:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    table = make_table(INDEXES[name])
    fill(table, keys, batch)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    n = table.num_rows
    payload = table.payload_bytes_per_row()
    return {
        "rows": n,
        "payload_B": payload,
        "accounted_B": table.memory_bytes / n,
        "traced_B": traced / n,
        "ratio_accounted": table.memory_bytes / n / payload,
        "ratio_traced": traced / n / payload,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    keys = np.unique(
        rng.integers(
            np.iinfo(np.int64).min, np.iinfo(np.int64).max, args.rows, dtype=np.int64, endpoint=True
        )
    )
    keys = rng.permutation(keys)
    info = machine_info()
    print(
        f"== ps_server sparse table: memory per row and pull/push throughput ==  "
        f"({info['date']}, {info['cpus']} CPUs, python {info['python']}, numpy {np.__version__})"
    )
    print(f"rows {keys.shape[0]}, dim {DIM}, Adagrad, batch {args.batch}, reps {args.reps}\n")

    memory = {}
    for name in INDEXES:
        memory[name] = measure_memory(name, keys, args.batch)
        m = memory[name]
        print(
            f"memory  {name:14s} payload {m['payload_B']:.0f} B/row | accounted "
            f"{m['accounted_B']:.1f} B/row = {m['ratio_accounted']:.3f}x | tracemalloc "
            f"{m['traced_B']:.1f} B/row = {m['ratio_traced']:.3f}x   (goal <= 1.5x)"
        )
    print()

    tables = {}
    build_s = {}
    for name, factory in INDEXES.items():
        tables[name] = make_table(factory)
        build_s[name] = fill(tables[name], keys, args.batch)
    timings: dict[str, dict[str, list[float]]] = {
        n: {"pull": [], "push": [], "create": []} for n in INDEXES
    }
    for rep in range(args.reps):
        batch_keys = keys[rng.choice(keys.shape[0], args.batch, replace=False)]
        grads = rng.standard_normal((args.batch, DIM)).astype(np.float32) * 0.01
        new_keys = rng.integers(
            np.iinfo(np.int64).min, np.iinfo(np.int64).max, args.batch, dtype=np.int64
        )
        order = list(INDEXES) if rep % 2 == 0 else list(INDEXES)[::-1]
        for name in order:
            t = tables[name]
            t0 = time.perf_counter()
            t.pull(batch_keys)
            t1 = time.perf_counter()
            t.push(batch_keys, grads)
            t2 = time.perf_counter()
            t.pull(new_keys)
            t3 = time.perf_counter()
            timings[name]["pull"].append(args.batch / (t1 - t0))
            timings[name]["push"].append(args.batch / (t2 - t1))
            timings[name]["create"].append(args.batch / (t3 - t2))
    results: dict[str, Any] = {
        "machine": info,
        "rows": int(keys.shape[0]),
        "dim": DIM,
        "batch": args.batch,
        "memory": memory,
        "throughput": {},
    }
    for op in ("pull", "push", "create"):
        print(f"{op:6s} rows/s (64k-key batches{', new keys' if op == 'create' else ''})")
        ref = Stats.of(timings["hash (chosen)"][op])
        for name in INDEXES:
            s = Stats.of(timings[name][op])
            results["throughput"].setdefault(name, {})[op] = {
                "median": s.median,
                "min": s.min,
                "max": s.max,
                "n": s.n,
            }
            ratio = ref.median / s.median
            print(f"  {name:14s} {s.fmt('M rows/s', 1e-6, 2)}   hash/this = {ratio:.2f}x")
    print(
        "\nbuild (1 pull per key, 64k batches): "
        + ", ".join(f"{n} {s:.2f} s" for n, s in build_s.items())
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
