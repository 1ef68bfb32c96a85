"""Trainer 0 of an async PS job (fleetrun --ps_checkpoint_dir: the trainers meet through the
coordinator) SIGKILLs itself right after ``fleet.ps.export_serving`` and a barrier; fleetrun
restarts it alone, and its rerun replays the export's rounds: it must get the record of the
export made before its restart, not export again (tests/test_ps_serving.py)."""

import argparse
import json
import os
import signal

import torch

import fleet
from ps_server import Adagrad, Uniform

p = argparse.ArgumentParser()
p.add_argument("--export", required=True)
p.add_argument("--out", required=True)
args = p.parse_args()

strategy = fleet.DistributedStrategy()
strategy.a_sync = True
fleet.init(is_collective=False, strategy=strategy)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = fleet.DistributedEmbedding(
            "emb", 4, optimizer=Adagrad(0.1), initializer=Uniform(-0.5, 0.5), pooling="sum"
        )
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids)).squeeze(-1)


model = Net()
if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
    raise SystemExit(0)
fleet.init_worker()
rank = fleet.worker_index()
opt = fleet.distributed_optimizer(torch.optim.SGD(model.fc.parameters(), lr=0.1))
gen = torch.Generator().manual_seed(rank)
for _ in range(5):
    ids, y = torch.randint(0, 50, (8, 3), generator=gen), torch.randn(8, generator=gen)
    torch.nn.functional.mse_loss(model(ids), y).backward()
    opt.step()
    opt.zero_grad()
record = fleet.ps.export_serving(args.export, model=model)
first = "FLEET_PS_RESUME_POSITION" not in os.environ
with open(f"{args.out}.{rank}.{'first' if first else 'rerun'}.json", "w") as f:
    # the commit file's mtime: a second export (not skipped) would write it again
    mtime = os.stat(os.path.join(args.export, "checkpoint.json")).st_mtime_ns
    json.dump({"record": record.to_dict(), "mtime_ns": mtime}, f)
if rank == 0 and first:  # its progress file holds a data position since its first step
    os.kill(os.getpid(), signal.SIGKILL)
fleet.barrier_worker()
fleet.stop_worker()
