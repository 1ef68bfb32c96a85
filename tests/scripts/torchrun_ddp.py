"""A plain torchrun script: reads RANK/LOCAL_RANK/WORLD_SIZE, init_process_group("gloo"), DDP.
Nothing fleetrun-specific; it must run under fleetrun unchanged."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(8, 4) + rank
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = model.module.weight.detach().clone()
    ws = [torch.zeros_like(w) for _ in range(world)]
    dist.all_gather(ws, w)
    assert all(torch.equal(ws[0], x) for x in ws), "DDP replicas diverged"
    print(f"TORCHRUN_OK rank={rank} world={world} local_rank={local_rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
