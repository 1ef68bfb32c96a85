"""CTR training throughput: fleet PS (1 server + 1 trainer) vs single-process torch, same data.

Both train the same wide & deep model (``examples/ctr``) on the same synthetic examples for one
epoch and report train examples/s and test AUC. The peer is the single-process baseline
(``python -m examples.ctr.baseline``: hashed ``nn.Embedding(sparse=True)`` + sparse Adagrad,
Adam for the dense part, 1 intra-op thread); ours is ``fleetrun --server_num 1 --worker_num 1
examples/ctr/train_ps.py`` (rows Adagrad on the server, dense Adam on the server). Runs alternate;
median of >= 5 with min/max, ratio ours/baseline (goal >= 1.0), AUCs printed beside it.

Usage: ``python bench/bench_ctr.py [--reps 5] [--train 100000] [--test 20000] [--mode async]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import REPO, Stats, report, run_checked, run_ctr_job


def run_baseline(train: int, test: int) -> dict:
    out = run_checked(
        [
            sys.executable,
            "-m",
            "examples.ctr.baseline",
            "--train",
            str(train),
            "--test",
            str(test),
            "--threads",
            "1",
            "--json",
        ],
        cwd=REPO,
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("{"))
    d = json.loads(line)
    return {
        "examples_per_s": d["train_examples_per_s"],
        "auc": d["test_auc"],
        "bayes": d["bayes_auc"],
    }


def run_ps(train: int, test: int, mode: str, tmp: str, extra_args: Sequence[str] = ()) -> dict:
    """One ``fleetrun`` job of examples/ctr/train_ps.py (1 server + 1 trainer); ``extra_args``
    go to the script. Returns its examples/s and AUCs (and the rest of its JSON under "raw")."""
    d = run_ctr_job(tmp, train, test, mode=mode, script_args=extra_args)
    return {
        "examples_per_s": d["examples_per_s"],
        "auc": d["test_auc"],
        "bayes": d["bayes_auc"],
        "raw": d,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--train", type=int, default=100_000)
    ap.add_argument("--test", type=int, default=20_000)
    ap.add_argument("--mode", default="async", choices=["sync", "async", "geo"])
    ap.add_argument("--json")
    args = ap.parse_args()
    res: dict[str, list[dict]] = {"ps": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for which in ("ps", "baseline") if rep % 2 == 0 else ("baseline", "ps"):
                r = (
                    run_ps(args.train, args.test, args.mode, tmp)
                    if which == "ps"
                    else run_baseline(args.train, args.test)
                )
                res[which].append(r)
    ours = Stats.of([r["examples_per_s"] for r in res["ps"]])
    peer = Stats.of([r["examples_per_s"] for r in res["baseline"]])
    auc_ps = Stats.of([r["auc"] for r in res["ps"]])
    auc_base = Stats.of([r["auc"] for r in res["baseline"]])
    report(
        f"CTR training, fleet PS 1 server + 1 trainer ({args.mode}) vs single-process torch, "
        f"{args.train} examples",
        [("train examples/s", ours, peer, "ours/baseline examples/s")],
        goal=">= 1.0",
        unit="ex/s",
        json_path=args.json,
        extra={"auc_ps": auc_ps.__dict__, "auc_baseline": auc_base.__dict__},
    )
    print(
        f"test AUC: fleet PS {auc_ps.fmt('', digits=4)} | baseline {auc_base.fmt('', digits=4)} | "
        f"Bayes {res['ps'][0]['bayes']:.4f}  (goal: PS within 0.01 of the baseline)"
    )


if __name__ == "__main__":
    main()
