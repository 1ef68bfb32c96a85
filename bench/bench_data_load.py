"""Slot-file loading: ``InMemoryDataset.load_into_memory`` lines/s of fleet.data vs PaddlePaddle's
own InMemoryDataset on the same files, and vs a plain-Python parse, in the same run.

Data: ``--lines`` (1 M) Criteo-shaped examples in ``--num_files`` (4) MultiSlot text files written
by ``examples/ctr/gen_slot_files.py`` (26 sparse int64 slots with one raw 64-bit id each, a
13-float dense slot, an int64 click label; ~700 bytes a line), into a temporary directory or
``--data_dir`` (reused when it already holds the same files). Every loader reads them with
``--threads`` (2) threads, ``pipe_command="cat"``:

* **ours**: ``fleet.data.InMemoryDataset`` with ``examples.ctr.slots.make_slots()``;
* **paddle**: ``paddle.distributed.InMemoryDataset`` (3.3.1, CPU, legacy static graph) with the
  same slots as ``paddle.static.data`` variables, in bench/.venv-paddle (skipped with a message
  when that venv is absent: ``bench/setup_paddle_venv.sh``);
* **python**: ``str.split`` + ``int()`` / ``float()`` into lists, then numpy arrays and offsets
  per slot, one thread (the floor any loader must beat).

Each runs in its own worker process (``bench/data_load_worker.py``) that times only the load call;
one untimed warm-up load each, then ``--reps`` (>= 5) loads, interleaved across the loaders so
drift hits all alike. Prints median [min .. max] M lines/s, ours/paddle (goal >= 1.2) and
ours/python (goal >= 10). Memory: the RSS growth of the warm-up load (a fresh process) and, where
the loader tells it, the bytes of its arrays, per example, against the payload: ids 8 B, floats
4 B, one int64 offset per example per sparse slot (goal for ours <= 1.3x).

Run: ``.venv/bin/python bench/bench_data_load.py [--reps 5] [--lines 1000000] [--data_dir D]``
(about 3 minutes on 2 cores, most of it the plain-Python column; ``--lines 200000`` for a quick
look).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import REPO, Stats, bench_env, machine_info, report
from paddle_venv import SETUP_HINT, find_paddle_python, paddle_env

from examples.ctr.gen_slot_files import SlotFiles, ensure_files
from examples.ctr.slots import NUM_DENSE, NUM_SPARSE

WORKER = os.path.join(REPO, "bench", "data_load_worker.py")
PAYLOAD_VALUES = (1 + NUM_SPARSE) * 8 + NUM_DENSE * 4  # click + ids int64, dense float32
PAYLOAD = PAYLOAD_VALUES + NUM_SPARSE * 8  # + one int64 offset per sparse slot per example


@dataclass
class Loader:
    """One worker process and what it measured."""

    name: str
    proc: subprocess.Popen | None = None
    log: Any = None
    unavailable: str = ""
    rates: list[float] = field(default_factory=list)  # M lines/s per timed rep
    warmup: dict[str, Any] = field(default_factory=dict)

    def _reply(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{self.name} worker exited ({self.proc.wait()}):\n{tail}")

    def start(
        self, python: str, env: dict[str, str], files: list[str], args: argparse.Namespace
    ) -> None:
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop())
            "w+", prefix=f"data_load_{self.name}_", suffix=".log"
        )
        cmd = [
            python,
            WORKER,
            "--impl",
            self.name,
            "--files",
            ",".join(files),
            "--threads",
            str(args.threads),
            "--batch_size",
            str(args.batch_size),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=REPO,
        )
        hello = self._reply()
        if "unavailable" in hello:
            self.unavailable = hello["unavailable"]
            self.stop()

    def load(self, expected: int) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write("load\n")
        self.proc.stdin.flush()
        r = self._reply()
        if r["examples"] != expected:
            raise RuntimeError(f"{self.name} loaded {r['examples']} examples, expected {expected}")
        return r

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()


def prepare_data(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The MultiSlot files (reused from --data_dir when they match); returns (files, temp dir to
    delete or None)."""
    per_file, extra = divmod(args.lines, args.num_files)
    if extra:
        raise SystemExit(f"--lines {args.lines} must be a multiple of --num_files {args.num_files}")
    tmp = None if args.data_dir else tempfile.mkdtemp(prefix="bench_data_load_")
    out_dir = args.data_dir or tmp
    print(
        f"slot files: {args.lines} lines in {args.num_files} files in {out_dir} (written if "
        "missing) ...",
        flush=True,
    )
    return ensure_files(out_dir, SlotFiles(args.num_files, per_file, "multislot", args.seed)), tmp


def print_memory(loaders: list[Loader], lines: int) -> dict[str, Any]:
    """Bytes per example of each loader's warm-up load vs the payload."""
    print(
        f"\nmemory per example (payload {PAYLOAD} B: ids + label {(1 + NUM_SPARSE) * 8} B, "
        f"dense {NUM_DENSE * 4} B, offsets {NUM_SPARSE * 8} B; values alone {PAYLOAD_VALUES} B)"
        "  goal for ours: <= 1.3x"
    )
    out = {}
    for ld in loaders:
        if ld.unavailable or not ld.warmup:
            continue
        rss = ld.warmup["rss_delta_bytes"] / lines
        held = ld.warmup["held_bytes"]
        text = f"  {ld.name:7s}: RSS growth {rss:7.1f} B ({rss / PAYLOAD:.2f}x)"
        if held is not None:
            text += f", arrays {held / lines:7.1f} B ({held / lines / PAYLOAD:.2f}x)"
        print(text)
        out[ld.name] = {
            "rss_bytes_per_example": rss,
            "held_bytes_per_example": None if held is None else held / lines,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=1_000_000, help="examples in all files together")
    p.add_argument("--num_files", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="thread_num of both datasets")
    p.add_argument("--batch_size", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data_dir", default=None, help="keep the files here (reused when they match)")
    p.add_argument("--paddle_python", default=None, help="default: bench/.venv-paddle/bin/python")
    p.add_argument("--no_python", action="store_true", help="skip the plain-Python column")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.reps < 5:
        p.error("--reps must be >= 5")

    files, tmp = prepare_data(args)
    loaders = [Loader("fleet"), Loader("paddle")] + ([] if args.no_python else [Loader("python")])
    try:
        paddle_python = find_paddle_python(args.paddle_python)
        for ld in loaders:
            if ld.name == "paddle":
                if paddle_python is None:
                    ld.unavailable = f"no PaddlePaddle venv: {SETUP_HINT}"
                    continue
                ld.start(paddle_python, paddle_env(), files, args)
            else:
                ld.start(sys.executable, bench_env(), files, args)
        active = [ld for ld in loaders if not ld.unavailable]
        for ld in active:
            print(f"warm-up load: {ld.name}", flush=True)
            ld.warmup = ld.load(args.lines)
        for rep in range(args.reps):
            order = active[rep % len(active) :] + active[: rep % len(active)]
            for ld in order:
                r = ld.load(args.lines)
                ld.rates.append(args.lines / r["seconds"] / 1e6)
            print(
                f"rep {rep + 1}/{args.reps}: "
                + ", ".join(f"{ld.name} {ld.rates[-1]:.3f}" for ld in active)
                + " M lines/s",
                flush=True,
            )
    finally:
        for ld in loaders:
            ld.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    stats = {ld.name: Stats.of(ld.rates) for ld in loaders if ld.rates}
    title = (
        f"load_into_memory, {args.lines} Criteo-shaped lines in {args.num_files} MultiSlot "
        f"files, {args.threads} threads"
    )
    for ld in loaders:
        if ld.unavailable:
            note = "fleet.data not available yet: " if ld.name == "fleet" else ""
            print(f"[{ld.name}] skipped: {note}{ld.unavailable}")
    rows = []
    if "fleet" in stats:
        for peer, goal in (("paddle", ">= 1.2"), ("python", ">= 10")):
            if peer in stats:
                rows.append(
                    (
                        f"M lines/s, ours vs {peer} (goal {goal})",
                        stats["fleet"],
                        stats[peer],
                        f"ours/{peer}",
                    )
                )
    extra: dict[str, Any] = {
        "stats_m_lines_per_s": {k: v.__dict__ for k, v in stats.items()},
        "skipped": {ld.name: ld.unavailable for ld in loaders if ld.unavailable},
    }
    if rows:
        report(title, rows, goal="see each row", unit="M lines/s")
        extra["ratios"] = {label: ours.median / peer.median for label, ours, peer, _ in rows}
    else:
        info = machine_info()
        print(f"== {title} ==  ({info['date']}, {info['cpus']} CPUs, python {info['python']})")
        for name, s in stats.items():
            print(f"  {name:7s}: {s.fmt('M lines/s')}")
        if "paddle" in stats and "python" in stats:
            print(
                f"  paddle/python = {stats['paddle'].median / stats['python'].median:.2f}; "
                "ours needs "
                f">= {1.2 * stats['paddle'].median:.3f} M lines/s (1.2x paddle) and >= "
                f"{10 * stats['python'].median:.3f} (10x python)"
            )
    extra["memory"] = print_memory(loaders, args.lines)
    extra["payload_bytes_per_example"] = PAYLOAD
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"title": title, "machine": machine_info(), **extra}, f, indent=2)


if __name__ == "__main__":
    main()
