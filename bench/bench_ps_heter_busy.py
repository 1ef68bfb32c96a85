"""How busy the heter worker is when it has a core of its own: the device machine emulated on
this host by pinning, async mode, a model whose dense part dominates the step.

``fleetrun --server_num 1 --worker_num 2 --heter_worker_num 1 examples/ctr/train_heter.py
--mode async --hidden 1024 512 256 --heter_cpus B --server_cpus A --trainer_cpus A``: the heter
worker alone on core B, the server and both CPU trainers on core A, the whole job (fleetrun
included) under the affinity {A, B} (the first two CPUs this process may use). The figure is
the heter worker's busy share: the seconds it spent on forward + backward, the replies'
activation gradients and the local optimizer step, over the seconds between its first and last
micro-batch (its closing log line, ``heterlog.0``), against 1.0 (always busy); the goal is
>= 0.8. Where the rest goes comes from the same log's phase breakdown: the busy time's parts,
decoding the requests and the background dense pushes and pulls (threads on the same core, their
wall time overlapping the busy time), and the requests' summed waits for the device (above 1: a
micro-batch was queued all along, so the rest is the worker's own overhead, not a wait for the
trainers). Median of ``--reps`` (>= 5) runs with
min/max. A machine with fewer than 2 usable CPUs is skipped with a message.

Usage: ``python bench/bench_ps_heter_busy.py [--reps 5] [--train 100000] [--test 5000]
[--hidden 1024 512 256] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import REPO, Stats, bench_env, fleetrun_cmd, machine_info, report, run_checked

GOAL = 0.8
BUSY_RE = re.compile(
    r"heter worker \d+: (?P<micro>\d+) micro-batches, busy (?P<busy>[\d.]+)s of the "
    r"(?P<span>[\d.]+)s between"
)
PHASES_RE = re.compile(r"heter worker \d+ phases \(s\): (?P<phases>[^;]+); (?P<passes>\d+) forward")
REST = "the rest: not busy (1 - busy share)"
WAITS = "request waits for the device, summed over requests (> 1: always one queued)"
# The breakdown rows: a label and the phases (seconds in the heter worker's log) it sums.
SHARES = (
    ("forward + backward", ("forward_backward",)),
    ("local optimizer step", ("update",)),
    ("replies (activation gradients out)", ("reply",)),
    ("decoding the requests", ("decode",)),
    ("dense pushes and pulls (background sender)", ("push", "pull")),
)


def parse_heter_log(text: str) -> dict[str, float]:
    """The heter worker's closing lines: micro-batches, busy and span seconds, forward/backward
    passes and each phase's seconds (``phase_<name>``)."""
    busy, phases = BUSY_RE.search(text), PHASES_RE.search(text)
    if busy is None or phases is None:
        raise RuntimeError(
            f"no closing busy/phases lines in the heter worker's log:\n{text[-2000:]}"
        )
    out = {
        "micro_batches": float(busy["micro"]),
        "busy_s": float(busy["busy"]),
        "span_s": float(busy["span"]),
        "passes": float(phases["passes"]),
    }
    for part in phases["phases"].split(","):
        name, value = part.split()
        out[f"phase_{name}"] = float(value)
    return out


def shares(log: dict[str, float]) -> dict[str, float]:
    """Each part of the heter worker's span as a share of it: busy, its parts, the rest, and
    the phases outside the device lock. Those run on other threads (request threads decode,
    the background sender pushes and pulls), so their wall time may overlap the busy time."""
    span = max(log["span_s"], 1e-9)
    out = {"busy": log["busy_s"] / span, REST: max(0.0, 1.0 - log["busy_s"] / span)}
    for label, names in SHARES:
        out[label] = sum(log.get(f"phase_{n}", 0.0) for n in names) / span
    out[WAITS] = log.get("phase_wait", 0.0) / span
    return out


def run_job(args: argparse.Namespace, tmp: str, rep: int, cpus: tuple[int, int]) -> dict:
    """One pinned job; the heter worker's shares and the trainers' examples/s."""
    trainer_core, heter_core = cpus
    path = os.path.join(tmp, f"ctr{rep}.json")
    log_dir = os.path.join(tmp, f"log{rep}")
    run_checked(
        fleetrun_cmd(
            "--server_num",
            "1",
            "--worker_num",
            "2",
            "--heter_worker_num",
            "1",
            "--log_dir",
            log_dir,
            "--tee",
            "none",
            "examples/ctr/train_heter.py",
            "--train",
            str(args.train),
            "--test",
            str(args.test),
            "--mode",
            "async",
            "--hidden",
            *map(str, args.hidden),
            "--max_in_flight",
            str(args.max_in_flight),
            "--intra_op_threads",
            "0",  # the CPUs it may use: 1
            "--server_cpus",
            str(trainer_core),
            "--trainer_cpus",
            str(trainer_core),
            "--heter_cpus",
            str(heter_core),
            "--json",
            path,
        ),
        cwd=REPO,
        env=bench_env(),
        preexec_fn=lambda: os.sched_setaffinity(0, set(cpus)),
    )
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    with open(os.path.join(log_dir, "heterlog.0"), encoding="utf-8") as f:
        log = parse_heter_log(f.read())
    return {"examples_per_s": result["examples_per_s"], "log": log, "shares": shares(log)}


def skip(args: argparse.Namespace, why: str) -> None:
    """Say why nothing was measured; the JSON says so too (the runner records a skip)."""
    print(f"[bench_ps_heter_busy] skipped: {why}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"skipped": why, "machine": machine_info(), "rows": []}, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--train", type=int, default=100_000)
    ap.add_argument("--test", type=int, default=5_000)
    ap.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[1024, 512, 256],
        help="the MLP widths: wide enough that the dense part dominates the step",
    )
    ap.add_argument("--max_in_flight", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        skip(args, f"needs 2 CPUs (one for the heter worker, one for the rest), has {usable}")
        return
    cpus = (usable[0], usable[1])
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            r = run_job(args, tmp, rep, cpus)
            runs.append(r)
            log = r["log"]
            print(
                f"rep {rep}: busy {r['shares']['busy']:.1%} of {log['span_s']:.2f}s, "
                f"{log['micro_batches']:.0f} micro-batches in {log['passes']:.0f} passes, "
                f"{r['examples_per_s']:,.0f} ex/s",
                flush=True,
            )
    always = Stats.of([1.0] * len(runs))

    def share(key: str) -> Stats:
        return Stats.of([r["shares"][key] for r in runs])

    rows = [
        (
            "heter worker busy share (forward + backward + replies + update) of its span, "
            "pinned to its own core",
            share("busy"),
            always,
            "busy/span",
        ),
        *(
            (f"share of the span: {label}", share(label), always, "share")
            for label in (*(label for label, _ in SHARES[:3]), REST, *(lb for lb, _ in SHARES[3:]))
        ),
        (f"share of the span: {WAITS}", share(WAITS), always, "share"),
        (
            "micro-batches per forward/backward pass",
            Stats.of([r["log"]["micro_batches"] / max(r["log"]["passes"], 1) for r in runs]),
            Stats.of([1.0] * len(runs)),
            "merged/one",
        ),
    ]
    report(
        f"Heter worker busy share, async, 1 server + 2 CPU trainers on CPU {cpus[0]} and the "
        f"heter worker on CPU {cpus[1]}, MLP {'-'.join(map(str, args.hidden))}, "
        f"{args.train:,} examples",
        rows,
        goal=f"busy share >= {GOAL}",
        unit="share",
        json_path=args.json,
        extra={
            "row_units": ["share of the span"] * (len(rows) - 1) + ["micro-batches"],
            "cpus": list(cpus),
            "hidden": args.hidden,
            "max_in_flight": args.max_in_flight,
            "examples_per_s": [r["examples_per_s"] for r in runs],
            "heter_logs": [r["log"] for r in runs],
        },
    )


if __name__ == "__main__":
    main()
