"""What the heterogeneous split costs where there is no device: 2 CPU trainers + 1 heter worker
against 3 ordinary trainers, every process sharing the machine's cores.

Ours is ``fleetrun --server_num 1 --worker_num 2 --heter_worker_num 1
examples/ctr/train_heter.py`` (async, up to ``--max_in_flight`` micro-batches in flight per
trainer); the peer is ``fleetrun --server_num 1 --worker_num 3 examples/ctr/train_ps.py``
(async), on the same generated examples, seed, model and learning rates. Here the split can only
cost (the heter worker runs on the same cores as everyone), so the ratio bounds its overhead.
Runs alternate; median of ``--reps`` (>= 5) with min/max of the training examples/s and the
test AUC.

Usage: ``python bench/bench_ps_heter.py [--reps 5] [--train 100000] [--test 20000] [--json PATH]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import Stats, report, run_ctr_job


def run_job(args: argparse.Namespace, tmp: str, heter: bool) -> dict:
    """One job; its examples/s and test AUC."""
    if heter:
        d = run_ctr_job(
            tmp,
            args.train,
            args.test,
            workers=2,
            script="examples/ctr/train_heter.py",
            fleet_args=["--heter_worker_num", "1"],
            script_args=[
                "--max_in_flight",
                str(args.max_in_flight),
                "--intra_op_threads",
                str(args.intra_op_threads),
                "--dense_pull_interval",
                str(args.dense_pull_interval),
            ],
        )
    else:
        d = run_ctr_job(tmp, args.train, args.test, workers=3)
    return {"examples_per_s": d["examples_per_s"], "auc": d["test_auc"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--train", type=int, default=100_000)
    ap.add_argument("--test", type=int, default=20_000)
    ap.add_argument("--max_in_flight", type=int, default=2)
    ap.add_argument(
        "--intra_op_threads",
        type=int,
        default=1,
        help="the heter worker's intra-op threads (1: faster than 2 on cores it shares)",
    )
    ap.add_argument("--dense_pull_interval", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    res: dict[str, list[dict]] = {"heter": [], "trainers": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = ("heter", "trainers") if rep % 2 == 0 else ("trainers", "heter")
            for which in order:
                r = run_job(args, tmp, which == "heter")
                res[which].append(r)
                print(
                    f"rep {rep} {which}: {r['examples_per_s']:,.0f} ex/s, AUC {r['auc']:.4f}",
                    flush=True,
                )
    report(
        f"CTR example, 1 server, async, {args.train:,} examples: 2 CPU trainers + 1 heter "
        f"worker (max_in_flight {args.max_in_flight}) vs 3 trainers, all on every core",
        [
            (
                "train examples/s, 2 CPU trainers + 1 heter worker vs 3 trainers",
                Stats.of([r["examples_per_s"] for r in res["heter"]]),
                Stats.of([r["examples_per_s"] for r in res["trainers"]]),
                "heter/trainers",
            ),
            (
                "test AUC, 2 CPU trainers + 1 heter worker vs 3 trainers",
                Stats.of([r["auc"] for r in res["heter"]]),
                Stats.of([r["auc"] for r in res["trainers"]]),
                "heter/trainers",
            ),
        ],
        goal="examples/s >= 0.9x; AUC within 0.005",
        unit="",
        json_path=args.json,
        extra={
            "row_units": ["ex/s", "AUC"],
            "max_in_flight": args.max_in_flight,
            "intra_op_threads": args.intra_op_threads,
            "dense_pull_interval": args.dense_pull_interval,
        },
    )


if __name__ == "__main__":
    main()
