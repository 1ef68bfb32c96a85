"""The capacity of one server's SSD table: 10^8 rows with 10^6 in memory, saved and loaded.

One table (dim 8, Adagrad, ``storage="ssd"``, ``cache_rows`` 10^6), in-process (no gRPC), in
three phases, each in its own fresh process so the figures of one are not the leftovers of
another:

* **fill**: ``--rows`` N rows made up in chunks (distinct keys: splitmix64 of 1..N; small
  random values, Adagrad state 0.1, show counts 0..99) and imported shard by shard
  (``import_shard``, the path a checkpoint load takes), then flushed: rows/s, and the bytes
  RocksDB holds per row against the payload (key 8 B + values 4*dim + g2sum 4*dim + count 4 B +
  unseen_days 2 B = 78 B);
* **save**: a full checkpoint of the table: the **stall** (how long the table's lock is held:
  the memory rows are copied and a RocksDB checkpoint of the tier is taken, hard links of its
  files) against the whole save (the memory rows' shard files written, the RocksDB files linked
  into the checkpoint directory and their CRC-32 computed); and the **disk the save adds**: the
  bytes of the checkpoint's files that share no inode with the tier's, against the tier's files;
* **load**: a fresh process loads the checkpoint into an empty SSD table of the same sharding
  (every file verified against the manifest's CRC-32, the RocksDB files adopted as the tier:
  SST files hard-linked, the key filter rebuilt from a key scan, the memory rows imported,
  flushed): rows/s, against the engine's own limit measured in the same process (one RocksDB
  write batch per 65 536 packed rows of the same record size, opened with the tier's options,
  into an empty database, on the first ``--limit_rows`` rows); and the process's RSS once the
  table is loaded, against the rows' payload held in memory (the least a memory table needs).

One repetition at these sizes (tens of minutes); ``--quick`` runs 10^7 rows with
``cache_rows`` 10^5, where the goals are not judged.

Usage: ``python bench/bench_ps_ssd_capacity.py [--rows 100000000] [--cache_rows 1000000]
[--dir DIR] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ps_ssd import DIM, PAYLOAD_B, config, rss_bytes
from common import Stats, report

CHUNK = 4_000_000
BATCH = 65536


def made_up_rows(start: int, stop: int, num_shards: int, state_dim: int):  # noqa: ANN201
    """Payloads (one per shard) of rows ``start..stop-1``."""
    from ps_server.core.hashing import mix64
    from ps_server.core.routing import shard_of
    from ps_server.core.shard_data import SparseShardData

    idx = np.arange(start + 1, stop + 1, dtype=np.uint64)
    keys = mix64(idx).view(np.int64)
    rng = np.random.default_rng(start)
    n = keys.shape[0]
    values = rng.normal(0.0, 0.01, (n, DIM)).astype(np.float32)
    count = rng.integers(0, 100, n, dtype=np.uint32)
    shards = shard_of(keys, num_shards)
    order = np.argsort(shards, kind="stable")
    bounds = np.searchsorted(shards[order], np.arange(num_shards + 1))

    def empty(dtype: type) -> np.ndarray:
        return np.zeros(0, dtype=dtype)

    for s in range(num_shards):
        sel = order[bounds[s] : bounds[s + 1]]
        m = sel.shape[0]
        yield SparseShardData(
            s,
            keys[sel],
            values[sel],
            np.full((m, state_dim), 0.1, dtype=np.float32),
            count[sel],
            np.zeros(m, dtype=np.uint16),
            np.zeros(m, dtype=np.uint8),
            empty(np.int64),
            empty(np.uint32),
            empty(np.uint16),
            empty(np.uint8),
            empty(np.int64),
            empty(np.int64),
        )


def phase_fill_save(args: argparse.Namespace) -> dict:
    from ps_server import make_table
    from ps_server.checkpoint.save_load import take_snapshot, write_snapshot
    from ps_server.core.table import ChangeLog

    os.makedirs(os.path.join(args.dir, "fill"), exist_ok=True)
    table = make_table(config("cap", args.cache_rows), ssd_root=os.path.join(args.dir, "fill"))
    t0 = time.perf_counter()
    for start in range(0, args.rows, CHUNK):
        for payload in made_up_rows(
            start, min(args.rows, start + CHUNK), table.config.num_shards, table.state_dim
        ):
            table.import_shard(payload, False)
    table.flush()
    fill_s = time.perf_counter() - t0
    table.cold.flush()  # the memtable into SST files: the bytes a reader of the dir sees
    disk = table.stats()["ssd_bytes"]
    rows = table.num_rows
    t0 = time.perf_counter()
    snap = take_snapshot([table], "all", ChangeLog.SAVE)
    manifest = write_snapshot(os.path.join(args.dir, "ckpt"), snap, "server-0")
    save_s = time.perf_counter() - t0
    ckpt_bytes, added = checkpoint_bytes(os.path.join(args.dir, "ckpt"), table.cold.path)
    table.close()
    cold = manifest["tables"]["cap"].get("cold") or [{}]
    return {
        "rows": rows,
        "fill_s": fill_s,
        "disk_bytes": disk,
        "stall_s": snap.seconds,
        "save_s": save_s,
        "ckpt_bytes": ckpt_bytes,
        "ckpt_added_bytes": added,
        "linked_files": cold[0].get("linked", 0),
        "copied_files": cold[0].get("copied", 0),
    }


def checkpoint_bytes(ckpt: str, tier: str) -> tuple[int, int]:
    """(bytes of every file of checkpoint ``ckpt``, bytes of those sharing no inode with a
    file of the tier directory ``tier``: what the save added to the disk)."""
    live = set()
    for dirpath, _dirs, files in os.walk(tier):
        for name in files:
            live.add(os.stat(os.path.join(dirpath, name)).st_ino)
    total = added = 0
    for dirpath, _dirs, files in os.walk(ckpt):
        for name in files:
            st = os.stat(os.path.join(dirpath, name))
            total += st.st_size
            if st.st_ino not in live:
                added += st.st_size
    return total, added


def phase_load(args: argparse.Namespace) -> dict:
    from ps_server import make_table
    from ps_server.checkpoint import load
    from ps_server.core.ssd_tier import open_rocksdb, record_dtype

    gc.collect()
    rss0 = rss_bytes()
    os.makedirs(os.path.join(args.dir, "load"), exist_ok=True)
    table = make_table(config("cap", args.cache_rows), ssd_root=os.path.join(args.dir, "load"))
    t0 = time.perf_counter()
    read = load(os.path.join(args.dir, "ckpt"), [table])["cap"]
    table.flush()
    load_s = time.perf_counter() - t0
    gc.collect()
    rss = rss_bytes()
    stats = table.stats()
    state_dim = table.state_dim
    table.close()
    # the engine's limit: packed records of the same size written in batches
    import rocksdict

    rec_size = record_dtype(DIM, state_dim).itemsize
    db = open_rocksdb(rocksdict, os.path.join(args.dir, "limit"))
    n = min(args.limit_rows, args.rows)
    keys = np.sort(np.random.default_rng(7).integers(1, 2**62, n, dtype=np.int64))
    blob = np.zeros((BATCH, rec_size), dtype=np.uint8).view(f"V{rec_size}").reshape(-1)
    t1 = time.perf_counter()
    for start in range(0, n, BATCH):
        k = keys[start : start + BATCH].astype(">i8").view("S8").tolist()
        batch = rocksdict.WriteBatch(raw_mode=True)
        for kb, vb in zip(k, blob[: len(k)].tolist(), strict=False):
            batch.put(kb, vb)
        db.write(batch)
    db.flush()
    limit_s = time.perf_counter() - t1
    db.close()
    return {
        "read": read,
        "load_s": load_s,
        "rss_bytes": rss,
        "rss_growth_bytes": rss - rss0,
        "hot_rows": stats["hot_rows"],
        "cold_rows": stats["cold_rows"],
        "limit_rows": n,
        "limit_s": limit_s,
    }


def run_phase(name: str, args: argparse.Namespace) -> dict:
    """Run one phase in a fresh process; its JSON result."""
    out = os.path.join(args.dir, f"{name}.json")
    cmd = [
        sys.executable,
        __file__,
        "--phase",
        name,
        "--rows",
        str(args.rows),
        "--cache_rows",
        str(args.cache_rows),
        "--limit_rows",
        str(args.limit_rows),
        "--dir",
        args.dir,
        "--out",
        out,
    ]
    subprocess.run(cmd, check=True)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000_000)
    p.add_argument("--cache_rows", type=int, default=1_000_000)
    p.add_argument("--limit_rows", type=int, default=4_000_000)
    p.add_argument("--quick", action="store_true", help="10^7 rows, cache_rows 10^5")
    p.add_argument("--dir", default="", help="where the files go (default: a temp dir)")
    p.add_argument("--json", default="")
    p.add_argument("--phase", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase:
        result = (phase_fill_save if args.phase == "fill_save" else phase_load)(args)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
        return
    if args.quick:
        args.rows, args.cache_rows = 10_000_000, 100_000
    parent = args.dir or None
    args.dir = tempfile.mkdtemp(prefix="bench_ps_ssd_capacity_", dir=parent)
    try:
        fill = run_phase("fill_save", args)
        print(
            f"filled {fill['rows']:,} rows in {fill['fill_s']:.1f} s, disk "
            f"{fill['disk_bytes'] / fill['rows']:.1f} B/row; saved in {fill['save_s']:.1f} s, "
            f"lock held {fill['stall_s']:.3f} s; checkpoint {fill['ckpt_bytes'] / 2**20:.0f} "
            f"MiB of which {fill['ckpt_added_bytes'] / 2**20:.1f} MiB new on disk "
            f"({fill['linked_files']} files linked, {fill['copied_files']} copied)",
            flush=True,
        )
        shutil.rmtree(os.path.join(args.dir, "fill"), ignore_errors=True)
        loaded = run_phase("load", args)
        print(
            f"loaded {loaded['read']:,} rows in {loaded['load_s']:.1f} s "
            f"({loaded['hot_rows']:,} in memory, {loaded['cold_rows']:,} on disk), RSS "
            f"{loaded['rss_bytes'] / 2**30:.2f} GiB; engine limit {loaded['limit_rows']:,} rows "
            f"in {loaded['limit_s']:.1f} s",
            flush=True,
        )
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    n, m, gb = fill["rows"], 1e-6, 1e-9
    rows = [
        (
            f"process RSS with {n:,} rows loaded (cache_rows {args.cache_rows:,}), GB, vs the "
            "rows' payload in memory",
            Stats.of([loaded["rss_bytes"] * gb]),
            Stats.of([n * PAYLOAD_B * gb]),
            "ssd/memory payload, lower is better",
        ),
        (
            "disk bytes per row vs payload",
            Stats.of([fill["disk_bytes"] / n]),
            Stats.of([float(PAYLOAD_B)]),
            "disk/payload, lower is better",
        ),
        (
            "load from a checkpoint, M rows/s, vs RocksDB write batches of the same records",
            Stats.of([loaded["read"] / loaded["load_s"] * m]),
            Stats.of([loaded["limit_rows"] / loaded["limit_s"] * m]),
            "ours/engine limit, higher is better",
        ),
        (
            "disk a full save adds, GB, vs the table's files on disk",
            Stats.of([fill["ckpt_added_bytes"] * gb]),
            Stats.of([fill["disk_bytes"] * gb]),
            "added/table, lower is better",
        ),
        (
            "checkpoint stall (table lock held by a full save), s, vs the whole save",
            Stats.of([fill["stall_s"]]),
            Stats.of([fill["save_s"]]),
            "stall/save, lower is better",
        ),
        (
            "rows imported per second (fill), M rows/s, vs the load",
            Stats.of([n / fill["fill_s"] * m]),
            Stats.of([loaded["read"] / loaded["load_s"] * m]),
            "fill/load",
        ),
    ]
    report(
        f"SSD table capacity, {n:,} rows, dim {DIM}, Adagrad, cache_rows {args.cache_rows:,}",
        rows,
        "RSS <= 1.5 GB; disk <= 1.5x payload; load >= 1 M rows/s; stall <= 0.5 s; a save "
        "does not double the disk",
        extra={
            "rows_n": n,
            "cache_rows": args.cache_rows,
            **{f"fill_{k}": v for k, v in fill.items()},
            **{f"load_{k}": v for k, v in loaded.items()},
            "row_units": ["GB", "B/row", "M rows/s", "GB", "s", "M rows/s"],
        },
        json_path=args.json or None,
        unit="",
    )


if __name__ == "__main__":
    main()
