"""Elastic test worker: DP on gloo with a plain torch.save checkpoint, resuming at any world size.

    elastic_train.py CKPT_DIR --steps N [--step_time S] [--every K] [--stop_file F]

Every step: allreduce of the gradients, SGD, and rank 0 appends ``{"step", "world", "restart",
"time"}`` to CKPT_DIR/progress.jsonl; every K steps rank 0 saves model, optimizer and step to
CKPT_DIR/ckpt.pt (tmp + rename). At start every rank loads ckpt.pt if present and goes on from
its step, and rank 0 appends a ``start`` record with the elastic env it got. With --stop_file,
training goes on past N steps until that file exists (rank 0 decides, every rank follows), so a
test ends the job when it has seen what it waits for.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PADDLE_TRAINERS_NUM",
    "PADDLE_TRAINER_ID",
    "PADDLE_TRAINER_ENDPOINTS",
)


def append(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt_dir")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step_time", type=float, default=0.2)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--stop_file", default=None)
    p.add_argument("--max_steps", type=int, default=100000)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ckpt = os.path.join(args.ckpt_dir, "ckpt.pt")
    progress = os.path.join(args.ckpt_dir, "progress.jsonl")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        append(
            progress,
            {
                "event": "start",
                "step": step,
                "world": world,
                "restart": restart,
                "time": time.time(),
                "pid": os.getpid(),
                "env": {k: os.environ.get(k) for k in ENV_KEYS},
            },
        )
    g = torch.Generator().manual_seed(1234)
    while True:
        done = step >= args.steps and (args.stop_file is None or os.path.exists(args.stop_file))
        flag = torch.tensor([1.0 if (done and rank == 0) or step >= args.max_steps else 0.0])
        dist.all_reduce(flag)  # rank 0's decision, seen by every rank at the same step
        if flag.item() > 0:
            break
        x = torch.randn(8, 4, generator=g)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
        opt.step()
        step += 1
        if rank == 0:
            append(
                progress,
                {
                    "event": "step",
                    "step": step,
                    "world": world,
                    "restart": restart,
                    "time": time.time(),
                    "loss": float(loss.detach()),
                },
            )
            if step % args.every == 0:
                tmp = ckpt + ".tmp"
                torch.save(
                    {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp
                )
                os.replace(tmp, ckpt)
        time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
