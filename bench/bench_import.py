"""Start-up cost of the package layout: ``import fleet`` (and the strategy it loads without
torch), ``import fleet`` plus the collective entry points (``fleet.init``'s modules, torch
included), and ``fleetrun --help``; this tree against an earlier revision, in one run.

The earlier revision is checked out with ``git worktree`` into a temp dir and put first on
PYTHONPATH (the venv, torch and every dependency are shared); each repetition runs both trees
back to back in alternating order, so load on the host hits both alike.

    .venv/bin/python bench/bench_import.py --before 6106d00 --reps 15 [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, Stats, bench_env, report  # noqa: E402

# Each case runs in a fresh interpreter that times itself (perf_counter around the work, so the
# interpreter's own start-up, the same for both trees, is left out) and prints the seconds.
_TIMED = (
    "import contextlib, io, sys, time\n"
    "t = time.perf_counter()\n"
    "{body}\n"
    "sys.__stderr__.write(repr(time.perf_counter() - t))\n"
)
CASES = {
    "import fleet; fleet.DistributedStrategy (no torch)": "import fleet; fleet.DistributedStrategy().gradient_merge = True",
    "import fleet + fleet.init/distributed_model/distributed_optimizer modules (torch)": "import fleet; fleet.init; fleet.distributed_model; fleet.distributed_optimizer",
    "fleetrun --help (import launcher.cli + click's help)": "from launcher.cli import main\n"
    "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
    "    main(['--help'])",
}


def _time(tree: str, body: str) -> float:
    env = bench_env()
    env["PYTHONPATH"] = tree
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    out = subprocess.run(
        [sys.executable, "-c", _TIMED.format(body=body)],
        cwd=tree,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    return float(out.stderr.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision to compare with")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-import-") as tmp:
        before = os.path.join(tmp, "before")
        subprocess.run(
            ["git", "-C", REPO, "worktree", "add", "--detach", before, args.before],
            check=True,
            capture_output=True,
        )
        try:
            rows = []
            for label, case in CASES.items():
                ours: list[float] = []
                theirs: list[float] = []
                for tree in (REPO, before):  # warm the page cache and bytecode of both trees
                    _time(tree, case)
                for rep in range(args.reps):
                    order = [(REPO, ours), (before, theirs)]
                    for tree, out in order if rep % 2 == 0 else reversed(order):
                        out.append(_time(tree, case))
                rows.append((label, Stats.of(ours), Stats.of(theirs), f"now / {args.before}"))
            report(
                f"start-up: this tree vs {args.before} (wall time of a fresh interpreter)",
                rows,
                goal="<= 1.0 within noise (no slower than before)",
                unit="s",
                json_path=args.json,
            )
        finally:
            subprocess.run(
                ["git", "-C", REPO, "worktree", "remove", "--force", before],
                check=False,
                capture_output=True,
            )


if __name__ == "__main__":
    main()
