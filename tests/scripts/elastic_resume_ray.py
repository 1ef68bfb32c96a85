"""Fixture for tests/test_elastic_ray.py: a DP job that resumes through fleet.elastic at
whatever world size its round has, training slowly enough to be cut mid-way.

Every rank appends one JSON line per step to ``<out>/steps.rank<r>.jsonl`` (step, world size,
round = TORCHELASTIC_RESTART_COUNT) and writes ``<out>/proc.rank<r>.round<k>.json`` (its pid and
its parent's, the Ray actor, and its world size) at start. ``--hold_step H``: at world size 1 a
rank stops at step H and waits for the launcher to re-form the job (at most ``HOLD_S``; then it
fails), so the test decides when a round at world size 1 ends, not the clock.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import fleet
from fleet.elastic import Checkpointer

HOLD_S = 300.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step_s", type=float, default=0.1)
    ap.add_argument("--hold_step", type=int, default=10**9)
    args = ap.parse_args()
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    round_no = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"proc.rank{rank}.round{round_no}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "world": world}, f)
    torch.manual_seed(0)
    model = fleet.distributed_model(torch.nn.Linear(4, 1))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    ckpt = Checkpointer(model, opt, args.ckpt, every_steps=2)
    step = ckpt.restore().step
    x = torch.ones(8, 4)
    while step < args.steps:
        if world == 1 and step >= args.hold_step:
            deadline = time.monotonic() + HOLD_S
            while time.monotonic() < deadline:  # the launcher stops this process to re-form
                time.sleep(0.1)
            raise SystemExit(f"still at world size 1 after {HOLD_S:g} s at step {step}")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        ckpt.step(step)
        with open(os.path.join(args.out, f"steps.rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "world": world, "round": round_no}) + "\n")
        time.sleep(args.step_s)
    fleet.shutdown()


if __name__ == "__main__":
    main()
