"""Sparse parameter server: our gRPC ``ps_server`` against the two PSes users would otherwise
write (a Ray actor, torch.distributed.rpc), same workload, same run.

Workload (identical for every implementation): one sparse embedding table of dim D (8, 16, 64)
over a key space of 2**20 keys, updated with plain SGD (lr 0.01, duplicated keys of a push
summed first: the rule of all three). One round = pull 65,536 int64 keys, then push the same keys
with float32[65536, D] gradients, each call waiting for its reply. The key batches are drawn
once with a fixed seed and shared by every implementation: ``zipf`` (rank ~ Zipf(1.2), mapped
through a fixed random permutation of the key space, so hot keys are scattered; ~21% distinct
keys per batch) and/or ``uniform`` (with replacement). keys/s = keys per round x rounds / wall
time; a key pulled and pushed in one round counts once.

Implementations (the benchmark process is the only trainer of each; 1 server process each):

* ``ours``: ``python -m ps_server`` on 127.0.0.1 (1 process; also 2 with ``--ours_servers 1,2``,
  keys routed by the client), driven through :class:`ps_server.PSClient`. Rows are created on
  first pull (hash table, any int64 key). By default the client moves the large arrays through
  shared memory, as it does whenever client and server share a host (:mod:`ps_server.rpc.shm`; the
  peers do the same: Ray's object store, TensorPipe's shm channel); ``--ours_transport tcp``
  sends everything through gRPC over loopback TCP instead.
* ``ray``: the "Parameter Server" example of Ray's documentation (Ray Core examples) adapted to a
  sparse table: an actor ``ParameterServer`` that, as in the docs, owns a torch module and a
  ``torch.optim.SGD`` over its parameters; here the module is ``torch.nn.Embedding(2**20, D,
  sparse=True)`` (the docs' style: a torch model plus a torch optimizer; a dict of numpy rows
  would be slower still). ``pull(keys: np.ndarray) -> np.ndarray`` indexes the weight;
  ``push(keys, grads)`` sets a sparse COO gradient and calls ``optimizer.step()``. The trainer
  calls ``ray.get(ps.pull.remote(keys))`` / ``ray.get(ps.push.remote(keys, grads))``. Ray runs
  locally: ``ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")`` with
  ``RAY_USAGE_STATS_ENABLED=0`` and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: without the latter
  Ray replaces 127.0.0.1 by the host's routable address and its gcs_server, raylet and workers
  listen on ``*`` (checked with this Ray, 2.60).
* ``rpc``: the torch tutorial "Implementing a Parameter Server Using Distributed RPC Framework":
  a server process (rank 0, ``rpc.init_rpc("ps", rank=0, world_size=2)``, TensorPipe) holding a
  global server object (created under a lock, as the tutorial's ``get_parameter_server``), with
  module-level functions the trainer (rank 1, this process) calls via ``rpc.rpc_sync("ps",
  rpc_pull, args=(dim, keys))`` / ``rpc_push`` with torch tensors. The table is the same
  ``nn.Embedding`` + SGD as the Ray actor (:class:`EmbeddingTable`), so the two peers differ only
  in transport. Rendezvous: ``init_method="file://..."``, not ``env://`` (MASTER_ADDR/PORT):
  the env:// TCPStore of rank 0 listens on ``*:MASTER_PORT`` whatever MASTER_ADDR says, and we
  keep every listener on loopback; TensorPipe itself listens on 127.0.0.1
  (``TP_SOCKET_IFNAME=lo``). The rendezvous is not on the measured path.

Key space (``--key_space``). ``int64`` (default, the workload of the goal): the keys are 2**20
random ids spread over the full signed 64-bit range, as CTR feature ids are. The peers then need
an id -> row map, and they get the one a user of Ray's or torch's example would write: a Python
dict, rows assigned on first sight (``EmbeddingTable.rows``), in front of the same preallocated
``nn.Embedding``. ``dense``: the keys are 0..2**20-1 and the peers index their weight directly —
which only works for a small, known key space, so it is the peers' best case, kept for
reference; ours hashes arbitrary int64 keys and grows in both.

Method: per (distribution, dim) every implementation first passes a check of the SGD rule
(duplicates included), then one warm-up pass over all key batches (creates ours' rows: steady
state, not growth). Then ``--reps`` (>= 5) repetitions, alternating the implementations (the
order rotates each repetition) so drift hits all alike; a repetition runs whole rounds until
``--rep_seconds`` (>= 1 s, default 1.2) have passed, so a slow implementation runs fewer rounds
(the fewest rounds of a repetition and the shortest repetition are printed). Reported: median
[min .. max] million keys/s and the ratios ours/peer of the medians (goal: >= 3). All server
processes of all implementations are up during all measurements (2 CPUs: idle daemons cost
everyone a little). Every process started is stopped at the end, also on error or Ctrl-C; the
TCP listeners of every process started are checked once (loopback only, else the run aborts).

Run: ``.venv/bin/python bench/bench_ps_peers.py [--json bench/results/ps_peers.json]``
(needs ``pip install ray``; ~4 minutes on 2 cores with the defaults).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import REPO, Stats, bench_env, machine_info, report

BATCH = 64 * 1024
"""Keys per pull (and per push) of one round."""
NUM_KEYS = 1 << 20
"""Size of the key space (the peers' dense weight has this many rows)."""
LR = 0.01
"""SGD learning rate of every implementation."""
ZIPF_A = 1.2
"""Exponent of the Zipf-ish key distribution."""
NUM_BATCHES = 8
"""Distinct key batches, cycled through by the rounds."""
RPC_TIMEOUT_S = 120.0


# -- the table both peers hold -----------------------------------------------------------------
class EmbeddingTable:
    """``nn.Embedding(num_keys, dim, sparse=True)`` + ``torch.optim.SGD``: the server-side state
    of both peers (a torch model and its optimizer, as in Ray's and torch's examples)."""

    def __init__(self, num_keys: int, dim: int, lr: float, keyed: bool = False) -> None:
        self.embedding = torch.nn.Embedding(num_keys, dim, sparse=True)
        torch.nn.init.uniform_(self.embedding.weight, -0.01, 0.01)  # ours' default initializer
        self.optimizer = torch.optim.SGD(self.embedding.parameters(), lr=lr)
        self.index: dict[int, int] | None = {} if keyed else None
        """keyed (``--key_space int64``): arbitrary int64 ids -> rows, assigned on first sight."""

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows of ``keys``: the keys themselves, or (keyed) their rows in the id -> row dict."""
        if self.index is None:
            return keys
        index = self.index
        ids = keys.tolist()
        return torch.tensor([index.setdefault(k, len(index)) for k in ids], dtype=torch.int64)

    def pull(self, keys: torch.Tensor) -> torch.Tensor:
        """float32[n, dim]: the rows of ``keys`` (a copy)."""
        with torch.no_grad():
            return self.embedding.weight[self.rows(keys)]

    def push(self, keys: torch.Tensor, grads: torch.Tensor) -> None:
        """One SGD step with the sparse gradient ``grads`` at rows ``keys`` (duplicates sum)."""
        keys = self.rows(keys)
        weight = self.embedding.weight
        self.optimizer.zero_grad()
        weight.grad = torch.sparse_coo_tensor(
            keys.unsqueeze(0), grads, weight.shape, check_invariants=False
        )
        self.optimizer.step()


# -- peer 1: the Ray actor (decorated with ray.remote at run time: ray is optional) -----------
class ParameterServer:
    """The body of the Ray actor, after the "Parameter Server" example of Ray's docs."""

    def __init__(self, num_keys: int, dim: int, lr: float, keyed: bool = False) -> None:
        # Ray hands array arguments over read-only (zero-copy from the object store); reading
        # them through torch is safe, the warning about it is noise.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        torch.set_num_threads(1)
        self.table = EmbeddingTable(num_keys, dim, lr, keyed)

    def pull(self, keys: np.ndarray) -> np.ndarray:
        """float32[n, dim]: the rows of ``keys``."""
        return self.table.pull(torch.from_numpy(keys)).numpy()

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        """Apply ``grads`` float32[n, dim] to the rows of ``keys``."""
        self.table.push(torch.from_numpy(keys), torch.from_numpy(grads))


# -- peer 2: torch.distributed.rpc, server side (module-level, as in the tutorial) -------------
_server: dict[int, EmbeddingTable] | None = None
_server_lock = threading.Lock()


def get_parameter_server() -> dict[int, EmbeddingTable]:
    """The server process's global state (one table per dim), created on first use."""
    global _server
    with _server_lock:
        if _server is None:
            _server = {}
        return _server


def rpc_create_table(dim: int, num_keys: int, lr: float, keyed: bool = False) -> None:
    """(Re)create the table of ``dim``; drops the others to bound memory."""
    server = get_parameter_server()
    server.clear()
    server[dim] = EmbeddingTable(num_keys, dim, lr, keyed)


def rpc_pull(dim: int, keys: torch.Tensor) -> torch.Tensor:
    """float32[n, dim]: the rows of ``keys`` of the table of ``dim``."""
    return get_parameter_server()[dim].pull(keys)


def rpc_push(dim: int, keys: torch.Tensor, grads: torch.Tensor) -> None:
    """Apply ``grads`` to the rows of ``keys`` of the table of ``dim``."""
    get_parameter_server()[dim].push(keys, grads)


def _rpc_options(init_method: str) -> Any:
    from torch.distributed import rpc

    # torch's own rpc init trips its deprecation warning about ProcessGroupGloo: not ours to fix
    warnings.filterwarnings("ignore", message="You are using a Backend")
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=RPC_TIMEOUT_S)


def run_rpc_server(init_method: str) -> None:
    """Rank 0: serve until the trainer shuts RPC down (``rpc.shutdown`` waits for it)."""
    from torch.distributed import rpc

    torch.set_num_threads(1)
    rpc.init_rpc("ps", rank=0, world_size=2, rpc_backend_options=_rpc_options(init_method))
    rpc.shutdown()


# -- the trainer-side handles --------------------------------------------------------------------
class SparsePS(Protocol):
    """One table of one implementation, as the trainer sees it."""

    def pull(self, keys: np.ndarray) -> np.ndarray:
        """float32[n, dim]: the rows of ``keys``."""
        ...

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        """Apply ``grads`` float32[n, dim] to the rows of ``keys`` (waits for the reply)."""
        ...


@dataclass
class OursTable:
    """A table of our servers through :class:`ps_server.PSClient`."""

    client: Any
    name: str

    def pull(self, keys: np.ndarray) -> np.ndarray:
        return self.client.pull_sparse(self.name, keys)

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        self.client.push_sparse(self.name, keys, grads)


@dataclass
class RayTable:
    """A ``ParameterServer`` actor (one per dim)."""

    actor: Any

    def pull(self, keys: np.ndarray) -> np.ndarray:
        import ray

        return ray.get(self.actor.pull.remote(keys))

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        import ray

        ray.get(self.actor.push.remote(keys, grads))


@dataclass
class RpcTable:
    """The table of ``dim`` on the rpc server."""

    dim: int

    def pull(self, keys: np.ndarray) -> np.ndarray:
        from torch.distributed import rpc

        return rpc.rpc_sync("ps", rpc_pull, args=(self.dim, torch.from_numpy(keys))).numpy()

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        from torch.distributed import rpc

        rpc.rpc_sync(
            "ps", rpc_push, args=(self.dim, torch.from_numpy(keys), torch.from_numpy(grads))
        )


# -- starting and stopping everything ------------------------------------------------------------
def start_ps_server(index: int, num_servers: int, stack: contextlib.ExitStack) -> str:
    """Start ``python -m ps_server``; returns its endpoint (from its first stdout line)."""
    cmd = [
        sys.executable,
        "-m",
        "ps_server",
        "--port",
        "0",
        "--server_index",
        str(index),
        "--num_servers",
        str(num_servers),
        "--log_level",
        "WARNING",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=bench_env(), cwd=REPO
    )
    stack.callback(_kill, proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "serving on" not in line:
        raise RuntimeError(f"{' '.join(cmd)} did not start (exit {proc.poll()}): {line!r}")
    return line.strip().rsplit(" ", 1)[-1]


def _kill(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Wait ``grace_s`` for ``proc`` to exit (it was asked to stop), then kill it."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_ours(num_servers: int, stack: contextlib.ExitStack, shm: bool = True) -> Any:
    """Start ``num_servers`` servers; returns a ready client (servers stopped on exit)."""
    from ps_server import PSClient

    endpoints = [start_ps_server(i, num_servers, stack) for i in range(num_servers)]
    client = PSClient(endpoints, shm=shm)
    stack.callback(client.close)
    stack.callback(_stop_servers, client)
    client.wait_ready(30)
    return client


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _stop_servers(client: Any) -> None:
    from ps_server.rpc.status import PSRpcError

    try:
        client.stop_servers()
    except PSRpcError as err:  # already gone: the process is killed after its grace period
        print(f"stopping ps_server: {err}", file=sys.stderr)


def start_ray(stack: contextlib.ExitStack) -> Any:
    """``ray.init`` on loopback only; returns the ``ParameterServer`` actor class."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Without this, ray.init turns _node_ip_address="127.0.0.1" into the routable address and
    # binds its servers to it / to all interfaces; it must be set before ray is imported.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray
    except ImportError as err:
        raise SystemExit(
            f"the Ray peer needs ray ({err}): `pip install -c constraints.txt ray`, "
            "or leave it out with --peers rpc"
        ) from err

    stack.callback(ray.shutdown)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    return ray.remote(ParameterServer)


def start_rpc(stack: contextlib.ExitStack) -> None:
    """Start the rpc server process (rank 0) and join as the trainer (rank 1)."""
    from torch.distributed import rpc

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_ps_peers_"))
    init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
    env = {**bench_env(), "TP_SOCKET_IFNAME": "lo"}
    os.environ["TP_SOCKET_IFNAME"] = "lo"
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--rpc_server", "--rpc_init", init_method],
        env=env,
        cwd=REPO,
    )
    stack.callback(_kill, proc, 30.0)
    rpc.init_rpc("trainer", rank=1, world_size=2, rpc_backend_options=_rpc_options(init_method))
    # graceful: also lets the server's rpc.shutdown() return
    stack.callback(rpc.shutdown, graceful=True, timeout=30)


def listeners_of_started_processes() -> list[tuple[str, bool]]:
    """``("ip:port (pid, name)", on_loopback)`` for every TCP listener of this process and its
    descendants (our servers, Ray's daemons and workers, the rpc server)."""
    import psutil

    me = psutil.Process()
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in pids:
            continue
        ip = conn.laddr.ip
        loopback = ip.startswith(("127.", "::ffff:127.")) or ip == "::1"
        name = psutil.Process(conn.pid).name()
        out.append((f"{ip}:{conn.laddr.port} (pid {conn.pid}, {name})", loopback))
    return sorted(out)


# -- the workload and the measurement ------------------------------------------------------------
def make_key_batches(dist: str, seed: int, key_space: str = "int64") -> list[np.ndarray]:
    """``NUM_BATCHES`` int64[BATCH] key batches of distribution ``dist`` (fixed seed): indices
    into the ``NUM_KEYS`` key space, or (``int64``) the ids of those indices — ``NUM_KEYS``
    random ids over the full signed 64-bit range, the keys a CTR model really sends."""
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        batches = [rng.integers(0, NUM_KEYS, BATCH, dtype=np.int64) for _ in range(NUM_BATCHES)]
    else:
        perm = rng.permutation(NUM_KEYS).astype(np.int64)
        batches = [perm[(rng.zipf(ZIPF_A, BATCH) - 1) % NUM_KEYS] for _ in range(NUM_BATCHES)]
    if key_space == "dense":
        return batches
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, size=NUM_KEYS + 4096, dtype=np.int64))
    ids = rng.permutation(ids)[:NUM_KEYS]
    return [ids[b] for b in batches]


def check_sgd(name: str, table: SparsePS, dim: int) -> None:
    """Pull, push ones (key 0 twice), pull: every row must move by -LR x its count."""
    keys = np.array([0, 0, 1, 2, NUM_KEYS - 1], dtype=np.int64)
    before = table.pull(keys)
    table.push(keys, np.ones((keys.shape[0], dim), np.float32))
    after = table.pull(keys)
    expected = before - LR * np.array([2, 2, 1, 1, 1], np.float32)[:, None]
    if not np.allclose(after, expected, atol=1e-6):
        raise AssertionError(f"{name}: SGD check failed: {after[:, 0]} != {expected[:, 0]}")


def run_for(
    table: SparsePS, keys: list[np.ndarray], grads: list[np.ndarray], first: int, min_seconds: float
) -> tuple[int, float]:
    """Pull+push rounds from batch ``first`` on until ``min_seconds`` have passed (whole
    rounds); returns (rounds, wall seconds)."""
    rounds = 0
    t0 = time.perf_counter()
    while True:
        i = (first + rounds) % NUM_BATCHES
        table.pull(keys[i])
        table.push(keys[i], grads[i])
        rounds += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return rounds, elapsed


@dataclass(frozen=True)
class Measured:
    """Million keys/s of one implementation at one (distribution, dim)."""

    keys_per_s: Stats
    rounds: list[int]
    """Rounds of each repetition."""
    seconds: list[float]
    """Wall seconds of each repetition."""


def measure(
    tables: dict[str, SparsePS],
    keys: list[np.ndarray],
    dim: int,
    reps: int,
    rep_seconds: float,
    seed: int,
) -> dict[str, Measured]:
    """Check, warm up and measure every table, alternating per repetition."""
    rng = np.random.default_rng(seed + dim)
    grads = [rng.standard_normal((BATCH, dim), dtype=np.float32) for _ in range(NUM_BATCHES)]
    names = list(tables)
    for name in names:
        check_sgd(name, tables[name], dim)
        for i in range(NUM_BATCHES):  # warm-up: every key batch once
            tables[name].pull(keys[i])
            tables[name].push(keys[i], grads[i])
    done = dict.fromkeys(names, 0)
    rates: dict[str, list[float]] = {n: [] for n in names}
    rounds: dict[str, list[int]] = {n: [] for n in names}
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            n, sec = run_for(tables[name], keys, grads, done[name], rep_seconds)
            done[name] += n
            rates[name].append(n * BATCH / sec / 1e6)
            rounds[name].append(n)
            seconds[name].append(sec)
    return {n: Measured(Stats.of(rates[n]), rounds[n], seconds[n]) for n in names}


def ours_names(servers: list[int]) -> list[str]:
    return [f"ours x{n}" if n > 1 else "ours" for n in servers]


def run(
    args: argparse.Namespace,
) -> tuple[dict[tuple[str, int], dict[str, Measured]], list[tuple[str, bool]]]:
    """Start everything, measure every (distribution, dim), stop everything."""
    results: dict[tuple[str, int], dict[str, Measured]] = {}
    with contextlib.ExitStack() as stack:
        clients = {
            name: start_ours(n, stack, shm=args.ours_transport == "shm")
            for name, n in zip(ours_names(args.ours_servers), args.ours_servers)
        }
        actor_cls = start_ray(stack) if "ray" in args.peers else None
        if "rpc" in args.peers:
            start_rpc(stack)
        # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the stack stops everything; set
        # after ray.init, which installs its own fatal-signal handler for SIGTERM.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        listeners = listeners_of_started_processes()
        bad = [addr for addr, loopback in listeners if not loopback]
        if bad:
            raise RuntimeError(
                f"processes this run started listen on non-loopback addresses: "
                f"{bad}; nothing may (fix the binding before measuring)"
            )
        print(
            f"{len(listeners)} TCP listeners of the processes started, all on loopback", flush=True
        )
        keyed = args.key_space == "int64"
        for dist in args.dists:
            keys = make_key_batches(dist, args.seed, args.key_space)
            distinct = np.mean([np.unique(k).shape[0] for k in keys]) / BATCH
            for dim in args.dims:
                tables: dict[str, SparsePS] = {}
                for name, client in clients.items():
                    table = f"peers_{dist}_d{dim}"
                    client.create_table(table, dim=dim, optimizer=_sgd())
                    tables[name] = OursTable(client, table)
                actor = None
                if actor_cls is not None:
                    actor = actor_cls.remote(NUM_KEYS, dim, LR, keyed)
                    tables["ray"] = RayTable(actor)
                if "rpc" in args.peers:
                    from torch.distributed import rpc

                    rpc.rpc_sync("ps", rpc_create_table, args=(dim, NUM_KEYS, LR, keyed))
                    tables["rpc"] = RpcTable(dim)
                t0 = time.perf_counter()
                results[(dist, dim)] = measure(
                    tables, keys, dim, args.reps, args.rep_seconds, args.seed
                )
                print(
                    f"  {dist} (~{distinct:.0%} distinct keys/batch) dim {dim}: "
                    f"{time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
                if actor is not None:
                    import ray

                    ray.kill(actor)
    return results, listeners


def _sgd() -> Any:
    from ps_server import SGD

    return SGD(LR)


def print_table(
    results: dict[tuple[str, int], dict[str, Measured]], ours: list[str], peers: list[str]
) -> None:
    """keys/s (millions) median [min .. max] per implementation, and ours/peer ratios."""
    names = ours + peers
    head = f"{'dist':8} {'dim':>4} " + " ".join(f"{n:>24}" for n in names)
    ratio_cols = [f"{o}/{p}" for o in ours for p in peers]
    print(
        "\nM keys/s (pull+push of a key counted once), median [min .. max], and the fewest "
        "rounds of a repetition\n"
    )
    print(head + "  " + " ".join(f"{c:>12}" for c in ratio_cols))
    for (dist, dim), row in results.items():
        cells = []
        for n in names:
            s = row[n].keys_per_s
            cells.append(f"{s.median:6.2f} [{s.min:5.2f}..{s.max:5.2f}] {min(row[n].rounds):3d}r")
        ratios = [row[o].keys_per_s.median / row[p].keys_per_s.median for o in ours for p in peers]
        print(
            f"{dist:8} {dim:>4} "
            + " ".join(f"{c:>24}" for c in cells)
            + "  "
            + " ".join(f"{r:12.2f}" for r in ratios)
        )
    shortest = min(min(m.seconds) for row in results.values() for m in row.values())
    print(f"\nshortest repetition: {shortest:.2f} s; goal: every ours/peer >= 3\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rpc_server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rpc_init", default="", help=argparse.SUPPRESS)
    p.add_argument("--dims", default="8,16,64")
    p.add_argument("--dists", default="zipf,uniform", help="zipf and/or uniform")
    p.add_argument("--peers", default="ray,rpc", help="ray and/or rpc")
    p.add_argument("--ours_servers", default="1,2", help="server counts of ours to run")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--rep_seconds",
        type=float,
        default=1.2,
        help="least wall time of one repetition (whole rounds, >= 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--key_space",
        default="int64",
        choices=["int64", "dense"],
        help="int64: keys are ids over the full 64-bit range (the workload of the goal; the "
        "peers map them to rows with a dict); dense: keys are 0..2**20-1 (peers index directly)",
    )
    p.add_argument(
        "--ours_transport",
        default="shm",
        choices=["shm", "tcp"],
        help="shm: PSClient's default on one host (the arrays through shared memory, as the "
        "peers' Ray object store and TensorPipe shm channel do); tcp: everything through gRPC",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.rpc_server:
        return args
    args.dims = [int(d) for d in args.dims.split(",")]
    args.dists = args.dists.split(",")
    args.peers = [x for x in args.peers.split(",") if x]
    args.ours_servers = [int(n) for n in args.ours_servers.split(",")]
    if args.reps < 5:
        p.error(f"--reps must be >= 5, got {args.reps}")
    if set(args.dists) - {"zipf", "uniform"} or set(args.peers) - {"ray", "rpc"}:
        p.error(f"--dists must name zipf/uniform, --peers ray/rpc; got {args.dists} {args.peers}")
    if args.rep_seconds < 1.0:
        p.error(f"--rep_seconds must be >= 1 (each repetition >= 1 s), got {args.rep_seconds}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rpc_server:
        run_rpc_server(args.rpc_init)
        return
    import psutil  # noqa: F401 - needed by the listener check; fail before starting anything

    torch.set_num_threads(1)
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    t0 = time.perf_counter()
    results, listeners = run(args)
    ours = ours_names(args.ours_servers)
    print_table(results, ours, args.peers)
    rows = []
    for (dist, dim), row in results.items():
        for o in ours:
            for peer in args.peers:
                label = (
                    f"{dist} {args.key_space} keys, dim {dim}: {o} ({args.ours_transport}) "
                    f"vs {peer} ({BATCH} keys/round, SGD)"
                )
                rows.append((label, row[o].keys_per_s, row[peer].keys_per_s, "ours/peer keys/s"))
    extra = {
        "config": {
            "batch": BATCH,
            "num_keys": NUM_KEYS,
            "lr": LR,
            "zipf_a": ZIPF_A,
            "reps": args.reps,
            "rep_seconds": args.rep_seconds,
            "seed": args.seed,
            "key_space": args.key_space,
            "ours_transport": args.ours_transport,
        },
        "versions": _versions(),
        "listeners": [addr for addr, _ in listeners],
        "results": [
            {"dist": d, "dim": dim, **{n: asdict(m) for n, m in row.items()}}
            for (d, dim), row in results.items()
        ],
        "total_s": time.perf_counter() - t0,
    }
    report(
        "sparse PS pull+push keys/s: ps_server (gRPC) vs Ray actor PS vs torch.distributed.rpc PS",
        rows,
        goal=">= 3",
        extra=extra,
        json_path=args.json,
        unit="M keys/s",
    )
    print(f"total {time.perf_counter() - t0:.0f} s")


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "numpy": np.__version__}
    with contextlib.suppress(ImportError):
        import ray

        out["ray"] = ray.__version__
    import grpc

    out["grpcio"] = grpc.__version__
    return out


if __name__ == "__main__":
    main()
