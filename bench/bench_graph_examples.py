"""Graph-table examples: GraphSAGE under fleetrun vs one process, DeepWalk and metapath2vec vs one-hot.

Per seed (0 .. N-1), interleaved, on the same generated stochastic block model:

- ``examples/graph/graphsage_ps.py`` under fleetrun with 2 servers + 2 trainers (ours) and with
  ``--local`` in one process (peer: the same files in one in-process graph table, the same
  sampler settings, global batch and Adam): test accuracy (goal: |ours - peer| <= 0.01) and
  training seconds (informational);
- ``examples/graph/deepwalk_ps.py`` under fleetrun with 2 servers + 2 trainers: a logistic
  regression's test accuracy on the learned embeddings (ours) vs on the community one-hot
  features (peer); goal: ratio >= 0.9.
- ``examples/graph/metapath2vec_ps.py`` under fleetrun with 2 servers + 2 trainers on a generated
  author-paper-venue graph (``--authors``): the same regression on the author embeddings vs
  the authors' community one-hot features; goal: ratio >= 0.9.

Reports median [min .. max] over the seeds. ``--examples sage`` runs GraphSAGE alone (the
``graph_sage_large`` benchmark: 10^6 nodes and 2*10^7 directed edges); the directed edge count the
servers hold (every generated edge in both directions, ``reverse=True``) is printed and kept in
the JSON as ``edges``.

    python bench/bench_graph_examples.py --seeds 5 [--nodes 50000] [--examples sage] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Stats, fleetrun_cmd, report, run_checked  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5, help="runs, seeds 0 .. N-1")
    p.add_argument(
        "--examples",
        choices=("all", "sage"),
        default="all",
        help="all three examples, or GraphSAGE alone (fleetrun and one process)",
    )
    p.add_argument("--nodes", type=int, default=3000)
    p.add_argument("--avg_degree", type=float, default=10.0)
    p.add_argument("--signal", type=float, default=0.5, help="class signal in the features")
    p.add_argument("--fanouts", default="10,5")
    p.add_argument("--batch_size", type=int, default=128, help="GraphSAGE global batch")
    p.add_argument("--epochs", type=int, default=5, help="GraphSAGE epochs")
    p.add_argument("--walks_per_node", type=int, default=4)
    p.add_argument("--walk_length", type=int, default=20)
    p.add_argument("--dw_batch_size", type=int, default=2048, help="DeepWalk pairs per step")
    p.add_argument("--authors", type=int, default=2000, help="metapath2vec authors")
    p.add_argument("--m2v_walk_length", type=int, default=16, help="metapath2vec walk length")
    p.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    p.add_argument(
        "--budget_s",
        type=float,
        default=0.0,
        help="start no further seed that would end (at the mean seed's time so far) after this "
        "many seconds; the report counts the seeds that ran (0: every seed)",
    )
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args(argv)
    graph = ["--nodes", str(args.nodes), "--avg_degree", str(args.avg_degree)]
    sage = [
        *graph,
        "--signal",
        str(args.signal),
        "--fanouts",
        *args.fanouts.split(","),
        "--batch_size",
        str(args.batch_size),
        "--epochs",
        str(args.epochs),
    ]
    walk = [
        *graph,
        "--walks_per_node",
        str(args.walks_per_node),
        "--walk_length",
        str(args.walk_length),
        "--batch_size",
        str(args.dw_batch_size),
    ]
    m2v = [
        "--authors",
        str(args.authors),
        "--walks_per_node",
        str(args.walks_per_node),
        "--walk_length",
        str(args.m2v_walk_length),
        "--batch_size",
        str(args.dw_batch_size),
    ]
    job = ["--server_num", "2", "--worker_num", "2"]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-graph-") as tmp:
        t0 = time.monotonic()
        for seed in range(args.seeds):
            spent = time.monotonic() - t0
            if args.budget_s and seed and spent * (seed + 1) / seed > args.budget_s:
                print(f"budget: {seed} seeds ran in {spent:.0f} s, no seed more", flush=True)
                break
            s = ["--seed", str(seed)]
            out = {}
            jobs = (
                (
                    "sage_ps",
                    fleetrun_cmd(
                        *job,
                        "--log_dir",
                        f"{tmp}/log-{seed}-sage",
                        "examples/graph/graphsage_ps.py",
                        *sage,
                        *s,
                    ),
                ),
                (
                    "sage_local",
                    [sys.executable, "examples/graph/graphsage_ps.py", "--local", *sage, *s],
                ),
                (
                    "deepwalk",
                    fleetrun_cmd(
                        *job,
                        "--log_dir",
                        f"{tmp}/log-{seed}-dw",
                        "examples/graph/deepwalk_ps.py",
                        *walk,
                        *s,
                    ),
                ),
                (
                    "metapath2vec",
                    fleetrun_cmd(
                        *job,
                        "--log_dir",
                        f"{tmp}/log-{seed}-m2v",
                        "examples/graph/metapath2vec_ps.py",
                        *m2v,
                        *s,
                    ),
                ),
            )
            for name, cmd in jobs[:2] if args.examples == "sage" else jobs:
                path = f"{tmp}/{name}-{seed}.json"
                run_checked([*cmd, "--json", path], timeout=args.timeout, cwd=REPO)
                out[name] = _json(path)
            ps, local = out["sage_ps"], out["sage_local"]
            line = (
                f"seed {seed}: GraphSAGE ({ps['edges']:,} directed edges on the servers) acc "
                f"fleetrun {ps['test_acc']:.4f} ({ps['train_seconds']:.1f} s, {ps['steps']} "
                f"steps) one process {local['test_acc']:.4f} ({local['train_seconds']:.1f} s), "
                f"difference {ps['test_acc'] - local['test_acc']:+.4f}"
            )
            if args.examples == "all":
                line += (
                    f"; DeepWalk acc {out['deepwalk']['acc_embedding']:.4f} / one-hot "
                    f"{out['deepwalk']['acc_onehot']:.4f}; metapath2vec acc "
                    f"{out['metapath2vec']['acc_embedding']:.4f} / one-hot "
                    f"{out['metapath2vec']['acc_onehot']:.4f}"
                )
            print(line, flush=True)
            runs.append(out)
    ps, local = ([r[k] for r in runs] for k in ("sage_ps", "sage_local"))
    size = f"{args.nodes:,} nodes, {ps[0]['edges']:,} edges"
    rows = [
        (
            f"GraphSAGE test accuracy, fleetrun 2 servers + 2 trainers vs one process ({size}, "
            f"fanouts [{args.fanouts.replace(',', ', ')}])",
            Stats.of([r["test_acc"] for r in ps]),
            Stats.of([r["test_acc"] for r in local]),
            "fleetrun / one process, higher is better; goal on |difference|",
        ),
        (
            f"GraphSAGE training seconds, {args.epochs} epochs, fleetrun vs one process",
            Stats.of([r["train_seconds"] for r in ps]),
            Stats.of([r["train_seconds"] for r in local]),
            "fleetrun / one process, informational",
        ),
    ]
    title = "Graph-table examples: GraphSAGE, DeepWalk and metapath2vec under fleetrun"
    goal = "GraphSAGE accuracy within 0.01 of one process; DeepWalk and metapath2vec ratio >= 0.9"
    if args.examples == "sage":
        title = f"GraphSAGE under fleetrun vs one process at {size}"
        goal = "GraphSAGE accuracy within 0.01 of one process"
    else:
        rows += _walk_rows(runs, size)
    report(
        title,
        rows,
        goal,
        extra={"runs": runs, "args": vars(args), "edges": ps[0]["edges"]},
        json_path=args.json,
        unit="",
    )


def _walk_rows(runs: list[dict], size: str) -> list[tuple[str, Stats, Stats, str]]:
    """DeepWalk's and metapath2vec's rows."""
    dw, m2v_runs = ([r[k] for r in runs] for k in ("deepwalk", "metapath2vec"))
    return [
        (
            f"DeepWalk: logistic regression test accuracy, embeddings vs community one-hot "
            f"({size})",
            Stats.of([r["acc_embedding"] for r in dw]),
            Stats.of([r["acc_onehot"] for r in dw]),
            "embeddings / one-hot, higher is better",
        ),
        (
            f"metapath2vec: logistic regression test accuracy, author embeddings vs community "
            f"one-hot ({m2v_runs[0]['nodes']:,} nodes, {m2v_runs[0]['edges']:,} edges)",
            Stats.of([r["acc_embedding"] for r in m2v_runs]),
            Stats.of([r["acc_onehot"] for r in m2v_runs]),
            "embeddings / one-hot, higher is better",
        ),
    ]


if __name__ == "__main__":
    main()
