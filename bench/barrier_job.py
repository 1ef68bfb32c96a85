"""Trivial job for the launch benchmarks: init gloo, one barrier, exit.
With ``--die_rank R`` rank R writes its death time to ``--stamp`` and exits 1 while the
others wait in a barrier (time from a rank's death to the launcher's exit)."""

import argparse
import os
import time

import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--die_rank", type=int, default=-1)
p.add_argument("--stamp", default="")
args = p.parse_args()
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == args.die_rank:
    with open(args.stamp, "w") as f:
        f.write(repr(time.time()))
    os._exit(1)
if args.die_rank >= 0:
    dist.barrier()  # blocks: the dying rank never arrives
dist.destroy_process_group()
