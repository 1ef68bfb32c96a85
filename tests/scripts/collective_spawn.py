"""Fixture script: ``collective.spawn`` as a user script calls it (module-level worker functions,
``__main__`` guard).

Phase 1 spawns 2 workers that all_reduce and write ``ok.<rank>`` files (``join=False`` + ``join()``).
Phase 2 spawns 2 workers where rank 1 raises while rank 0 blocks in a barrier; the
``WorkerFailedError`` message is printed between markers and rank 0's process must be gone.

Usage: ``collective_spawn.py OUT_DIR``; prints ``SPAWN OK``, the error between
``--- ERROR BEGIN``/``--- ERROR END`` and ``ORPHANS []``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
import torch

import collective as dist
from collective.errors import WorkerFailedError

FAIL_MARKER = "deliberate failure marker 4711"


def ok_worker(out_dir: str, tag: str) -> None:
    """Join the group, all_reduce rank+1, record what this rank saw."""
    env = dist.init_parallel_env(timeout_s=60)
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    seen = {
        "rank": env.rank,
        "world_size": env.world_size,
        "paddle_trainer_id": os.environ["PADDLE_TRAINER_ID"],
        "backend": dist.get_backend(),
        "sum": t.item(),
        "tag": tag,
    }
    Path(out_dir, f"ok.{env.rank}").write_text(json.dumps(seen))
    dist.destroy_process_group()


def failing_worker(out_dir: str) -> None:
    """Rank 1 raises; the others wait in a barrier that never completes."""
    env = dist.init_parallel_env(timeout_s=60)
    Path(out_dir, f"pid.{env.rank}").write_text(str(os.getpid()))
    if env.rank == 1:
        raise ValueError(FAIL_MARKER)
    dist.barrier()


def main() -> None:
    out_dir = sys.argv[1]
    ctx = dist.spawn(ok_worker, args=(out_dir, "hello"), nprocs=2, join=False, backend="gloo")
    while not ctx.join(timeout=1.0):
        pass
    for r in range(2):
        seen = json.loads(Path(out_dir, f"ok.{r}").read_text())
        assert seen == {
            "rank": r,
            "world_size": 2,
            "paddle_trainer_id": str(r),
            "backend": "gloo",
            "sum": 3.0,
            "tag": "hello",
        }, f"rank {r} saw {seen}"
    print("SPAWN OK", flush=True)

    start = time.monotonic()
    try:
        dist.spawn(failing_worker, args=(out_dir,), nprocs=2, backend="gloo")
    except WorkerFailedError as exc:
        print(f"--- ERROR BEGIN\n{exc}\n--- ERROR END", flush=True)
    else:
        raise SystemExit("spawn with a failing child returned normally")
    print(f"failure reported after {time.monotonic() - start:.1f}s", flush=True)
    pids = [int(Path(out_dir, f"pid.{r}").read_text()) for r in range(2)]
    alive = [p for p in pids if psutil.pid_exists(p)]
    print(f"ORPHANS {alive}", flush=True)


if __name__ == "__main__":
    main()
