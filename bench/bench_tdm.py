"""TDM retrieval: beam search over a TreeIndex vs brute-force scoring of every item.

Runs ``examples/tdm/train_tdm.py`` (generate clustered items and users, build the tree by
balanced k-means, train a (user, node) scorer on LayerWiseSampler rows, retrieve the top 50) once
per seed, in this process, and reports over the seeds (median [min .. max]):

- recall@50 on held-out (user, item) pairs, tree beam search (ours) vs brute force with the same
  model (peer); goal: ratio >= 0.8;
- (user, node) scorings per user, tree vs brute force; goal: ratio <= 0.1;
- the share of brute force's top 50 that the tree search also returns (informational);
- recall and scorings at narrower beams (``--other_beams``) with the same trained models.

    python bench/bench_tdm.py --seeds 5 [--items 16384 --beam 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import Stats, report  # noqa: E402
from examples.tdm.train_tdm import TDMConfig, run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5, help="runs, seeds 0 .. N-1")
    p.add_argument("--items", type=int, default=TDMConfig.items)
    p.add_argument("--users", type=int, default=TDMConfig.users)
    p.add_argument("--branch", type=int, default=TDMConfig.branch)
    p.add_argument("--beam", type=int, default=TDMConfig.beam)
    p.add_argument(
        "--other_beams",
        type=int,
        nargs="*",
        default=[16, 32, 128],
        help="also retrieve with these beam widths (same trained models)",
    )
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = []
    for seed in range(args.seeds):
        cfg = TDMConfig(
            items=args.items, users=args.users, branch=args.branch, beam=args.beam, seed=seed
        )
        out = run(cfg, other_beams=tuple(args.other_beams))
        print(
            f"seed {seed}: recall@{cfg.topk} tree {out['recall_tree']:.4f} brute "
            f"{out['recall_brute']:.4f} (ratio {out['recall_ratio']:.3f}), overlap "
            f"{out['overlap']:.3f}, scorings {out['scorings_tree']:.0f} / "
            f"{out['scorings_brute']:.0f} ({out['cost_ratio']:.4f}), train {out['train_s']:.1f} s",
            flush=True,
        )
        runs.append(out)
    topk = TDMConfig.topk
    n = len(runs)
    rows = [
        (
            f"recall@{topk} on held-out pairs: tree beam search (beam {args.beam}) vs brute force",
            Stats.of([r["recall_tree"] for r in runs]),
            Stats.of([r["recall_brute"] for r in runs]),
            "tree / brute force, higher is better",
        ),
        (
            f"(user, node) scorings per user, {args.items} items, branch {args.branch}",
            Stats.of([r["scorings_tree"] for r in runs]),
            Stats.of([r["scorings_brute"] for r in runs]),
            "tree / brute force, lower is better",
        ),
        (
            f"share of brute force's top {topk} the tree search returns",
            Stats.of([r["overlap"] for r in runs]),
            Stats.of([1.0] * n),
            "informational",
        ),
    ]
    for b in args.other_beams:
        at = [r["beams"][b] for r in runs]
        rows += [
            (
                f"beam {b}: recall@{topk}, tree vs brute force",
                Stats.of([r["recall_tree"] for r in at]),
                Stats.of([r["recall_brute"] for r in at]),
                "tree / brute force, informational",
            ),
            (
                f"beam {b}: (user, node) scorings per user, tree vs brute force",
                Stats.of([r["scorings_tree"] for r in at]),
                Stats.of([r["scorings_brute"] for r in at]),
                "tree / brute force, informational",
            ),
        ]
    report(
        "TDM: tree beam search vs brute-force retrieval",
        rows,
        "recall ratio >= 0.8 at a scoring cost ratio <= 0.1",
        extra={"runs": runs},
        json_path=args.json,
        unit="share",
    )


if __name__ == "__main__":
    main()
