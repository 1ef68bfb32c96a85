"""Prints what a worker sees of its own process as one JSON line (tests of warm starts), then
acts as PROBE_ACTION says: ``exit:N``, ``raise``, ``signal:NAME``, ``sleep:S``, ``collective``,
``fail_first:S:PATH`` (sleep S seconds, then exit 1 unless PATH exists, creating it),
``gate:PATH:N`` (wait up to 200 s for PATH to exist, then exit N), ``leave_open:PATH`` (write
PATH without closing it, register an atexit handler, start a non-daemon thread that prints
late, then ``sys.exit`` with a message: what the interpreter's own exit must still do)."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch


def _proc_environ() -> dict[str, str]:
    with open(f"/proc/{os.getpid()}/environ", "rb") as f:
        entries = f.read().split(b"\0")
    out = {}
    for entry in entries:
        if not entry:
            break
        key, _, value = os.fsdecode(entry).partition("=")
        out[key] = value
    return out


facts = {
    "rank": int(os.environ.get("RANK", "-1")),
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "sid": os.getsid(0),
    "pgid": os.getpgid(0),
    "cwd": os.getcwd(),
    "argv": sys.argv,
    "main_file": getattr(sys.modules["__main__"], "__file__", None),
    "name": __name__,
    "random": random.random(),
    "numpy": float(np.random.rand()),
    "torch_seed": torch.initial_seed(),
    "torch_draw": float(torch.rand(1)),
    "threads": torch.get_num_threads(),
    "marker": os.environ.get("PROBE_MARKER"),
    "fds": sorted(int(x) for x in os.listdir("/proc/self/fd")),
    "sigint": str(signal.getsignal(signal.SIGINT)),
    "sigterm": str(signal.getsignal(signal.SIGTERM)),
    # what ps shows: NUL-separated words, or one space-separated title (a forked worker's)
    "cmdline": " ".join(w for w in open("/proc/self/cmdline").read().split("\0") if w),
    "orig_argv": sys.orig_argv,  # the interpreter's own command line: the warm process's if forked
    # what another process reads of this one's environment (entries up to the first empty one)
    "proc_environ_is_own": _proc_environ() == dict(os.environ),
}
facts["forked"] = "collective.zygote" in facts["orig_argv"]
print("PROBE " + json.dumps(facts), flush=True)

action = os.environ.get("PROBE_ACTION", "")
if action.startswith("exit:"):
    sys.exit(int(action.split(":")[1]))
if action == "raise":
    raise RuntimeError("probe failed on purpose")
if action.startswith("signal:"):
    os.kill(os.getpid(), getattr(signal, action.split(":")[1]))
    time.sleep(5)
if action.startswith("sleep:"):
    time.sleep(float(action.split(":")[1]))
if action.startswith("leave_open:"):
    import atexit
    import threading

    unclosed = open(action.split(":", 1)[1], "w")  # noqa: SIM115 - left open on purpose
    unclosed.write("written, never closed")
    atexit.register(lambda: print("ATEXIT ran", flush=True))

    def late() -> None:
        time.sleep(0.5)
        print("THREAD done", flush=True)

    threading.Thread(target=late).start()
    sys.exit("bye from the probe")
if action.startswith("gate:"):
    _, path, code = action.split(":", 2)
    stop = time.monotonic() + 200
    while not os.path.exists(path) and time.monotonic() < stop:
        time.sleep(0.05)
    sys.exit(int(code))
if action.startswith("fail_first:"):
    _, secs, path = action.split(":", 2)
    time.sleep(float(secs))
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write("failed once")
        sys.exit(1)
if action == "collective":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print("SUM", float(t[0]), flush=True)
