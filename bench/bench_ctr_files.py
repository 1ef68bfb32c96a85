"""CTR training from slot files: train examples/s of the PS example (1 server + 1 trainer) fed by
``fleet.data`` InMemoryDataset and QueueDataset, against the same job fed from prebuilt in-memory
tensors, in the same run.

All three are ``fleetrun --server_num 1 --worker_num 1 examples/ctr/train_ps.py`` (through
:func:`bench_ctr.run_ps`) on the same examples: the tensors run generates ``--train`` examples in
memory (the script as it is); the file runs read the same examples from ``--num_files`` files that
``examples/ctr/gen_slot_files.py`` wrote for the same seed (``--data_dir D --dataset inmemory |
queue``). ``--format multislot`` reads MultiSlot text with ``pipe_command="cat"``;
``--format paddlerec`` reads PaddleRec lines through ``examples/ctr/reader.py`` (this venv's
Python). The script times its training loop only: for InMemoryDataset ``load_into_memory`` comes
before it and is printed beside the result (Paddle's ``train_from_dataset`` time excludes it too);
for QueueDataset the parsing overlaps the loop and is inside the time. Runs alternate; median
of ``--reps`` (>= 5) with min/max; ratio files/tensors (goal >= 0.95); test AUCs beside them
(same data, so the same AUC within noise).

Needs ``fleet.data`` (InMemoryDataset, QueueDataset) and ``train_ps.py --data_dir``; says which
is missing and exits 0 otherwise. Usage: ``python bench/bench_ctr_files.py [--reps 5]
[--train 100000] [--test 20000] [--mode async] [--format multislot] [--data_dir D]``
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_ctr import run_ps
from common import REPO, Stats, bench_env, report

from examples.ctr.gen_slot_files import SlotFiles, ensure_files

TRAIN_SCRIPT = os.path.join(REPO, "examples", "ctr", "train_ps.py")
# the reader under this venv's Python (a bare "python" is whatever PATH finds first)
READER_PIPE = " ".join(
    shlex.quote(p) for p in (sys.executable, os.path.join(REPO, "examples", "ctr", "reader.py"))
)


def missing_pieces() -> list[str]:
    """What the file runs need and this tree lacks (empty when the bench can run)."""
    missing = []
    try:
        from fleet import data

        for name in ("InMemoryDataset", "QueueDataset", "Slot"):
            if not hasattr(data, name):
                missing.append(f"fleet.data.{name}")
    except ImportError as e:
        missing.append(f"fleet.data ({e})")
    r = subprocess.run(
        [sys.executable, TRAIN_SCRIPT, "--help"],
        capture_output=True,
        text=True,
        env=bench_env(),
        cwd=REPO,
        timeout=120,
        check=False,
    )
    for flag in ("--data_dir", "--dataset"):
        if flag not in r.stdout:
            missing.append(f"examples/ctr/train_ps.py {flag}")
    return missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--train", type=int, default=100_000, help="training examples (= lines in the files)"
    )
    ap.add_argument("--test", type=int, default=20_000)
    ap.add_argument("--num_files", type=int, default=4)
    ap.add_argument("--mode", default="async", choices=["sync", "async", "geo"])
    ap.add_argument("--format", default="multislot", choices=["multislot", "paddlerec"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data_dir", default=None, help="keep the files here (reused when they match)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.reps < 5:
        ap.error("--reps must be >= 5")
    if args.train % args.num_files:
        ap.error(f"--train {args.train} must be a multiple of --num_files {args.num_files}")
    missing = missing_pieces()
    if missing:
        print("bench_ctr_files: cannot run yet, missing: " + ", ".join(missing))
        return

    with tempfile.TemporaryDirectory(prefix="bench_ctr_files_") as tmp:
        data_dir = args.data_dir or os.path.join(tmp, "data")
        ensure_files(
            data_dir,
            SlotFiles(args.num_files, args.train // args.num_files, args.format, args.seed),
        )
        file_args = ["--data_dir", data_dir, "--seed", str(args.seed)]
        if args.format == "paddlerec":
            file_args += ["--pipe_command", READER_PIPE]
        variants = {
            "tensors": ["--seed", str(args.seed)],
            "inmemory": [*file_args, "--dataset", "inmemory"],
            "queue": [*file_args, "--dataset", "queue"],
        }
        names = list(variants)
        res: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for rep in range(args.reps):
            for name in names[rep % 3 :] + names[: rep % 3]:  # alternate the order
                res[name].append(run_ps(args.train, args.test, args.mode, tmp, variants[name]))
            print(
                f"rep {rep + 1}/{args.reps}: "
                + ", ".join(f"{n} {res[n][-1]['examples_per_s']:.0f}" for n in names)
                + " ex/s",
                flush=True,
            )

    rate = {n: Stats.of([r["examples_per_s"] for r in res[n]]) for n in names}
    auc = {n: Stats.of([r["auc"] for r in res[n]]) for n in names}
    report(
        f"CTR training from slot files ({args.format}, {args.num_files} files), fleet PS 1 server "
        f"+ 1 trainer ({args.mode}), {args.train} examples: files vs in-memory tensors",
        [
            (
                "train examples/s, InMemoryDataset vs tensors",
                rate["inmemory"],
                rate["tensors"],
                "files/tensors examples/s",
            ),
            (
                "train examples/s, QueueDataset vs tensors",
                rate["queue"],
                rate["tensors"],
                "files/tensors examples/s",
            ),
        ],
        goal=">= 0.95",
        unit="ex/s",
        json_path=args.json,
        extra={"auc": {n: a.__dict__ for n, a in auc.items()}},
    )
    print(
        "test AUC: "
        + " | ".join(f"{n} {auc[n].fmt('', digits=4)}" for n in names)
        + f" | Bayes {res['tensors'][0]['bayes']:.4f}"
    )
    loads = [r["raw"]["load_seconds"] for r in res["inmemory"] if "load_seconds" in r["raw"]]
    if loads:
        print(
            f"InMemoryDataset load_into_memory (outside the timed loop): {Stats.of(loads).fmt('s')}"
        )


if __name__ == "__main__":
    main()
