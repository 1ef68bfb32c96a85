"""Graph tables: 2-hop neighbour sampling throughput and edge-file load rate.

A random graph (``--nodes`` ids, ``--edges`` directed edges with uniform random endpoints,
written to 4 text files ``src<TAB>dst``) is loaded into graph tables on real ``python -m
ps_server`` processes: one cluster of 1 server, one of 2. A batch is GraphSAGE's 2-hop sampling
with fanouts [15, 10] from 1,024 seeds: ``sample_neighbors(seeds, 15)``, then
``sample_neighbors(unique(hop 1), 10)`` through :class:`ps_server.graph_client.GraphClient`
(one request per server per hop).

Peers, measured in the same run, interleaved repetition by repetition on the same seeds:

* **local limit**: the same 2-hop sampling done in this process on one CSR holding the whole
  graph (:class:`ps_server.core.graph_table.GraphTable`, vectorised numpy, no RPC). Goal: 1
  server's batches/s >= 0.5x the local limit's.
* **1 server**, for the 2-server row: goal 2 servers' wall time per batch <= 0.7x one server's.
* **load**: edges/s of ``load_edges`` on the 1-server cluster (parse every line of the files,
  build the CSR), against the same load in this process; goal >= 2 M edges/s per server. Every
  server reads every file (it keeps the edges it owns), so this is also each server's rate in
  a cluster.

``torch_geometric``'s ``NeighborLoader`` is not a peer here: it needs ``pyg-lib`` or
``torch-sparse``, which have no wheels for this torch build.

Median of ``--reps`` (>= 5) repetitions of ``--batches`` batches each, [min .. max]. Defaults
(2*10^5 nodes, 2*10^6 edges) take a couple of minutes on 2 cores; ``--full`` is the goal's
10^6 nodes and 2*10^7 edges.

Run: ``.venv/bin/python bench/bench_graph_sampling.py [--json bench/results/graph_sampling.json]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import REPO, Stats, bench_env, report

FANOUTS = (15, 10)
SEEDS = 1024


def start_server(index: int, num: int) -> tuple[subprocess.Popen, str]:
    """One ``python -m ps_server`` process; returns it and its endpoint."""
    cmd = [sys.executable, "-m", "ps_server", "--port", "0", "--server_index", str(index),
           "--num_servers", str(num), "--log_level", "WARNING"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=bench_env(), cwd=REPO
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "serving on" not in line:
        proc.kill()
        raise RuntimeError(f"{' '.join(cmd)} did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[-1]


def write_graph(root: str, nodes: int, edges: int, seed: int) -> list[str]:
    """4 edge files of ``edges`` random edges over ``nodes`` ids; their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    per = -(-edges // 4)
    for k in range(4):
        n = min(per, edges - k * per)
        pairs = rng.integers(0, nodes, (n, 2))
        path = os.path.join(root, f"edges-{k}.txt")
        with open(path, "w") as f:
            np.savetxt(f, pairs, fmt="%d", delimiter="\t")
        paths.append(path)
    return paths


def two_hop(sample, seeds: np.ndarray) -> int:
    """GraphSAGE's 2-hop sampling from ``seeds``; returns the sampled edge count."""
    v1, _ = sample(seeds, FANOUTS[0])
    v2, _ = sample(np.unique(v1), FANOUTS[1])
    return int(v1.shape[0] + v2.shape[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=200_000)
    p.add_argument("--edges", type=int, default=2_000_000)
    p.add_argument("--full", action="store_true", help="10^6 nodes, 2*10^7 edges")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.full:
        args.nodes, args.edges = 1_000_000, 20_000_000
    from ps_server.config import GraphTableConfig
    from ps_server.core.graph_table import GraphTable
    from ps_server.graph_client import GraphClient

    cfg = GraphTableConfig("g", edge_types=["e"])
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        files = write_graph(root, args.nodes, args.edges, args.seed)
        print(f"wrote {args.edges} edges in {time.perf_counter() - t0:.1f}s", flush=True)
        try:
            eps = []
            for index, num in ((0, 1), (0, 2), (1, 2)):
                proc, ep = start_server(index, num)
                procs.append(proc)
                eps.append(ep)
            one = GraphClient(eps[:1], timeout_s=600)
            two = GraphClient(eps[1:], timeout_s=600)
            local = GraphTable(cfg)
            loads: dict[str, list[float]] = {"server": [], "local": []}
            for rep in range(args.reps):  # the load rate: fresh tables each repetition
                name = f"load{rep}"
                one.create_graph_table(GraphTableConfig(name, edge_types=["e"]))
                t = time.perf_counter()
                one.load_edges(name, files)
                loads["server"].append(args.edges / (time.perf_counter() - t))
                t = time.perf_counter()
                GraphTable(GraphTableConfig(name, edge_types=["e"])).load_edges(None, files)
                loads["local"].append(args.edges / (time.perf_counter() - t))
                print(f"load rep {rep}: {loads['server'][-1] / 1e6:.2f} M edges/s "
                      f"(in-process {loads['local'][-1] / 1e6:.2f})", flush=True)  # fmt: skip
            for c in (one, two):
                c.create_graph_table(cfg)
                c.load_edges("g", files)
            local.load_edges(None, files)
            rng = np.random.default_rng(args.seed + 1)
            samplers = {
                "local": lambda s, f: local.sample_neighbors(s, f)[:2],
                "1 server": lambda s, f: one.sample_neighbors("g", s, f),
                "2 servers": lambda s, f: two.sample_neighbors("g", s, f),
            }
            for s in samplers.values():  # warm up (CSR merge, channels)
                two_hop(s, rng.integers(0, args.nodes, SEEDS))
            times: dict[str, list[float]] = {k: [] for k in samplers}
            sampled: dict[str, int] = dict.fromkeys(samplers, 0)
            for rep in range(args.reps):
                batches = [rng.integers(0, args.nodes, SEEDS) for _ in range(args.batches)]
                for key, s in samplers.items():
                    t = time.perf_counter()
                    for seeds in batches:
                        sampled[key] += two_hop(s, seeds)
                    times[key].append((time.perf_counter() - t) / args.batches)
                print(
                    f"rep {rep}: "
                    + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms/batch" for k, v in times.items()),
                    flush=True,
                )
            one.close()
            two.close()
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    per_s = {k: Stats.of([1.0 / t for t in v]) for k, v in times.items()}
    size = f"{args.nodes:,} nodes, {args.edges:,} edges"
    report(
        "Graph tables: 2-hop [15, 10] sampling from 1,024 seeds and edge-file loading",
        [
            (
                f"2-hop batches/s, 1 server vs the local limit (one CSR in process) [{size}]",
                per_s["1 server"],
                per_s["local"],
                "ours/peer, higher is better",
            ),
            (
                f"wall time per batch, 2 servers vs 1 server [{size}]",
                Stats.of(times["2 servers"]),
                Stats.of(times["1 server"]),
                "ours/peer, lower is better",
            ),
            (
                f"load edges/s per server from text files vs the same load in process [{size}]",
                Stats.of(loads["server"]),
                Stats.of(loads["local"]),
                "ours/peer, higher is better",
            ),
        ],  # fmt: skip
        "1 server >= 0.5x the local limit; 2 servers <= 0.7x one server's time; load >= 2 M edges/s",
        extra={
            "nodes": args.nodes,
            "edges": args.edges,
            "batches": args.batches,
            "sampled_edges_per_batch": {
                k: v / (args.reps * args.batches) for k, v in sampled.items()
            },
        },
        json_path=args.json,
        unit="",
    )


if __name__ == "__main__":
    main()
