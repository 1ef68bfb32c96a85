"""``fleetrun``'s first step: a one-node launch's warm process, begun before fleetrun reads its
command line.

Python's start and fleetrun's own imports (click, the job spec, the schedulers) take about 0.15 s
before the job is parsed and set up, and the warm process's ``import torch`` (about a second) is
what the first workers wait for. When the arguments show at a glance a one-node local launch of
a Python script (only the options of :data:`VALUE_OPTIONS` and :data:`FLAG_OPTIONS`, no job
file, no ``FLEETRUN_<OPTION>`` variable), :func:`main` begins the warm process first thing, with
the environment and imports that launch would give it (:func:`launcher.warm.begin`). Once the
job is parsed, :func:`launcher.attempt.start_warm_early` adopts it only when the job asks for
exactly that warm process (:meth:`launcher.warm.WarmPool.serves`) and closes it otherwise: a
wrong guess costs a fraction of a second of one core, never a different job. A command line that
fails to parse closes it before fleetrun exits.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Mapping, Sequence

VALUE_OPTIONS = frozenset(
    {
        "nproc_per_node",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
        "backend",
        "log_dir",
        "max_restarts",
        "run_id",
        "tee",
        "job_name",
        "grace_period",
        "monitor_interval",
        "warm_start",
        "warm_imports",
    }
)
"""Options (``_`` or ``-`` spelling) that take a value and leave a launch one-node and local."""
FLAG_OPTIONS = frozenset({"metrics", "no_metrics", "module", "m"})
"""Flags that do the same."""
ENV_ALLOWED = frozenset({"FLEETRUN_LOG_LEVEL"})
"""``FLEETRUN_*`` variables that change nothing a warm process depends on."""


def guess(args: Sequence[str], environ: Mapping[str, str]) -> tuple[int, list[str]] | None:
    """``(nproc_per_node, warm_imports)`` of the launch ``args`` describe, when it is a one-node
    local launch of a Python entry with warm starts on; None when it may be anything else."""
    if any(k.startswith("FLEETRUN_") and k not in ENV_ALLOWED for k in environ):
        return None
    opts: dict[str, str] = {}
    module = False
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        name, eq, value = args[i].lstrip("-").partition("=")
        name = name.replace("-", "_")
        if name in FLAG_OPTIONS and not eq:
            module = module or name in ("m", "module")
            i += 1
            continue
        if name not in VALUE_OPTIONS or (not eq and i + 1 >= len(args)):
            return None
        if not eq:
            i += 1
            value = args[i]
        opts[name] = value
        i += 1
    i += i < len(args) and args[i] == "--"
    if i >= len(args):
        return None
    script = args[i]
    if not module and not (script.endswith(".py") and os.path.isfile(script)):
        return None
    if opts.get("warm_start", "on") != "on" or opts.get("nnodes", "1") != "1":
        return None
    if opts.get("node_rank", "0") != "0":
        return None
    nproc = opts.get("nproc_per_node", "1")
    if not nproc.isdigit() or int(nproc) < 1:
        return None
    imports = [m.strip() for m in opts.get("warm_imports", "").split(",") if m.strip()]
    return int(nproc), imports


def main() -> None:
    """The ``fleetrun`` console script: begin the warm process when :func:`guess` allows, then
    run the command line (:func:`launcher.cli.main`)."""
    args = sys.argv[1:]
    plan = guess(args, os.environ)
    began = False
    if plan is not None:
        from launcher import warm  # lazy: only a launch that may use it pays the import

        if warm.supported()[0]:
            nproc, imports = plan
            warm.begin(warm.node_env({}, nproc), imports, nproc)
            began = True
    try:
        from launcher.cli import main as cli_main  # after the warm process is on its way

        cli_main(args)
    finally:
        if began:
            from launcher.warm import close_early

            close_early()
        gc.freeze()  # the interpreter's last collection has nothing left to walk


__all__ = ["ENV_ALLOWED", "FLAG_OPTIONS", "VALUE_OPTIONS", "guess", "main"]
