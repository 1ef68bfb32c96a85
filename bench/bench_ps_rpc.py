"""Parameter-server RPC throughput: sparse pull + push keys/s through real ``python -m ps_server``
processes, against a transport-only gRPC echo service moving the same bytes, in the same run.

For each dim (8, 16, 64) and server count (1, 2): one step = ``pull_sparse`` of 64k keys then
``push_sparse`` (mode apply) of their gradients, through :class:`ps_server.PSClient`. The peer
is an echo service (this script with ``--echo_server``, one process per server) that receives and
returns the same number of bytes per request (keys in, rows out; keys + grads in, a few bytes
out), with the same split of keys over servers (the same routing), the same number of round
trips and the same parallelism (one blocking call per server at once on a thread pool, as
PSClient does), and no work besides allocating the reply. The ratio ``ours / echo`` (keys/s) is the share of the raw
transport rate the PS keeps after protobuf, routing, the hash-table lookups and the optimizer
(goal >= 0.5). Median of ``--reps`` (>= 5) repetitions of ``--steps`` steps each, [min .. max].

Also measured in the same run: the same pull + push on one in-process ``SparseTable`` (no RPC),
and from it the serial bound ``1 / (1/table + 1/echo)`` — what a server would reach if it added
only the table work to the echo's transport time. At small dims the table work alone takes about
as long as the whole echo round trip, which caps ``ours / echo`` near 0.5 whatever the RPC layer
does; ``ours / bound`` shows how much of that cap the RPC layer keeps. (With 2 servers the table
work is split over two processes, so that bound is conservative.)

``ours`` is the TCP path (``PSClient(shm=False)``), the like-for-like comparison with the echo;
a second row per case times the same client with the same-host shared-memory path
(:mod:`ps_server.rpc.shm`, the default when client and servers share a host), which moves the
arrays outside gRPC and so is not bounded by the echo.

Run: ``.venv/bin/python bench/bench_ps_rpc.py [--json bench/results/ps_rpc.json]`` (~2 minutes
on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import REPO, Stats, bench_env, report

BATCH = 64 * 1024
ECHO_PULL = "/bench.Echo/Pull"
ECHO_PUSH = "/bench.Echo/Push"


# -- the echo peer -------------------------------------------------------------------------------
def run_echo_server(port: int, max_mb: int) -> None:
    """Serve Pull (keys in → ``n * dim * 4`` bytes out; dim from a 4-byte header) and Push
    (anything in → 8 bytes out) with raw-bytes (de)serializers, until killed."""
    import grpc

    def pull(request: bytes, context: object) -> bytes:
        dim = int.from_bytes(request[:4], "little")
        n = (len(request) - 4) // 8
        return bytes(n * dim * 4)

    def push(request: bytes, context: object) -> bytes:
        return len(request).to_bytes(8, "little")

    handlers = {
        "Pull": grpc.unary_unary_rpc_method_handler(pull),
        "Push": grpc.unary_unary_rpc_method_handler(push),
    }
    limit = max_mb << 20
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ],
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"echo serving on 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


def start_process(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    """Start a server process; returns it and the endpoint from its first stdout line."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=bench_env(), cwd=REPO
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "serving on" not in line:
        proc.kill()
        raise RuntimeError(f"{' '.join(cmd)} did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[-1]


class EchoClient:
    """Moves the bytes PSClient would move, with the same routing, splits and parallelism: one
    blocking call per server at once on a long-lived thread pool, as PSClient does (grpc's
    ``.future()`` starts a thread per call)."""

    def __init__(self, endpoints: list[str], max_mb: int) -> None:
        import grpc

        limit = max_mb << 20
        opts = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
        self.channels = [grpc.insecure_channel(e, options=opts) for e in endpoints]
        self.pull_calls = [c.unary_unary(ECHO_PULL) for c in self.channels]
        self.push_calls = [c.unary_unary(ECHO_PUSH) for c in self.channels]
        self.pool = futures.ThreadPoolExecutor(max_workers=max(4, 2 * len(endpoints)))

    def _call(self, calls: list, requests: list[bytes]) -> list[bytes]:
        if len(requests) == 1:
            return [calls[0](requests[0], timeout=60)]
        futs = [self.pool.submit(c, r, timeout=60) for c, r in zip(calls, requests)]
        return [f.result() for f in futs]

    def step(self, parts: list[np.ndarray], keys: np.ndarray, grads: np.ndarray, dim: int) -> None:
        head = dim.to_bytes(4, "little")
        used = [(s, p) for s, p in enumerate(parts) if p.shape[0]]
        replies = self._call(
            [self.pull_calls[s] for s, _ in used],
            [head + np.take(keys, p).tobytes() for _, p in used],
        )
        for r in replies:
            np.frombuffer(r, np.float32)
        self._call(
            [self.push_calls[s] for s, _ in used],
            [np.take(keys, p).tobytes() + np.take(grads, p, axis=0).tobytes() for _, p in used],
        )

    def close(self) -> None:
        self.pool.shutdown()
        for c in self.channels:
            c.close()


# -- the measurement ----------------------------------------------------------------------------
def measure(step, batches: list[tuple[np.ndarray, np.ndarray]], first: int, steps: int) -> float:
    """Million keys/s of ``steps`` steps over ``batches`` starting at batch ``first``."""
    t0 = time.perf_counter()
    for i in range(steps):
        keys, grads = batches[(first + i) % len(batches)]
        step(keys, grads)
    return steps * BATCH / (time.perf_counter() - t0) / 1e6


def start_servers(
    num_servers: int, max_mb: int, table_threads: int, extra: tuple[str, ...] = ()
) -> tuple[list[subprocess.Popen], list, list]:
    """``num_servers`` ps_server processes (with ``extra`` flags) and as many echo processes:
    (procs, eps, echo_eps)."""
    procs, eps, echo_eps = [], [], []
    for i in range(num_servers):
        proc, ep = start_process(
            [sys.executable, "-m", "ps_server", "--port", "0", "--server_index", str(i),
             "--num_servers", str(num_servers), "--max_message_mb", str(max_mb),
             "--table_threads", str(table_threads), "--log_level", "WARNING", *extra]
        )  # fmt: skip
        procs.append(proc)
        eps.append(ep)
        proc, ep = start_process(
            [sys.executable, os.path.abspath(__file__), "--echo_server", "--max_message_mb",
             str(max_mb)]
        )  # fmt: skip
        procs.append(proc)
        echo_eps.append(ep)
    return procs, eps, echo_eps


def bench_dim(
    client, shm_client, echo, num_servers: int, dim: int, rule, rng, universe, args
) -> dict:
    """ours (TCP) / ours (shm) / echo / table-only rates (M keys/s, lists of --reps) at one dim."""
    from ps_server import SparseTable, SparseTableConfig, Uniform
    from ps_server.core.routing import group_by_server

    table = f"bench_d{dim}"
    config = SparseTableConfig(table, dim, rule, Uniform(-0.01, 0.01))
    client.create_table_from_config(config)
    local = SparseTable(config)  # the same table work without any RPC
    batches = []
    for _ in range(8):
        keys = rng.choice(universe, size=BATCH, replace=False)
        batches.append((keys, rng.standard_normal((BATCH, dim), dtype=np.float32)))
    parts = {
        id(k): group_by_server(k, num_servers, config.num_shards)
        if num_servers > 1
        else [np.arange(BATCH)]
        for k, _ in batches
    }

    def ours(keys: np.ndarray, grads: np.ndarray) -> None:
        client.pull_sparse(table, keys)
        client.push_sparse(table, keys, grads)

    def ours_shm(keys: np.ndarray, grads: np.ndarray) -> None:
        shm_client.pull_sparse(table, keys)
        shm_client.push_sparse(table, keys, grads)

    def peer(keys: np.ndarray, grads: np.ndarray) -> None:
        echo.step(parts[id(keys)], keys, grads, dim)

    def table_only(keys: np.ndarray, grads: np.ndarray) -> None:
        local.pull(keys)
        local.push(keys, grads)

    for keys, _ in batches:  # create every row first: steady state, not growth
        client.pull_sparse(table, keys)
        local.pull(keys)
    fns = {"ours": ours, "shm": ours_shm, "peer": peer, "table": table_only}
    out: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        measure(f, batches, 0, 2)  # warm-up
    for r in range(args.reps):  # interleaved, so drift hits all alike
        for k, f in fns.items():
            out[k].append(measure(f, batches, r * args.steps, args.steps))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--echo_server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dims", default="8,16,64")
    p.add_argument("--servers", default="1,2")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=12, help="pull+push steps per repetition")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adagrad"])
    p.add_argument("--max_message_mb", type=int, default=64)
    p.add_argument(
        "--table_threads",
        type=int,
        default=None,
        help="servers' --table_threads, also used by the in-process table (default: "
        "ps_server's, the CPU count up to 8)",
    )
    p.add_argument(
        "--token",
        action="store_true",
        help="servers require a job token and the clients send it (ps_server.rpc.auth)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.echo_server:
        run_echo_server(args.port, args.max_message_mb)
        return
    if args.reps < 5:
        p.error("--reps must be >= 5")

    from ps_server import SGD, Adagrad, PSClient
    from ps_server.core import kernels
    from ps_server.server import default_table_threads

    threads = args.table_threads or default_table_threads()
    kernels.set_threads(threads)  # the table-only measurement splits its work like the servers
    print(f"table threads: {threads} per server and in the in-process table", flush=True)

    rule = SGD(0.01) if args.optimizer == "sgd" else Adagrad(0.05)
    rng = np.random.default_rng(0)
    universe = rng.integers(0, 2**62, size=4 * BATCH, dtype=np.int64)
    rows, extra = [], []
    token_dir = tempfile.TemporaryDirectory(prefix="bench_ps_rpc_")
    token, extra_flags = None, ()
    if args.token:
        token = "bench-" + os.urandom(16).hex()
        with open(os.path.join(token_dir.name, "token"), "w") as f:
            f.write(token)
        extra_flags = ("--token_file", os.path.join(token_dir.name, "token"))
    for num_servers in [int(s) for s in args.servers.split(",")]:
        procs: list[subprocess.Popen] = []
        try:
            procs, eps, echo_eps = start_servers(
                num_servers, args.max_message_mb, threads, extra_flags
            )
            client = PSClient(eps, max_message_mb=args.max_message_mb, shm=False, token=token)
            client.wait_ready(30)
            shm_client = PSClient(eps, max_message_mb=args.max_message_mb, shm=True, token=token)
            echo = EchoClient(echo_eps, args.max_message_mb)
            for dim in [int(d) for d in args.dims.split(",")]:
                r = bench_dim(client, shm_client, echo, num_servers, dim, rule, rng, universe, args)
                ours, shm, peer, table = (Stats.of(r[k]) for k in ("ours", "shm", "peer", "table"))
                mib = BATCH * (8 + 4 * dim) * 2 / 2**20
                label = (
                    f"dim {dim}, {num_servers} server(s), {BATCH} keys/request, "
                    f"{args.optimizer}, ~{mib:.1f} MiB moved per step"
                )
                rows.append((label, ours, peer, "ours/echo keys/s"))
                rows.append(
                    (f"{label} [ours through shared memory]", shm, peer, "ours/echo keys/s")
                )
                bound = 1 / (1 / table.median + 1 / peer.median)
                extra.append((label, table, bound, ours.median / bound))
            echo.close()
            shm_client.close()
            client.stop_servers()
            client.close()
            for proc in procs[::2]:
                proc.wait(timeout=30)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    report(
        "ps_server gRPC: sparse pull+push keys/s vs a gRPC echo moving the same bytes",
        rows,
        goal=">= 0.5",
        json_path=args.json,
        unit="M keys/s",
        extra={"table_only": [{"label": e[0], "table_m_keys_s": e[1].median,
                               "serial_bound_m_keys_s": e[2], "ours_over_bound": e[3]}
                              for e in extra]},
    )  # fmt: skip
    print(
        "\nwhere the time goes: the same pull+push on one in-process SparseTable (no RPC), and\n"
        "the best a server could do if it added only that table work to the echo's transport\n"
        "time (1 / (1/table + 1/echo)); ours/bound is the share of that bound we reach:"
    )
    for label, table, bound, share in extra:
        print(f"{label}\n  table only: {table.fmt('M keys/s')}\n"
              f"  bound {bound:.3f} M keys/s, ours/bound = {share:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
