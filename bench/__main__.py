"""``python -m bench``: run the benchmarks and write their results, list them, print the page.

python -m bench run [--quick] [--only NAME ...] [--timeout S] [--results DIR] [--list]
python -m bench list
python -m bench page [--results DIR]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from bench import registry


def _list() -> None:
    print(f"{'name':22s} {'area':10s} {'quick':5s} {'needs':9s} command (full | quick)")
    for b in registry.BENCHMARKS:
        full = shlex.join(["python", b.script, *b.full_args])
        quick = shlex.join(b.quick_args) if b.quick_args is not None else f"- ({b.not_quick})"
        print(
            f"{b.name:22s} {b.area:10s} {'yes' if b.quick_args is not None else 'no':5s} "
            f"{','.join(b.requires) or '-':9s} {full} | {quick}"
        )


def _select(names: list[str] | None, quick: bool) -> list[registry.Benchmark]:
    if not names:
        return [b for b in registry.BENCHMARKS if not quick or b.quick_args is not None]
    benches = [registry.get(n) for n in names]
    if quick:
        slow = [b for b in benches if b.quick_args is None]
        if slow:
            raise SystemExit(
                "no quick mode for "
                + ", ".join(f"{b.name} ({b.not_quick})" for b in slow)
                + ": run them without --quick"
            )
    return benches


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (non-zero only on a usage error)."""
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run benchmarks and write bench/results/*.json")
    run.add_argument("--quick", action="store_true", help="small sizes, a few minutes in all")
    run.add_argument("--only", nargs="+", metavar="NAME", help="these benchmarks only")
    run.add_argument("--timeout", type=float, help="seconds per benchmark (default: its own)")
    run.add_argument("--results", type=Path, help="results folder (default bench/results)")
    run.add_argument("--list", action="store_true", help="list what would run, run nothing")
    sub.add_parser("list", help="the registered benchmarks and their commands")
    page = sub.add_parser("page", help="print the generated benchmarks tables (Markdown)")
    page.add_argument("--results", type=Path, help="results folder (default bench/results)")
    refresh = sub.add_parser(
        "refresh", help="recompute figures and claims of the result files from their kept JSON"
    )
    refresh.add_argument("--results", type=Path, help="results folder (default bench/results)")
    args = ap.parse_args(argv)

    if args.cmd == "list":
        _list()
        return 0
    if args.cmd == "page":
        from bench import page as page_mod

        print(page_mod.render(args.results or page_mod.RESULTS))
        return 0
    if args.cmd == "refresh":
        from bench import runner

        for name in runner.refresh(args.results or runner.RESULTS):
            print(f"refreshed {name}")
        return 0
    try:
        benches = _select(args.only, args.quick)
    except KeyError as err:
        print(err.args[0], file=sys.stderr)
        return 2
    if args.list:
        for b in benches:
            print(f"{b.name}: {shlex.join(['python', b.script, *b.args(args.quick)])}")
        return 0
    from bench import runner

    if args.quick and not args.only:
        left = [b.name for b in registry.BENCHMARKS if b.quick_args is None]
        print(f"not in --quick (run them without it): {', '.join(left)}", flush=True)
    runner.run_many(benches, args.quick, args.results or runner.RESULTS, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
