"""Collective worker for the Kubernetes pod tests: a gloo all_reduce across every trainer, then
OUT/rank<R>.json with the contract variables it got and the strategy file's text."""

import json
import os
import sys

import torch
import torch.distributed as dist

out = sys.argv[sys.argv.index("--out") + 1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t
dist.barrier()
strategy = os.environ.get("FLEET_STRATEGY")
keep = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TRAINING_ROLE",
    "PADDLE_TRAINER_ENDPOINTS",
    "PADDLE_CURRENT_ENDPOINT",
    "POD_IP",
    "FLEET_JOB_NAME",
    "TORCHELASTIC_RUN_ID",
    "FLEET_METRICS_PORT",
    "FLEET_ERROR_FILE",
    "MY_SETTING",
)
text = None
if strategy:
    with open(strategy) as f:
        text = f.read()
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in keep}, "sum": t.item(), "strategy": text}, f)
if "--fail_rank" in sys.argv and rank == int(sys.argv[sys.argv.index("--fail_rank") + 1]):
    raise RuntimeError(f"injected failure on rank {rank}")
dist.destroy_process_group()
print(f"K8S_WORKER_OK rank={rank} world={world}", flush=True)
