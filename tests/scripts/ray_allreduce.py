"""Trivial collective job for the Ray scheduler tests: init the gloo group from the env contract,
one all_reduce of (rank + 1), write OUT/rank<R>.attempt<A>.json with the result, pid and env."""

import argparse
import json
import os

import torch
import torch.distributed as torch_dist

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

torch_dist.init_process_group("gloo")
rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
t = torch.tensor([float(rank + 1)])
torch_dist.all_reduce(t)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"rank{rank}.attempt{attempt}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "sum": t.item(), "world": world, "env": dict(os.environ)}, f)
print(f"rank {rank} of {world}: all_reduce sum {t.item():g}", flush=True)
torch_dist.destroy_process_group()
