"""One side of ``bench/bench_data_load.py``: loads the CTR slot files into memory on request and
times itself, so that every implementation runs in its own process (its own venv for Paddle, and
a clean heap for the memory figure).

``--impl``:

* ``fleet``: ``fleet.data.InMemoryDataset`` (project venv);
* ``paddle``: ``paddle.distributed.InMemoryDataset`` (bench/.venv-paddle, legacy static graph);
* ``python``: a plain-Python MultiSlot parse (``str.split``, ``int()`` / ``float()`` into lists,
  then numpy arrays and offsets per slot), single-threaded.

Protocol: one ``@@ {json}`` line when ready (``{"ready": true}`` or ``{"unavailable":
"why"}``), then per ``load`` line on stdin one ``@@ {json}`` line: ``seconds`` (the load call
only), ``examples``, ``rss_delta_bytes`` (RSS after the load minus before, after gc) and
``held_bytes`` (the bytes of the loaded arrays where the implementation tells them, else null).
EOF or ``quit`` ends it. Imports neither torch nor fleet at module level (Paddle's venv runs it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.ctr.slots import DENSE_SLOT, LABEL_SLOT, NUM_DENSE, SLOT_ORDER, SPARSE_SLOTS

Loader = Callable[[], tuple[float, int, int | None, Any]]
"""``() -> (seconds, examples, held_bytes or None, the loaded object)``; the object stays alive
until the RSS after the load is read."""


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_fleet_loader(files: list[str], threads: int, batch_size: int) -> Loader:
    from examples.ctr.slots import make_slots
    from fleet import data

    dataset_class, use_var = data.InMemoryDataset, make_slots()  # AttributeError: not there yet

    def load() -> tuple[float, int, int | None, Any]:
        ds = dataset_class()
        ds.init(batch_size=batch_size, thread_num=threads, use_var=use_var, pipe_command="cat")
        ds.set_filelist(files)
        t0 = time.perf_counter()
        ds.load_into_memory()
        seconds = time.perf_counter() - t0
        held = getattr(ds, "nbytes", None)
        return seconds, ds.get_memory_data_size(), (held() if callable(held) else held), ds

    return load


def make_paddle_loader(files: list[str], threads: int, batch_size: int) -> Loader:
    import paddle

    paddle.enable_static()
    use_var = []
    for name in SLOT_ORDER:  # the layout make_slots() declares for ours
        if name == LABEL_SLOT:
            var = paddle.static.data(name=name, shape=[-1, 1], dtype="int64", lod_level=0)
        elif name == DENSE_SLOT:
            var = paddle.static.data(name=name, shape=[-1, NUM_DENSE], dtype="float32", lod_level=0)
        else:
            var = paddle.static.data(name=name, shape=[-1, 1], dtype="int64", lod_level=1)
        use_var.append(var)

    def load() -> tuple[float, int, int | None, Any]:
        ds = paddle.distributed.InMemoryDataset()
        ds.init(batch_size=batch_size, thread_num=threads, use_var=use_var, pipe_command="cat")
        ds.set_filelist(files)
        t0 = time.perf_counter()
        ds.load_into_memory()
        seconds = time.perf_counter() - t0
        return seconds, int(ds.get_memory_data_size()), None, ds

    return load


def parse_multislot_python(files: list[str]) -> dict[str, Any]:
    """Plain Python: per slot a numpy array of values (int64 / float32) and, for the sparse
    slots, int64 offsets ``[N + 1]``."""
    import numpy as np

    is_float = [name == DENSE_SLOT for name in SLOT_ORDER]
    parts: list[list[Any]] = [[] for _ in SLOT_ORDER]
    lengths: list[list[int]] = [[] for _ in SLOT_ORDER]
    for path in files:  # per file, so the Python lists never hold more than one file
        values: list[list[Any]] = [[] for _ in SLOT_ORDER]
        with open(path) as f:
            for line in f:
                tokens = line.split()
                pos = 0
                for s, as_float in enumerate(is_float):
                    n = int(tokens[pos])
                    chunk = tokens[pos + 1 : pos + 1 + n]
                    values[s].extend(map(float, chunk) if as_float else map(int, chunk))
                    lengths[s].append(n)
                    pos += 1 + n
        for s, as_float in enumerate(is_float):
            parts[s].append(np.array(values[s], dtype=np.float32 if as_float else np.int64))
        del values
    out: dict[str, Any] = {}
    for s, name in enumerate(SLOT_ORDER):
        out[name] = np.concatenate(parts[s])
        if name in SPARSE_SLOTS:
            offsets = np.zeros(len(lengths[s]) + 1, dtype=np.int64)
            np.cumsum(lengths[s], out=offsets[1:])
            out[name + ".offsets"] = offsets
    return out


def make_python_loader(files: list[str], threads: int, batch_size: int) -> Loader:
    def load() -> tuple[float, int, int | None, Any]:
        t0 = time.perf_counter()
        arrays = parse_multislot_python(files)
        seconds = time.perf_counter() - t0
        held = sum(a.nbytes for a in arrays.values())
        return seconds, int(arrays[LABEL_SLOT].shape[0]), held, arrays

    return load


LOADERS = {"fleet": make_fleet_loader, "paddle": make_paddle_loader, "python": make_python_loader}


def say(obj: dict[str, Any]) -> None:
    print("@@ " + json.dumps(obj), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=sorted(LOADERS), required=True)
    p.add_argument("--files", required=True, help="comma-separated MultiSlot files")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=512)
    args = p.parse_args()
    try:
        load = LOADERS[args.impl](args.files.split(","), args.threads, args.batch_size)
    except (ImportError, AttributeError) as e:  # fleet.data not there yet, or no paddle
        say({"unavailable": f"{type(e).__name__}: {e}"})
        return
    say({"ready": True})
    for command in sys.stdin:
        if command.strip() != "load":
            break
        gc.collect()
        before = rss_bytes()
        seconds, examples, held, obj = load()
        gc.collect()
        after = rss_bytes()
        say({"seconds": seconds, "examples": examples, "rss_delta_bytes": after - before,
             "held_bytes": held})  # fmt: skip
        if hasattr(obj, "release_memory"):
            obj.release_memory()
        del obj


if __name__ == "__main__":
    main()
