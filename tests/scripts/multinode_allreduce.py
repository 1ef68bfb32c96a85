"""all_reduce across every trainer of a (possibly multi-node) job; prints MULTINODE_OK."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t
if "--fail_rank" in sys.argv and rank == int(sys.argv[sys.argv.index("--fail_rank") + 1]):
    if "--linger" in sys.argv:  # close the connections at exit, then take a while to exit
        import atexit
        import time

        atexit.register(time.sleep, float(sys.argv[sys.argv.index("--linger") + 1]))
        atexit.register(dist.destroy_process_group)  # runs first (last registered)
    raise RuntimeError(f"injected failure on rank {rank}")
dist.barrier()
eps = os.environ["PADDLE_TRAINER_ENDPOINTS"].split(",")
assert len(eps) == world
print(
    f"MULTINODE_OK rank={rank} world={world} node={os.environ['GROUP_RANK']} "
    f"attempt={os.environ['TORCHELASTIC_RESTART_COUNT']}",
    flush=True,
)
dist.destroy_process_group()
