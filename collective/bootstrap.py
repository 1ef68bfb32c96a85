"""Entry point fleetrun uses to run a Python worker: ``python -m collective.bootstrap``.

``python -u -m collective.bootstrap script.py ARGS`` behaves like ``python -u script.py ARGS``
(same ``sys.argv``, ``sys.path[0]``, ``__main__``) and ``python -m collective.bootstrap -m MODULE
ARGS`` like ``python -m MODULE ARGS``, with three additions:

* an uncaught exception is written to the error file named in the env contract, so the
  launcher's failure summary can show the traceback without the script having to use
  ``@record``;
* the process exits through :func:`collective.clean_exit.shutdown` (registered before the script
  runs, so it runs after the script's own atexit handlers): a plain torchrun script that never
  calls fleet gets the same clean gloo teardown as a fleet script;
* a process given a share of the host's CPUs (FLEET_PS_CPU_SHARE, fleetrun ``--ps_bind_cpus``)
  binds itself to it first, before anything starts a thread (:mod:`collective.cpu_share`).

Standard library only, imports nothing heavy.
"""

from __future__ import annotations

import os
import runpy
import sys

from collective.clean_exit import install_atexit
from collective.cpu_share import apply_cpu_share
from collective.record import install_excepthook


def main(argv: list[str]) -> None:
    """Run a script (``PATH ARGS``) or a module (``-m NAME ARGS``) as ``__main__``."""
    if not argv:
        raise SystemExit("usage: python -m collective.bootstrap (SCRIPT | -m MODULE) [ARGS...]")
    install_excepthook()
    apply_cpu_share()  # a bad value lands in the error file
    install_atexit()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("usage: python -m collective.bootstrap -m MODULE [ARGS...]")
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
