"""The CTR example with SSD tables holding 5 % of the rows in memory, against memory tables.

Both jobs are ``fleetrun --server_num 1 --worker_num 1 examples/ctr/train_ps.py`` on the same
generated examples (``--train``, ``--test``), async mode, the same seed; ours adds ``--storage
ssd --cache_rows N`` (fleetrun ``--ps_ssd_dir``), N = ``--cache_share`` of the distinct keys the
job's examples hold (each of the two tables, wide and deep, has one row per distinct key), the
peer keeps every row in memory. A second pair trains the same examples from slot files with
``--pass_cache`` (Paddle's use of its SSD table: the pass's rows are pulled out of the tiers once
before the pass and written back once after it). Runs alternate; median of ``--reps`` (>= 5)
with min/max of the training examples/s and the test AUC, ratio ours/memory.

Usage: ``python bench/bench_ps_ssd_ctr.py [--reps 5] [--train 100000] [--test 20000]
[--cache_share 0.05] [--json PATH]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import REPO, Stats, bench_env, report, run_checked, run_ctr_job


def distinct_keys(train: int, test: int) -> int:
    """Distinct ids of the job's examples (the rows of each table once it has seen them all)."""
    from examples.ctr.data import CTRDataConfig, generate
    from ps_server.core.batch_ops import sorted_distinct

    batch = generate(CTRDataConfig(), train + test)
    return int(sorted_distinct(batch.sparse_ids.reshape(-1)).shape[0])


def write_slot_files(out: str, train: int) -> None:
    """The first ``train`` generated examples as slot files (what the tensors path trains)."""
    run_checked(
        [
            sys.executable,
            os.path.join(REPO, "examples", "ctr", "gen_slot_files.py"),
            "--out_dir",
            out,
            "--num_files",
            "1",
            "--lines_per_file",
            str(train),
        ],
        cwd=REPO,
        env=bench_env(),
    )


def run_job(args: argparse.Namespace, tmp: str, cache_rows: int, slots: str = "") -> dict:
    """One job; ``cache_rows`` 0 = memory tables; ``slots``: train from these slot files with
    the pass cache. Its examples/s and test AUC."""
    fleet_flags = ["--ps_ssd_dir", os.path.join(tmp, "ssd")] if cache_rows else []
    script_args = ["--storage", "ssd", "--cache_rows", str(cache_rows)] if cache_rows else []
    if slots:
        script_args += ["--data_dir", slots, "--pass_cache"]
    d = run_ctr_job(tmp, args.train, args.test, fleet_args=fleet_flags, script_args=script_args)
    return {"examples_per_s": d["examples_per_s"], "auc": d["test_auc"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--train", type=int, default=100_000)
    ap.add_argument("--test", type=int, default=20_000)
    ap.add_argument("--cache_share", type=float, default=0.05)
    ap.add_argument("--json")
    args = ap.parse_args()
    keys = distinct_keys(args.train, args.test)
    cache = max(1, int(keys * args.cache_share))
    print(f"{keys:,} distinct keys per table; SSD tables keep {cache:,} rows in memory", flush=True)
    res: dict[str, list[dict]] = {"ssd": [], "memory": [], "ssd_pass": [], "memory_pass": []}
    with tempfile.TemporaryDirectory() as tmp:
        slots = os.path.join(tmp, "slots")
        write_slot_files(slots, args.train)
        for rep in range(args.reps):
            order = list(res) if rep % 2 == 0 else list(reversed(res))
            for which in order:
                storage_cache = cache if which.startswith("ssd") else 0
                r = run_job(args, tmp, storage_cache, slots if which.endswith("pass") else "")
                res[which].append(r)
                print(
                    f"rep {rep} {which}: {r['examples_per_s']:,.0f} ex/s, AUC {r['auc']:.4f}",
                    flush=True,
                )
    speed = {k: Stats.of([r["examples_per_s"] for r in v]) for k, v in res.items()}
    auc = {k: Stats.of([r["auc"] for r in v]) for k, v in res.items()}
    report(
        f"CTR example, 1 server + 1 trainer, async, {args.train:,} examples: SSD tables "
        f"(cache {100 * cache / keys:.1f} % of the rows) vs memory tables",
        [
            (
                "train examples/s, SSD tables vs memory tables",
                speed["ssd"],
                speed["memory"],
                "ssd/memory",
            ),
            ("test AUC, SSD tables vs memory tables", auc["ssd"], auc["memory"], "ssd/memory"),
            (
                "pass cache: train examples/s, SSD tables vs memory tables",
                speed["ssd_pass"],
                speed["memory_pass"],
                "ssd/memory",
            ),
            (
                "pass cache: test AUC, SSD tables vs memory tables",
                auc["ssd_pass"],
                auc["memory_pass"],
                "ssd/memory",
            ),
        ],
        goal="examples/s >= 0.8x; AUC within 0.002",
        unit="",
        json_path=args.json,
        extra={
            "distinct_keys": keys,
            "cache_rows": cache,
            "row_units": ["ex/s", "AUC", "ex/s", "AUC"],
        },
    )


if __name__ == "__main__":
    main()
