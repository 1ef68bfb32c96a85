"""The job of the warm-start benchmark (``bench/bench_warm_start.py``).

``--mode barrier``: init gloo, one barrier, exit (launch-to-exit).
``--mode restart --stamp DIR``: attempt 0: rank 1 writes its death time and exits 1 after the
first barrier; a restarted attempt writes the time its rank 1 is back through init and a barrier
(a restart's cost to the job).
``--mode hold --stamp DIR``: import torch, build an optimizer (``torch._dynamo``), write this
process's pid, then wait for ``DIR/stop`` (memory of idle workers). ``--mode idle``: the same
without the optimizer (workers after ``import torch`` alone). With ``--fail_first``,
attempt 0 writes ``DIR/wait.RANK``, waits for ``DIR/go`` and exits 1, so the workers measured
are the restarted ones.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["barrier", "restart", "hold", "idle"], default="barrier")
p.add_argument("--stamp", default="")
p.add_argument("--fail_first", action="store_true")
args = p.parse_args()
rank = int(os.environ["RANK"])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

if args.fail_first and restart == 0:
    open(os.path.join(args.stamp, f"wait.{rank}"), "w").close()
    while not os.path.exists(os.path.join(args.stamp, "go")):
        time.sleep(0.05)
    raise SystemExit(1)

if args.mode in ("hold", "idle"):
    if args.mode == "hold":
        torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)
    with open(os.path.join(args.stamp, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(os.path.join(args.stamp, "stop")):
        time.sleep(0.05)
    raise SystemExit(0)

dist.init_process_group("gloo")
dist.barrier()
if args.mode == "restart":
    if restart == 0 and rank == 1:
        with open(os.path.join(args.stamp, "died"), "w") as f:
            f.write(repr(time.time()))
        os._exit(1)
    if restart == 0:
        dist.barrier()  # blocks: rank 1 never arrives; the launcher restarts the job
    elif rank == 1:
        with open(os.path.join(args.stamp, "back"), "w") as f:
            f.write(repr(time.time()))
dist.destroy_process_group()
