"""Graph tables: 2-hop neighbour sampling throughput and edge-file load rate.

A random graph (``--nodes`` ids, ``--edges`` directed edges with uniform random endpoints,
written to 4 text files ``src<TAB>dst``) is loaded into graph tables on real ``python -m
ps_server`` processes: one cluster of 1 server, one of 2. A batch is GraphSAGE's 2-hop sampling
with fanouts [15, 10] from 1,024 seeds: ``sample_neighbors(seeds, 15)``, then
``sample_neighbors(unique(hop 1), 10)`` through :class:`ps_server.graph_client.GraphClient`
(one request per server per hop).

Peers, measured in the same run, interleaved repetition by repetition on the same seeds:

* **local limit**: the same 2-hop sampling done in this process on one CSR holding the whole
  graph (:class:`ps_server.core.graph_table.GraphTable`'s compiled sampler, gathering the
  neighbour ids only, as the servers do; no RPC). Goal: 1
  server's batches/s >= 0.5x the local limit's.
* **1 server**, for the 2-server rows: goal 2 servers' wall time per batch <= 0.7x one server's.
  The client and the servers share the machine's cores. The goal row's two servers run as
  fleetrun ``--ps_bind_cpus`` starts them (``python -m collective.bootstrap -m ps_server`` with
  FLEET_PS_CPU_SHARE ``0/2`` and ``1/2``: each binds itself to its half of the cores); the one
  server has the whole machine (its share is all of it). Two more rows say what the machine
  allows: **not bound**, two servers the scheduler places as it likes (now and then both on one
  core while the other idles), and **sampling work alone**: the same batches sampled in this
  process from two tables holding server 0's and server 1's part of the graph, the larger share
  of each hop summed (the time of two servers with a core each and free RPC) against the local
  limit's.
* **load**: edges/s of ``load_edges`` on a fresh 1-server cluster per repetition (read and
  parse every line of the files, build the CSR), against the limit of numpy reading the same
  files and splitting them into int64 numbers alone (``np.fromstring``, no checks, no CSR); goal
  >= 2 M edges/s per server. Every server reads every file (it keeps the edges it owns), so this
  is also each server's rate in a cluster. The same loads per CPU second (the server process's
  user + system time from ``/proc``, numpy's from ``time.process_time``) say what one core
  gives when the machine's cores are shared.

``torch_geometric``'s ``NeighborLoader`` is not a peer here: it needs ``pyg-lib`` or
``torch-sparse``, which have no wheels for this torch build.

Median of ``--reps`` (>= 5) repetitions of ``--batches`` batches each, [min .. max]. Defaults
(2*10^5 nodes, 2*10^6 edges) take a couple of minutes on 2 cores; ``--full`` is the goal's
10^6 nodes and 2*10^7 edges. The load average before, between the parts and after goes to the
JSON file.

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


def start_server(index: int, num: int, bound: bool = False) -> tuple[subprocess.Popen, str]:
    """One ``python -m ps_server`` process; returns it and its endpoint. ``bound``: started as
    fleetrun ``--ps_bind_cpus`` starts it (through the bootstrap, with its FLEET_PS_CPU_SHARE)."""
    cmd = [sys.executable, "-u", "-m", "collective.bootstrap", "-m", "ps_server", "--port", "0",
           "--server_index", str(index), "--num_servers", str(num), "--log_level", "WARNING"]  # fmt: skip
    env = bench_env()
    if bound:
        env["FLEET_PS_CPU_SHARE"] = f"{index}/{num}"
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "serving on" not in line:
        proc.kill()
        raise RuntimeError(f"{' '.join(cmd)} did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[-1]


def edge_lines(pairs: np.ndarray) -> bytes:
    """``src<TAB>dst<NL>`` lines of the non-negative int64 ``pairs`` ``[n, 2]``, formatted by
    numpy (fixed-width digits, leading zeros masked out): no Python per line."""
    width = max(1, len(str(int(pairs.max())))) if pairs.size else 1
    digits = np.empty((pairs.shape[0], 2, width + 1), np.uint8)
    vals = pairs.copy()
    for k in range(width - 1, -1, -1):
        digits[:, :, k] = 48 + vals % 10
        vals //= 10
    digits[:, 0, width], digits[:, 1, width] = 9, 10  # tab, newline
    ndig = np.ones(pairs.shape, np.int64)
    for k in range(1, width):
        ndig += pairs >= 10**k
    keep = np.arange(width + 1) >= width - ndig[:, :, None]
    return digits[keep].tobytes()


def write_graph(root: str, nodes: int, edges: int, seed: int) -> list[str]:
    """4 edge files of ``edges`` random edges over ``nodes`` ids; their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    per = -(-edges // 4)
    for k in range(4):
        path = os.path.join(root, f"edges-{k}.txt")
        with open(path, "wb") as f:
            n = min(per, edges - k * per)
            for lo in range(0, n, 1 << 20):
                f.write(edge_lines(rng.integers(0, nodes, (min(1 << 20, n - lo), 2))))
        paths.append(path)
    return paths


def numpy_read(files: list[str]) -> int:
    """The load's limit: read each file and split it into int64 numbers by numpy alone (no
    checks, no CSR); returns the edge count."""
    total = 0
    for path in files:
        with open(path, "rb") as f:
            total += np.fromstring(f.read(), dtype=np.int64, sep=" ").shape[0] // 2
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (every thread) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def table_sample(table, nodes: np.ndarray, fanout: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of ``fanout`` uniform neighbours per node from an in-process table,
    gathering the neighbour ids only, as a server does for ``sample_neighbors`` without
    ``return_weights`` / ``return_eids`` (``GraphTable.sample_neighbors`` gathers weights and
    edge ids too: two more random reads per sampled edge)."""
    ids = np.ascontiguousarray(nodes, dtype=np.int64)
    csr, pos, counts = table.sample_positions(ids, fanout, table.edge_type(None)[0])
    offsets = np.zeros(counts.shape[0] + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return csr.dst[pos], offsets


def split_work(halves, cfg, seeds: np.ndarray) -> float:
    """The 2-hop batch on two in-process tables holding server 0's and server 1's part of the
    graph: the seconds of the larger share of each hop, summed (each server's sampling work
    alone, with no RPC, as if each had a core of its own)."""
    from ps_server.core.routing import split_by_server

    total, nodes = 0.0, seeds
    for fanout in FANOUTS:
        _, keys = split_by_server(nodes, 2, cfg.num_shards)
        share, got = [], []
        for table, k in zip(halves, keys):
            t = time.perf_counter()
            got.append(table_sample(table, k, fanout)[0])
            share.append(time.perf_counter() - t)
        total += max(share)
        nodes = distinct(np.concatenate(got))
    return total


def distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values, by one ``np.sort``: ``np.unique`` of numpy 2.4 takes a hash
    path that is several times slower on these arrays (4 ms against 0.5 ms on 15,000 ids)."""
    s = np.sort(values)
    keep = np.ones(s.shape[0], bool)
    keep[1:] = s[1:] != s[:-1]
    return s[keep]


def two_hop(sample, seeds: np.ndarray) -> int:
    """GraphSAGE's 2-hop sampling from ``seeds``; returns the sampled edge count."""
    v1, _ = sample(seeds, FANOUTS[0])
    v2, _ = sample(distinct(v1), FANOUTS[1])
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
    cpus = sorted(os.sched_getaffinity(0))
    procs: list[subprocess.Popen] = []
    load_avg: list[tuple[float, ...]] = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        files = write_graph(root, args.nodes, args.edges, args.seed)
        print(f"wrote {args.edges} edges in {time.perf_counter() - t0:.1f}s", flush=True)
        try:
            eps = []
            for index, num, bound in ((0, 1, False), (0, 2, True), (1, 2, True), (0, 2, False),
                                      (1, 2, False)):  # fmt: skip
                proc, ep = start_server(index, num, bound)
                procs.append(proc)
                eps.append(ep)
            one = GraphClient(eps[:1], timeout_s=1200)
            two = GraphClient(eps[1:3], timeout_s=1200)
            free = GraphClient(eps[3:], timeout_s=1200)
            loads: dict[str, list[float]] = {"server": [], "numpy": [], "server_cpu": []}
            loads["numpy_cpu"] = []
            for rep in range(args.reps):  # the load rate: a fresh server each repetition
                proc, ep = start_server(0, 1)
                try:
                    with GraphClient([ep], timeout_s=1200) as fresh:
                        fresh.create_graph_table(cfg)
                        cpu, t = cpu_seconds(proc.pid), time.perf_counter()
                        fresh.load_edges("g", files)
                        loads["server"].append(args.edges / (time.perf_counter() - t))
                        loads["server_cpu"].append(args.edges / (cpu_seconds(proc.pid) - cpu))
                finally:
                    proc.kill()
                    proc.wait()
                cpu, t = time.process_time(), time.perf_counter()
                numpy_read(files)
                loads["numpy"].append(args.edges / (time.perf_counter() - t))
                loads["numpy_cpu"].append(args.edges / (time.process_time() - cpu))
                print(f"load rep {rep}: {loads['server'][-1] / 1e6:.2f} M edges/s (numpy read "
                      f"{loads['numpy'][-1] / 1e6:.2f})", flush=True)  # fmt: skip
            load_avg.append(os.getloadavg())
            for c in (one, two, free):
                c.create_graph_table(cfg)
                c.load_edges("g", files)
            local = GraphTable(cfg)
            local.load_edges(None, files)
            halves = [GraphTable(cfg, i, 2) for i in range(2)]
            for h in halves:
                h.load_edges(None, files)
            rng = np.random.default_rng(args.seed + 1)
            samplers = {
                "local": lambda s, f: table_sample(local, s, f),
                "1 server": lambda s, f: one.sample_neighbors("g", s, f),
                "2 servers": lambda s, f: two.sample_neighbors("g", s, f),
                "2 servers not bound": lambda s, f: free.sample_neighbors("g", s, f),
            }
            for s in samplers.values():  # warm up (CSR merge, channels)
                two_hop(s, rng.integers(0, args.nodes, SEEDS))
            times: dict[str, list[float]] = {k: [] for k in [*samplers, "split work"]}
            sampled: dict[str, int] = dict.fromkeys(samplers, 0)
            for rep in range(args.reps):
                batches = [rng.integers(0, args.nodes, SEEDS) for _ in range(args.batches)]
                for key, s in samplers.items():
                    t = time.perf_counter()
                    for seeds in batches:
                        sampled[key] += two_hop(s, seeds)
                    times[key].append((time.perf_counter() - t) / args.batches)
                work = [split_work(halves, cfg, seeds) for seeds in batches]
                times["split work"].append(sum(work) / args.batches)
                print(
                    f"rep {rep}: "
                    + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms/batch" for k, v in times.items()),
                    flush=True,
                )
            load_avg.append(os.getloadavg())
            one.close()
            two.close()
            free.close()
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
                f"wall time per batch, 2 servers (--ps_bind_cpus: half the cores each) vs 1 server "
                f"[{size}]",
                Stats.of(times["2 servers"]),
                Stats.of(times["1 server"]),
                "ours/peer, lower is better",
            ),
            (
                f"not bound: wall time per batch, 2 servers placed by the kernel vs 1 server "
                f"[{size}]",
                Stats.of(times["2 servers not bound"]),
                Stats.of(times["1 server"]),
                "ours/peer, lower is better",
            ),
            (
                f"sampling work alone: the larger of 2 servers' shares vs one table's, no RPC "
                f"[{size}]",
                Stats.of(times["split work"]),
                Stats.of(times["local"]),
                "ours/peer, lower is better",
            ),
            (
                f"load edges/s per server from text files vs numpy's read and split alone [{size}]",
                Stats.of(loads["server"]),
                Stats.of(loads["numpy"]),
                "ours/peer, higher is better",
            ),
            (
                f"load edges per CPU second of the server vs numpy's read and split per CPU "
                f"second [{size}]",
                Stats.of(loads["server_cpu"]),
                Stats.of(loads["numpy_cpu"]),
                "ours/peer, higher is better",
            ),
        ],  # fmt: skip
        "1 server >= 0.5x the local limit; 2 servers <= 0.7x one server's time; load >= 2 M edges/s",
        extra={
            "nodes": args.nodes,
            "edges": args.edges,
            "batches": args.batches,
            "cpus": cpus,
            "load_average": load_avg,
            "sampled_edges_per_batch": {
                k: v / (args.reps * args.batches) for k, v in sampled.items()
            },
        },
        json_path=args.json,
        unit="",
    )


if __name__ == "__main__":
    main()
