"""SSD sparse tables against the memory table and against RocksDB's own limit, same run.

One process, in-process tables (no gRPC), dim 8, Adagrad, ``--rows`` N keys created first:

* **(a) Zipf(1.1) ids**: rounds of 65 536 ids drawn with repetition from Zipf(1.1) over the N
  keys (hot keys spread over the key space by a random permutation), as a trainer's batch holds
  them; the round's distinct keys (the client deduplicates before its RPC) are pulled, then
  pushed. keys/s counts the 65 536 drawn ids of a round on both sides. The SSD table
  (``cache_rows`` = 1 % of N, at least 2 rounds of ids) against the memory table holding all N
  rows. The SSD table's time includes writing every row its rounds evicted (``flush`` at the
  end). Also reported: the distinct keys of a round, the share of the pulled keys found in
  memory, and the share a cache holding exactly the ``cache_rows`` most probable keys would
  find (the best any policy can do on these rounds).
* **(b) uniform ids**: rounds of 65 536 distinct uniform keys (almost all on disk). The SSD
  table against the engine's limit: on a RocksDB of N rows with the same options and record
  size, one ``multi_get`` of the round's keys plus one write batch of their packed rows (what a
  round must at least read and write), keys/s.
* **(c) footprint**: RSS growth per row while the SSD table is filled (against the memory
  table's), its bytes on disk per row against the payload (key 8 B + values 4*dim + Adagrad
  g2sum 4*dim + count 4 B + unseen_days 2 B = 78 B), and the fill rate (rows created per second
  by 64k-key pulls) against the memory table's.

* **(d) key filter**: the fill rate of an SSD table with its key filter against the same table
  whose filter lets every key through (each new key then costs a RocksDB read), on the first
  ``--filter_rows`` keys, alternately (printed and in the JSON's extra fields).

Each timing is the median [min .. max] of ``--reps`` repetitions (a repetition: ``--rounds``
rounds), the table and its peer timed alternately within each repetition. The Zipf repetitions
come first, after ``--warmup_rounds`` untimed Zipf rounds (the stream's steady state: the fill
leaves the last keys created in memory), then the uniform ones.

Usage: ``python bench/bench_ps_ssd.py [--rows 4000000] [--reps 5] [--rounds 3] [--json PATH]``;
``--quick`` (10^6 rows, 2 rounds a repetition). The capacity goal's sizes (10^8 rows, ``cache_rows``
10^6) are ``bench/bench_ps_ssd_capacity.py``'s.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Stats, report

from ps_server import Adagrad, SparseTableConfig, Uniform, make_table
from ps_server.core.routing import shard_of
from ps_server.core.ssd_filter import KeyFilter
from ps_server.core.ssd_tier import key_bytes, open_rocksdb, record_dtype

DIM = 8
ROUND = 65536
ZIPF_A = 1.1
PAYLOAD_B = 8 + 4 * DIM + 4 * DIM + 4 + 2


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def config(name: str, cache_rows: int | None) -> SparseTableConfig:
    extra = {"storage": "ssd", "cache_rows": cache_rows} if cache_rows else {}
    return SparseTableConfig(
        name, dim=DIM, optimizer=Adagrad(lr=0.05), initializer=Uniform(-0.01, 0.01), **extra
    )


class KeyStreams:
    """The benchmark's N keys (random int64s) and its rounds of distinct keys."""

    def __init__(self, rows: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.keys = np.unique(self.rng.integers(1, 2**62, size=int(rows * 1.01), dtype=np.int64))
        self.keys = self.rng.permutation(self.keys)[:rows]  # rank r of Zipf = keys[r]
        ranks = np.arange(1, rows + 1, dtype=np.float64)
        cdf = np.cumsum(ranks**-ZIPF_A)
        self.cdf = cdf / cdf[-1]

    def zipf(self) -> np.ndarray:
        """The distinct keys of 65 536 ids drawn with repetition from Zipf(1.1) over the ranks
        (a batch's ids, deduplicated as the client does before its RPC)."""
        draws = np.searchsorted(self.cdf, self.rng.random(ROUND))
        self.last_ranks = np.unique(np.minimum(draws, self.keys.shape[0] - 1))
        """Zipf ranks (0: the most probable key) of the last round's distinct keys."""
        return self.keys[self.last_ranks]

    def uniform(self) -> np.ndarray:
        """65 536 distinct keys, uniform over the N keys."""
        return self.keys[self.rng.choice(self.keys.shape[0], ROUND, replace=False)]


def fill(table, keys: np.ndarray) -> float:  # noqa: ANN001 - a SparseTable or SsdSparseTable
    """Create every key (64k-key pulls); the seconds it took (an SSD table's queued writes
    included)."""
    t0 = time.perf_counter()
    for lo in range(0, keys.shape[0], ROUND):
        table.pull(keys[lo : lo + ROUND])
    settle(table)
    return time.perf_counter() - t0


def settle(table) -> None:  # noqa: ANN001
    """An SSD table writes what its background thread has not written yet (so a timing holds
    every write it caused, and none runs into the peer's timing)."""
    if hasattr(table, "flush"):
        table.flush()


def round_trips(table, rounds: list[np.ndarray], grads: np.ndarray) -> None:  # noqa: ANN001
    """Rounds of ``pull`` + ``push`` of each round's keys (then :func:`settle`)."""
    for keys in rounds:
        table.pull(keys)
        table.push(keys, grads[: keys.shape[0]])
    settle(table)


class EngineLimit:
    """A RocksDB of N rows with the SSD tier's options and record size, driven as the tier
    drives it (one ``multi_get`` of the keys in RocksDB's order, one write batch of packed
    records; no per-key Python)."""

    def __init__(self, path: str, keys: np.ndarray, itemsize: int) -> None:
        import rocksdict as rd

        self.rd, self.itemsize = rd, itemsize
        self.num_shards = config("limit", None).num_shards
        self.db = open_rocksdb(rd, path)
        record = np.zeros(ROUND, dtype=f"V{itemsize}")
        for lo in range(0, keys.shape[0], ROUND):
            part = keys[lo : lo + ROUND]
            self.write(part, record[: part.shape[0]])

    def key_bytes(self, keys: np.ndarray) -> list[bytes]:
        return key_bytes(keys, self.num_shards)  # the tier's keys: shard, then key

    def write(self, keys: np.ndarray, records: np.ndarray) -> None:
        batch = self.rd.WriteBatch(raw_mode=True)
        deque(map(batch.put, self.key_bytes(keys), records.tolist()), maxlen=0)
        self.db.write(batch)

    def rounds(self, rounds: list[np.ndarray]) -> None:
        """Read each round's rows and write them back: what a round must do on disk."""
        for keys in rounds:
            order = np.lexsort((keys.view(np.uint64), shard_of(keys, self.num_shards)))
            keys = keys[order]  # RocksDB's key order
            blobs = self.db.get(self.key_bytes(keys))
            found = [b for b in blobs if b is not None]
            records = np.frombuffer(b"".join(found), dtype=f"V{self.itemsize}")
            self.write(keys[: records.shape[0]], records)

    def close(self) -> None:
        self.db.close()


class PassThrough(KeyFilter):
    """A key filter that lets every key through (the table without a filter)."""

    def may_contain(self, keys: np.ndarray) -> np.ndarray:
        return np.ones(keys.shape[0], dtype=bool)


def filter_ab(keys: np.ndarray, cache: int, root: str, reps: int) -> dict[str, list[float]]:
    """Rows created per second (M) with the key filter and without, alternately."""
    out: dict[str, list[float]] = {"with": [], "without": []}
    for rep in range(reps):
        for name in ("with", "without"):
            table = make_table(config(f"ab_{name}_{rep}", cache), ssd_root=root)
            if name == "without":
                table.keyfilter = PassThrough()
                table._new_filter = PassThrough  # clear / rebuilds keep it
            out[name].append(keys.shape[0] / fill(table, keys) * 1e-6)
            table.close()
            shutil.rmtree(os.path.join(root, f"ab_{name}_{rep}"), ignore_errors=True)
    return out


def timed(fn: Callable[..., None], *args: object) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4_000_000, help="keys in the table (N)")
    p.add_argument(
        "--cache_rows", type=int, default=0, help="SSD cache (default: 1%% of N, >= 2 rounds)"
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="rounds timed per repetition")
    p.add_argument(
        "--warmup_rounds", type=int, default=30, help="untimed Zipf rounds before the timed ones"
    )
    p.add_argument("--dir", default="", help="where the RocksDB files go (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="1 000 000 rows, rounds of 2")
    p.add_argument(
        "--filter_rows", type=int, default=500_000, help="keys of the key-filter comparison"
    )
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.rounds = 1_000_000, 2
        args.warmup_rounds = min(args.warmup_rounds, 10)
    cache = args.cache_rows or max(args.rows // 100, 2 * ROUND)
    root = tempfile.mkdtemp(prefix="bench_ps_ssd_", dir=args.dir or None)
    try:
        run(args, cache, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, cache: int, root: str) -> None:
    streams = KeyStreams(args.rows)
    keys = streams.keys
    grads = np.random.default_rng(1).normal(0, 0.01, (ROUND, DIM)).astype(np.float32)
    print(f"N = {args.rows:,} rows, cache_rows = {cache:,}, rounds of {ROUND:,} keys", flush=True)

    gc.collect()
    rss0 = rss_bytes()
    ssd = make_table(config("ssd_bench", cache), ssd_root=root)
    ssd_fill = fill(ssd, keys)
    gc.collect()
    ssd_rss = rss_bytes() - rss0
    ssd.cold.flush()  # the memtable into SST files: the bytes a reader of the dir sees
    ssd_disk = ssd.stats()["ssd_bytes"]
    print(
        f"SSD table filled: {ssd_fill:.1f} s, RSS +{ssd_rss / 2**20:.0f} MiB, "
        f"disk {ssd_disk / 2**20:.0f} MiB",
        flush=True,
    )
    rss1 = rss_bytes()
    mem = make_table(config("mem_bench", None))
    mem_fill = fill(mem, keys)
    gc.collect()
    mem_rss = rss_bytes() - rss1
    print(f"memory table filled: {mem_fill:.1f} s, RSS +{mem_rss / 2**20:.0f} MiB", flush=True)
    limit = EngineLimit(
        os.path.join(root, "limit"), keys, record_dtype(DIM, ssd.state_dim).itemsize
    )

    zipf_ssd: list[float] = []
    zipf_mem: list[float] = []
    uni_ssd: list[float] = []
    uni_limit: list[float] = []
    hits = misses = pull_hits = 0
    best_hits: list[float] = []
    distinct: list[int] = []
    per_rep = args.rounds * ROUND
    # the Zipf stream's steady state: the fill leaves the last keys created in memory, not the
    # stream's hot keys; untimed rounds first, and every Zipf repetition before the uniform
    # ones (which would replace half the cache with keys the Zipf stream hardly ever asks for)
    t0 = time.perf_counter()
    round_trips(ssd, [streams.zipf() for _ in range(args.warmup_rounds)], grads)
    print(f"{args.warmup_rounds} untimed Zipf rounds: {time.perf_counter() - t0:.1f} s", flush=True)
    for rep in range(args.reps):
        zipf_rounds = []
        for _ in range(args.rounds):
            zipf_rounds.append(streams.zipf())
            best_hits.append(float((streams.last_ranks < cache).mean()))
            distinct.append(int(zipf_rounds[-1].shape[0]))
        zipf_keys = sum(k.shape[0] for k in zipf_rounds)
        before = ssd.stats()
        zipf_ssd.append(per_rep / timed(round_trips, ssd, zipf_rounds, grads))
        after = ssd.stats()
        hits += after["hot_hits"] - before["hot_hits"]
        misses += after["hot_misses"] - before["hot_misses"]
        pull_hits += after["hot_hits"] - before["hot_hits"] - zipf_keys  # pushes always hit
        zipf_mem.append(per_rep / timed(round_trips, mem, zipf_rounds, grads))
        print(f"rep {rep}: zipf ssd {zipf_ssd[-1]:,.0f} mem {zipf_mem[-1]:,.0f} keys/s", flush=True)
    for rep in range(args.reps):
        uni_rounds = [streams.uniform() for _ in range(args.rounds)]
        uni_ssd.append(per_rep / timed(round_trips, ssd, uni_rounds, grads))
        uni_limit.append(per_rep / timed(limit.rounds, uni_rounds))
        print(
            f"rep {rep}: uniform ssd {uni_ssd[-1]:,.0f} limit {uni_limit[-1]:,.0f} keys/s",
            flush=True,
        )
    hit_rate = hits / max(hits + misses, 1)
    pull_hit_rate = pull_hits / max(sum(distinct), 1)
    best_pull_hit_rate = float(np.mean(best_hits))
    filter_stats = {k: ssd.stats()[k] for k in ("filter_skips", "cold_misses", "filter_keys")}
    filter_stats.update(filter_bytes=ssd.stats()["filter_bytes"])
    limit.close()
    ssd.close()
    ab_rows = min(args.filter_rows, args.rows)
    ab = filter_ab(keys[:ab_rows], min(cache, max(ab_rows // 100, 2 * ROUND)), root, 3)
    print(
        f"key filter: rows created per second with {Stats.of(ab['with']).fmt('M')}, "
        f"without {Stats.of(ab['without']).fmt('M')} ({ab_rows:,} rows); {filter_stats}",
        flush=True,
    )

    m = 1e-6
    rows = [
        (
            f"Zipf({ZIPF_A}) pull+push keys/s (64k drawn ids a round), SSD table (cache "
            f"{100 * cache / args.rows:.1f} % of N) vs memory table",
            Stats.of([x * m for x in zipf_ssd]),
            Stats.of([x * m for x in zipf_mem]),
            "ssd/memory, higher is better",
        ),
        (
            "uniform pull+push keys/s, SSD table vs RocksDB multi_get + write batch",
            Stats.of([x * m for x in uni_ssd]),
            Stats.of([x * m for x in uni_limit]),
            "ssd/engine limit, higher is better",
        ),
        (
            "RSS growth per row, SSD table vs memory table",
            Stats.of([ssd_rss / args.rows]),
            Stats.of([mem_rss / args.rows]),
            "ssd/memory, lower is better",
        ),
        (
            "disk bytes per row, SSD table vs payload",
            Stats.of([ssd_disk / args.rows]),
            Stats.of([float(PAYLOAD_B)]),
            "disk/payload, lower is better",
        ),
        (
            "rows created per second (64k-key pulls), SSD table vs memory table",
            Stats.of([args.rows / ssd_fill * m]),
            Stats.of([args.rows / mem_fill * m]),
            "ssd/memory, higher is better",
        ),
    ]
    report(
        f"SSD sparse table, {args.rows:,} rows, dim {DIM}, Adagrad, in-process",
        rows,
        "Zipf >= 0.6x memory; uniform >= 0.5x engine limit; disk <= 1.5x payload "
        "(RSS <= 1.5 GB at 10^8 rows)",
        extra={
            "rows_n": args.rows,
            "cache_rows": cache,
            "round_keys": ROUND,
            "zipf_round_ids": ROUND,
            "zipf_distinct_keys_per_round": float(np.mean(distinct)),
            "zipf_hot_hit_rate": hit_rate,
            "zipf_pull_hit_rate": pull_hit_rate,
            "zipf_best_pull_hit_rate": best_pull_hit_rate,
            "ssd_rss_bytes": ssd_rss,
            "ssd_disk_bytes": ssd_disk,
            "payload_bytes_per_row": PAYLOAD_B,
            **filter_stats,
            "filter_ab_rows": ab_rows,
            "fill_with_filter_mrows_s": ab["with"],
            "fill_without_filter_mrows_s": ab["without"],
            "row_units": ["M keys/s", "M keys/s", "B/row", "B/row", "M rows/s"],
        },
        json_path=args.json or None,
        unit="",
    )
    print(
        f"Zipf rounds: {np.mean(distinct):,.0f} distinct keys of {ROUND:,} ids a round; "
        f"{hit_rate:.3f} of the keys were in memory ({pull_hit_rate:.3f} of the "
        f"pulled keys; a cache of the {cache:,} most probable keys: {best_pull_hit_rate:.3f})",
        flush=True,
    )


if __name__ == "__main__":
    main()
