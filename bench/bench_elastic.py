"""Elastic jobs: node loss and node join, fleetrun (c10d, etcd) vs torchrun (c10d), same script.

Each repetition, per launcher, on 127.0.0.1 with one worker per agent
(tests/scripts/elastic_train.py: gloo DP, torch.save checkpoint every 2 steps, one record per
step with time and world size in progress.jsonl):

1. agents A and B start (``--nnodes 1:2``, ``--max_restarts 3``); wait for steps at world 2;
2. **loss**: SIGKILL B's agent and its worker; time until the first step at world 1 (A
   resumed from the checkpoint);
3. **join**: start agent C; time from its start until the first step at world 2;
4. write the stop file; A and C exit 0.

Variants: ``fleetrun-c10d``; ``fleetrun-c10d-warm`` (the same with ``--warm_start on``: the
surviving agent's next-round worker is forked from its warm process); ``fleetrun-etcd`` (a private etcd from scripts/etcd.sh);
``torchrun-c10d`` with the same rendezvous options as fleetrun's defaults
(launcher.elastic.config.FAST_RDZV_CONF) and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it
torch 2.13's joining node blocks, see launcher/schedulers/local/elastic_launch.py); ``torchrun-c10d-default``
(torchrun as users get it: 30 s last call, 15 s to drop a dead node; loss only, and the join is
tried once with a bound to show whether it completes).

Usage: ``python bench/bench_elastic.py [--reps 5] [--variants a,b] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import REPO, Stats, bench_env, fleetrun_cmd, machine_info, torchrun_cmd

from collective.env import find_free_port

WORKER = os.path.join(REPO, "tests", "scripts", "elastic_train.py")
FAST_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"
WAIT_S = 180.0


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class Run:
    """One repetition's processes and files."""

    def __init__(self, tmp: Path, variant: str, etcd: str | None) -> None:
        self.tmp, self.variant, self.etcd = tmp, variant, etcd
        self.ckpt, self.stop = tmp / "ckpt", tmp / "stop"
        self.ckpt.mkdir()
        self.port = find_free_port()
        self.rdzv_id = f"bench{time.time_ns()}"
        self.procs: list[subprocess.Popen] = []

    def cmd(self, name: str) -> list[str]:
        args = [
            WORKER,
            str(self.ckpt),
            "--steps",
            "4",
            "--step_time",
            "0.1",
            "--stop_file",
            str(self.stop),
        ]
        if self.variant.startswith("fleetrun"):
            backend = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{self.port}"]
            if self.variant == "fleetrun-etcd":
                backend = ["--rdzv_backend", "etcd", "--rdzv_endpoint", str(self.etcd)]
            warm = ["--warm_start", "on"] if self.variant.endswith("-warm") else []
            return fleetrun_cmd(
                "--nnodes",
                "1:2",
                *backend,
                *warm,
                "--rdzv_id",
                self.rdzv_id,
                "--max_restarts",
                "3",
                "--log_dir",
                str(self.tmp / name),
                "--no_metrics",
                "--tee",
                "none",
                *args,
            )
        conf = ["--rdzv_conf", FAST_CONF] if self.variant == "torchrun-c10d" else []
        return torchrun_cmd(
            "--nnodes",
            "1:2",
            "--nproc_per_node",
            "1",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"127.0.0.1:{self.port}",
            "--rdzv_id",
            self.rdzv_id,
            "--max_restarts",
            "3",
            "--monitor_interval",
            "0.1",
            *conf,
            *args,
        )

    def start(self, name: str) -> subprocess.Popen:
        env = bench_env()
        if self.variant == "torchrun-c10d":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        out = open(self.tmp / f"{name}.out", "w")  # noqa: SIM115 - the child keeps it
        p = subprocess.Popen(
            self.cmd(name),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def records(self) -> list[dict]:
        path = self.ckpt / "progress.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def first_step(self, world: int, after: float, timeout: float = WAIT_S) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [
                r["time"]
                for r in self.records()
                if r["event"] == "step" and r["world"] == world and r["time"] > after
            ]
            if hits:
                return min(hits)
            time.sleep(0.05)
        return None

    def kill(self, p: subprocess.Popen) -> None:
        kids = _children(p.pid)
        p.kill()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(10)

    def cleanup(self) -> None:
        for p in self.procs:
            kids = _children(p.pid)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            for pid in kids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(10)


def wait_listening(port: int, timeout: float = WAIT_S) -> None:
    """Until 127.0.0.1:port accepts connections (the first agent hosts the c10d store there)."""
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nothing listens on 127.0.0.1:{port} after {timeout} s"
                ) from None
            time.sleep(0.05)


def one_rep(
    variant: str, etcd: str | None, join: bool, join_timeout: float = WAIT_S
) -> tuple[float, float | None]:
    """(loss recovery s, join s or None) of one repetition."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(Path(tmp), variant, etcd)
        try:
            run.start("a")
            if variant != "fleetrun-etcd":  # A hosts the c10d store: B starts once it listens
                wait_listening(run.port)
            b = run.start("b")
            if run.first_step(2, 0.0) is None:
                raise RuntimeError(
                    f"{variant}: no steps at world 2\n" + (Path(tmp) / "a.out").read_text()[-3000:]
                )
            killed = time.time()
            run.kill(b)
            resumed = run.first_step(1, killed)
            if resumed is None:
                raise RuntimeError(
                    f"{variant}: no recovery\n" + (Path(tmp) / "a.out").read_text()[-3000:]
                )
            joined_s = None
            if join:
                started = time.time()
                run.start("c")
                grown = run.first_step(2, started, join_timeout)
                joined_s = None if grown is None else grown - started
            run.stop.write_text("")
            for p in run.procs[:1] + run.procs[2:]:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    pass
            return resumed - killed, joined_s
        finally:
            run.cleanup()


def start_etcd(tmp: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(
        ["bash", os.path.join(REPO, "scripts", "etcd.sh"), os.path.join(tmp, "etcd")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("ETCD_ENDPOINT="):
            endpoint = line.strip().split("=", 1)[1]
            time.sleep(1.0)
            return p, endpoint
    raise RuntimeError("scripts/etcd.sh printed no ETCD_ENDPOINT")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--variants", default="fleetrun-c10d,torchrun-c10d,fleetrun-etcd,torchrun-c10d-default"
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    variants = args.variants.split(",")
    loss: dict[str, list[float]] = {v: [] for v in variants}
    join: dict[str, list[float]] = {v: [] for v in variants}
    join_failed: dict[str, int] = {v: 0 for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        etcd_proc, etcd = start_etcd(tmp) if "fleetrun-etcd" in variants else (None, None)
        try:
            for rep in range(args.reps):
                order = variants if rep % 2 == 0 else variants[::-1]
                for v in order:
                    default = v == "torchrun-c10d-default"
                    if default and rep >= 2:
                        continue  # ~45 s per loss: two reps show it
                    lost, joined = one_rep(
                        v, etcd, join=True, join_timeout=90.0 if default else WAIT_S
                    )
                    loss[v].append(lost)
                    if joined is None:
                        join_failed[v] += 1
                    else:
                        join[v].append(joined)
                    print(
                        f"rep {rep} {v}: loss {lost:.2f} s, join "
                        f"{'did not complete' if joined is None else f'{joined:.2f} s'}",
                        flush=True,
                    )
        finally:
            if etcd_proc is not None:
                os.killpg(etcd_proc.pid, signal.SIGKILL)
                etcd_proc.wait(10)
    info = machine_info()
    print(
        f"== elastic: node loss and join ==  ({info['date']}, {info['cpus']} CPUs, torch {info['torch']})"
    )
    rows = []
    for v in variants:
        row = {
            "variant": v,
            "loss": Stats.of(loss[v]).__dict__ if loss[v] else None,
            "join": Stats.of(join[v]).__dict__ if join[v] else None,
            "join_failed": join_failed[v],
        }
        rows.append(row)
        print(
            f"{v}\n  SIGKILL -> training again at world 1 : "
            f"{Stats.of(loss[v]).fmt() if loss[v] else 'n/a'}\n  3rd agent start -> world 2 training : "
            f"{Stats.of(join[v]).fmt() if join[v] else 'n/a'}"
            f"{f'  ({join_failed[v]} join(s) did not complete)' if join_failed[v] else ''}"
        )
    for ours, peer in (
        ("fleetrun-c10d", "torchrun-c10d"),
        ("fleetrun-c10d-warm", "torchrun-c10d"),
        ("fleetrun-etcd", "torchrun-c10d"),
        ("fleetrun-c10d", "torchrun-c10d-default"),
    ):
        for what, data in (("loss", loss), ("join", join)):
            if data.get(ours) and data.get(peer):
                r = Stats.of(data[ours]).median / Stats.of(data[peer]).median
                print(
                    f"ratio {what} {ours}/{peer} = {r:.3f}   goal: <= 10 s and <= 1.0 vs torchrun"
                )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
