"""Elastic resume checkpoints: ``fleet.elastic.Checkpointer`` vs the hand-written torchrun recipe.

One fleetrun job of 2 ranks (CPU/gloo), DP, an MLP of ``--layers`` Linear(width, width) and SGD
with momentum (model + momentum state = 2 x the parameters). Alternating per repetition:

* ``fleet``: ``Checkpointer.save`` (DCP through fleet.save_checkpoint, rank 0 writes the
  replicated state, every file fsynced, elastic.json atomically, directory renamed, keep 2) and
  ``Checkpointer.restore`` (newest checkpoint, loadable at any world size);
* ``peer``: what a torchrun script does by hand: rank 0 ``torch.save({model, optimizer, step})``
  to a temporary file, fsync, ``os.replace``, barrier; restore: every rank ``torch.load`` +
  ``load_state_dict`` (a DP-only format: a sharded optimizer could not load it).

Each value is the slowest rank's time of one save (or restore); the table is median [min ..
max] over ``--reps`` repetitions and the ratio fleet / peer time.

Usage: ``python bench/bench_elastic_checkpoint.py [--reps 5] [--layers 8] [--width 1024]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Stats, fleetrun_cmd, report, run_checked


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist

    import fleet
    from fleet.elastic import Checkpointer

    fleet.init(is_collective=True)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = fleet.distributed_model(torch.nn.Sequential(*layers))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    model(torch.randn(4, args.width)).sum().backward()
    opt.step()  # the momentum state exists
    root = args.dir
    ckpt = Checkpointer(model, opt, os.path.join(root, "fleet"), every_steps=1, keep=2)
    peer_file = os.path.join(root, "peer.pt")

    def slowest(fn) -> float:
        tdist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0])
        tdist.all_reduce(dt, op=tdist.ReduceOp.MAX)
        return float(dt)

    def peer_save(step: int) -> None:
        if tdist.get_rank() == 0:
            tmp = peer_file + ".tmp"
            with open(tmp, "wb") as f:
                torch.save(
                    {
                        "model": model.module.state_dict(),
                        "optimizer": opt.state_dict(),
                        "step": step,
                    },
                    f,
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, peer_file)
        tdist.barrier()

    def peer_restore() -> None:
        state = torch.load(peer_file, weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    times: dict[str, list[float]] = {
        "fleet_save": [],
        "peer_save": [],
        "fleet_restore": [],
        "peer_restore": [],
    }
    for rep in range(args.reps + 1):  # the first is a warm-up
        order = ("fleet", "peer") if rep % 2 else ("peer", "fleet")
        got = {}
        for impl in order:
            if impl == "fleet":
                got["fleet_save"] = slowest(lambda step=rep + 1: ckpt.save(step))
                got["fleet_restore"] = slowest(ckpt.restore)
            else:
                got["peer_save"] = slowest(lambda step=rep + 1: peer_save(step))
                got["peer_restore"] = slowest(peer_restore)
        if rep:
            for k, v in got.items():
                times[k].append(v)
    if tdist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"times": times, "params": params}), flush=True)
    fleet.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = fleetrun_cmd(
            "--nproc_per_node",
            "2",
            "--log_dir",
            os.path.join(tmp, "log"),
            os.path.abspath(__file__),
            "--worker",
            f"--dir={tmp}",
            f"--reps={args.reps}",
            f"--layers={args.layers}",
            f"--width={args.width}",
        )
        out = run_checked(cmd, timeout=1800).stdout
    data = json.loads(next(ln for ln in out.splitlines() if ln.startswith('{"times"')))
    t = {k: Stats.of(v) for k, v in data["times"].items()}
    mb = data["params"] * 4 * 2 / 2**20
    report(
        f"Elastic checkpoints, 2 ranks (CPU gloo), DP, {data['params']} params + momentum "
        f"({mb:.0f} MiB of state)",
        [
            (
                "save: Checkpointer.save vs rank-0 torch.save + fsync + rename",
                t["fleet_save"],
                t["peer_save"],
                "fleet/peer time",
            ),
            (
                "restore: Checkpointer.restore vs torch.load + load_state_dict",
                t["fleet_restore"],
                t["peer_restore"],
                "fleet/peer time",
            ),
        ],
        goal="none set (the peer format cannot reshard a sharded optimizer)",
        json_path=args.json,
    )


if __name__ == "__main__":
    main()
