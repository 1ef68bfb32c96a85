"""Security goal of the parameter server: calls without the job's token, with a wrong one, and
garbage change nothing and leave the server serving; the token check costs the hot path nothing
measurable.

Against real ``python -m ps_server`` processes on 127.0.0.1 (``A`` requires a token, ``B`` has
none), in one run:

* ``--calls`` (default 10^4) calls of each kind to A, in ``--reps`` (>= 5) interleaved
  repetitions: well-formed requests of every RPC (Stop, Shrink, Save, Load, pushes, ...) with no
  token; the same with a wrong token; random bytes (0-2 KiB) as the request of every method
  path, through a raw channel with identity serializers, with no token — each must be refused
  UNAUTHENTICATED; and random bytes *with* the token to the methods whose payload is parsed
  (pulls, pushes, CreateTable, InitDense, ...; none whose empty request acts, like Stop or
  EndDay): any answer but INTERNAL (a bug) or a crash. After every repetition of every kind, a
  valid request must succeed. The peer: the same number of trivial valid calls (ListTables with
  the token) — the ratio says what a refusal costs next to serving.
* Before and after everything, a full save through the job's client: the shard files (every
  row, optimizer state, dense block) must be identical, byte for byte.
* Hot path: 1-key PullSparse calls, and pull+push of 64k keys (dim 16), through PSClient to A
  (token checked per call) vs to B (no check), alternating every 20 calls / every step so that
  the load of a shared machine hits both alike: ratio ours (A) / peer (B).

Exit status 1 when a call that should have been refused was not, an INTERNAL answer, a failed
valid request, or a changed table. Run: ``.venv/bin/python bench/bench_ps_security.py [--json
bench/results/ps_security.json]`` (~1-2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_ps_rpc import start_process
from bench.common import Stats, report

TOKEN = "bench-" + os.urandom(16).hex()
DIM = 8
HOT_BATCH = 64 * 1024
SIDE_EFFECT_WHEN_EMPTY = {"Stop", "EndDay", "Shrink", "Save", "Load", "Barrier"}
"""Methods whose garbage request may decode to a valid one that acts: not sent with the token."""


def _requests(tmp: Path) -> dict[str, Any]:
    """One well-formed request per RPC (the job would be hurt if a stranger's went through)."""
    from ps_server.rpc.proto import ps_pb2

    keys = np.arange(64, dtype=np.int64)
    seg = "fleetps_" + "0" * 32
    return {
        "CreateTable": ps_pb2.CreateTableRequest(
            config_json=json.dumps({"kind": "sparse", "name": "evil", "dim": 2})
        ),
        "ListTables": ps_pb2.ListTablesRequest(),
        "PullSparse": ps_pb2.PullSparseRequest(table="emb", keys=(keys + 10**6).tobytes()),
        "PushSparse": ps_pb2.PushSparseRequest(
            table="emb",
            keys=keys.tobytes(),
            grads=np.ones((64, DIM), np.float32).tobytes(),
            mode=ps_pb2.PUSH_MODE_APPLY,
        ),
        "InitDense": ps_pb2.InitDenseRequest(table="d", name="x", values=b"\0" * 16),
        "PullDense": ps_pb2.PullDenseRequest(table="d", name="w"),
        "PushDense": ps_pb2.PushDenseRequest(
            table="d", name="w", grad=np.ones(8, np.float32).tobytes(), mode=ps_pb2.PUSH_MODE_APPLY
        ),
        "Save": ps_pb2.SaveRequest(dir=str(tmp / "stolen")),
        "Load": ps_pb2.LoadRequest(dir=str(tmp / "before")),
        "Shrink": ps_pb2.ShrinkRequest(table="emb", unseen_days=0),
        "EndDay": ps_pb2.EndDayRequest(),
        "Barrier": ps_pb2.BarrierRequest(name="b", count=2, timeout_s=0.01),
        "ShmAttach": ps_pb2.ShmAttachRequest(segment=seg, token=b"x" * 16),
        "ShmDetach": ps_pb2.ShmDetachRequest(segment=seg),
        "Stats": ps_pb2.StatsRequest(),
        "Stop": ps_pb2.StopRequest(),
    }


def _snapshot(client: Any, directory: Path) -> dict[str, bytes]:
    """The bytes of every shard file of a full save (the tables' whole contents)."""
    client.save(str(directory))
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*.bin"))}


class Attack:
    """Raw calls to one server: ``send(kind, i)`` makes call ``i`` of a kind and returns its
    status code name."""

    def __init__(self, endpoint: str, tmp: Path, seed: int = 0) -> None:
        import grpc

        from ps_server.rpc.auth import METADATA_KEY
        from ps_server.rpc.service import SERVICE_NAME

        self.grpc = grpc
        self.channel = grpc.insecure_channel(endpoint)
        reqs = _requests(tmp)
        self.names = sorted(reqs)
        self.bodies = [reqs[n].SerializeToString() for n in self.names]
        self.raw = [
            self.channel.unary_unary(f"/{SERVICE_NAME}/{n}") for n in self.names
        ]  # bytes in/out
        self.parsed = [i for i, n in enumerate(self.names) if n not in SIDE_EFFECT_WHEN_EMPTY]
        rng = np.random.default_rng(seed)
        self.garbage = [rng.bytes(int(n)) for n in rng.integers(0, 2048, 512)]
        self.metadata = {
            "no token": None,
            "wrong token": ((METADATA_KEY, TOKEN[::-1]),),
            "garbage, no token": None,
            "garbage, job token": ((METADATA_KEY, TOKEN),),
        }

    def serve(self, i: int) -> None:
        """A trivial valid call (ListTables with the job's token): the peer of a refusal."""
        method = self.names.index("ListTables")
        self.raw[method](
            self.bodies[method], timeout=10, metadata=self.metadata["garbage, job token"]
        )

    def send(self, kind: str, i: int) -> str:
        if kind.startswith("garbage"):
            pool = self.parsed if kind.endswith("job token") else range(len(self.names))
            method, body = list(pool)[i % len(pool)], self.garbage[i % len(self.garbage)]
        else:
            method = i % len(self.names)
            body = self.bodies[method]
        try:
            self.raw[method](body, timeout=10, metadata=self.metadata[kind])
            return "OK"
        except self.grpc.RpcError as err:
            return err.code().name


def _rate(fn: Any, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - t0)


def run_attacks(attack: Attack, job: Any, args: argparse.Namespace) -> tuple[list, dict, list[str]]:
    """The refusal rows, the status codes seen per kind, and what went wrong."""
    per_rep = args.calls // args.reps
    kinds = list(attack.metadata)
    rates: dict[str, list[float]] = {k: [] for k in [*kinds, "served"]}
    codes: dict[str, collections.Counter] = {k: collections.Counter() for k in kinds}
    problems: list[str] = []
    for rep in range(args.reps):
        for kind in kinds:

            def one(i: int, kind: str = kind, first: int = rep * per_rep) -> None:
                codes[kind][attack.send(kind, first + i)] += 1

            rates[kind].append(_rate(one, per_rep))
            try:  # the server still serves the job
                job.stats()
            except Exception as err:  # noqa: BLE001 - reported, the run fails
                problems.append(f"after {kind!r} rep {rep}: a valid request failed: {err}")
        rates["served"].append(_rate(attack.serve, per_rep))
    for kind in kinds:
        wrong = {c: n for c, n in codes[kind].items() if c != "UNAUTHENTICATED"}
        if kind != "garbage, job token" and wrong:
            problems.append(f"{kind}: {wrong} calls were not refused UNAUTHENTICATED")
        if kind == "garbage, job token" and ("INTERNAL" in wrong or "UNKNOWN" in wrong):
            problems.append(f"garbage with the token hit a bug: {dict(codes[kind])}")
    served = Stats.of(rates["served"])
    rows = [
        (
            f"{per_rep * args.reps} calls, {kind} -> {dict(codes[kind])}",
            Stats.of(rates[kind]),
            served,
            "calls/s of these / calls/s of ListTables served",
        )
        for kind in kinds
    ]
    return rows, {k: dict(v) for k, v in codes.items()}, problems


def run_hot_path(a: Any, b: Any, args: argparse.Namespace) -> list:
    """1-key pulls and 64k-key pull+push: the server with the token check (a) vs without (b)."""
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**62, HOT_BATCH, dtype=np.int64)
    grads = rng.standard_normal((HOT_BATCH, 16), dtype=np.float32)
    one = np.array([7], dtype=np.int64)
    for c in (a, b):
        c.create_table("hot", 16, num_shards=8)
        c.pull_sparse("hot", keys)  # rows exist: steady state
    small: dict[str, list[float]] = {"a": [], "b": []}
    big: dict[str, list[float]] = {"a": [], "b": []}
    block = 20  # the servers alternate every 20 small calls / every step: load drift hits both
    for _ in range(args.reps):
        spent = {"a": 0.0, "b": 0.0}
        for _ in range(max(1, args.small_calls // block)):
            for name, c in (("a", a), ("b", b)):
                t0 = time.perf_counter()
                for _ in range(block):
                    c.pull_sparse("emb", one)
                spent[name] += time.perf_counter() - t0
        for name in spent:
            small[name].append(max(1, args.small_calls // block) * block / spent[name])
        spent = {"a": 0.0, "b": 0.0}
        for _ in range(args.big_steps):
            for name, c in (("a", a), ("b", b)):
                t0 = time.perf_counter()
                c.pull_sparse("hot", keys)
                c.push_sparse("hot", keys, grads)
                spent[name] += time.perf_counter() - t0
        for name in spent:
            big[name].append(args.big_steps * HOT_BATCH / spent[name] / 1e6)
    return [
        (
            "hot path: PullSparse of 1 key, calls/s (token checked vs no token)",
            Stats.of(small["a"]),
            Stats.of(small["b"]),
            "with token / without",
        ),
        (
            f"hot path: pull+push of {HOT_BATCH} keys, dim 16, M keys/s (token checked vs no token)",
            Stats.of(big["a"]),
            Stats.of(big["b"]),
            "with token / without",
        ),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10_000, help="calls of each kind (default 10^4)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--small_calls", type=int, default=1000, help="1-key pulls per repetition")
    p.add_argument("--big_steps", type=int, default=3, help="64k-key pull+push per repetition")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.reps < 5:
        p.error("--reps must be >= 5")
    from ps_server import PSClient

    with tempfile.TemporaryDirectory(prefix="bench_ps_security_") as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "token").write_text(TOKEN)
        common = ["--port", "0", "--checkpoint_root", str(tmp), "--log_level", "ERROR"]
        cmd = [sys.executable, "-m", "ps_server", *common]
        procs = []
        try:
            procs.append(start_process([*cmd, "--token_file", str(tmp / "token")]))
            procs.append(start_process(cmd))
            (_, ep_a), (_, ep_b) = procs
            job = PSClient([ep_a], token=TOKEN, shm=False)
            plain = PSClient([ep_b], shm=False)
            job.wait_ready(30)
            plain.wait_ready(30)
            for c in (job, plain):
                c.create_table("emb", DIM, num_shards=8)
                c.create_dense_table("d", num_shards=2)
                c.init_dense("d", "w", np.arange(8, dtype=np.float32))
                c.push_sparse("emb", np.arange(5000), np.full((5000, DIM), 0.25, np.float32))
            before = _snapshot(job, tmp / "before")
            attack = Attack(ep_a, tmp)
            rows, codes, problems = run_attacks(attack, job, args)
            after = _snapshot(job, tmp / "after")
            if after != before:
                problems.append(
                    "the tables changed: "
                    + ", ".join(
                        sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
                    )
                )
            if (tmp / "stolen").exists():
                problems.append("a refused Save wrote files")
            rows += run_hot_path(job, plain, args)
            up = procs[0][0].poll() is None
            if not up:
                problems.append("server A exited")
            job.stop_servers()
            plain.stop_servers()
            job.close()
            plain.close()
        finally:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    report(
        "ps_server security: refused / garbage calls vs served calls; hot path with vs without "
        "the token check",
        rows,
        goal="refusals >= 0.5 of served; hot path >= 0.95",
        json_path=args.json,
        unit="/s",
        extra={
            "codes": codes,
            "tables_identical": after == before,
            "server_stayed_up": up,
            "problems": problems,
        },
    )
    print(
        f"\ntables identical before/after: {after == before} ({len(before)} shard files); "
        f"server stayed up: {up}"
    )
    for problem in problems:
        print(f"PROBLEM: {problem}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
