"""A parameter-server job that checkpoints, resumes and exports a serving copy (both roles in one
script). ``--phase train``: sync training with ``fleet.ps.checkpoint`` every ``--every`` steps
(each trainer's state: its data position), trainer 0 records the rows and dense values right
after each checkpoint, then ``fleet.ps.export_serving`` and a comparison of the training model's
predictions with ``fleet.ps.ServingModel(...).predict`` on a held-out batch. ``--phase resume``:
``fleet.ps.load_latest`` on fresh servers; every trainer reports what it got back."""

import argparse
import json

import numpy as np
import torch

import fleet
from fleet.ps.runtime import get_client
from ps_server import Adagrad, Uniform

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--phase", choices=["train", "resume"], required=True)
p.add_argument("--root", required=True, help="checkpoint directory (under the checkpoint root)")
p.add_argument("--export", default="")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--every", type=int, default=2)
p.add_argument("--keep", type=int, default=2)
args = p.parse_args()

fleet.init(is_collective=False, strategy=fleet.DistributedStrategy())


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = fleet.DistributedEmbedding(
            "emb", 4, optimizer=Adagrad(0.1), initializer=Uniform(-0.5, 0.5), pooling="sum"
        )
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids)).squeeze(-1)


model = Net()
if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
    raise SystemExit(0)

fleet.init_worker()
rank, world = fleet.worker_index(), fleet.worker_num()
gen = torch.Generator().manual_seed(1234)
batches = [
    (torch.randint(-40, 40, (16, 3), generator=gen) * 1_000_003, torch.randn(16, generator=gen))
    for _ in range(args.steps)
]
keys = np.unique(torch.cat([ids.reshape(-1) for ids, _ in batches]).numpy())

out: dict = {"rank": rank}
if args.phase == "resume":
    result = fleet.ps.load_latest(args.root)
    opt = fleet.distributed_optimizer(torch.optim.Adagrad(model.fc.parameters(), lr=0.1))
    out["chosen"] = result.chosen.name if result.chosen else None
    out["step"] = result.chosen.step if result.chosen else None
    out["state"] = result.chosen.trainer_states.get(rank) if result.chosen else None
    out["skipped"] = [list(s) for s in result.skipped]
    out["rows"] = get_client().pull_sparse("emb", keys).tolist()
    out["fc"] = [q.detach().reshape(-1).tolist() for q in model.fc.parameters()]
else:
    opt = fleet.distributed_optimizer(torch.optim.Adagrad(model.fc.parameters(), lr=0.1))
    b = 16 // world
    out["at"] = {}
    for step, (ids, y) in enumerate(batches, start=1):
        mine = slice(rank * b, (rank + 1) * b)
        loss = torch.nn.functional.mse_loss(model(ids[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % args.every == 0:
            position = {"file": f"part-{rank:05d}", "pass": 0, "offset": step * b}
            fleet.ps.checkpoint(args.root, step, trainer_state=position, keep=args.keep)
            if rank == 0:  # sync mode: no trainer's next step is applied before trainer 0 pushes
                out["at"][step] = {
                    "rows": get_client().pull_sparse("emb", keys).tolist(),
                    "fc": [q.detach().reshape(-1).tolist() for q in model.fc.parameters()],
                }
    config = {"tables": {"emb": {"dim": 4, "pooling": "sum"}}, "slots": ["ids"]}
    record = fleet.ps.export_serving(args.export, min_show=0, model=model, model_config=config)
    out["export_rows"] = record.rows
    if rank == 0:
        held_out = torch.from_numpy(keys[: 3 * 10].reshape(10, 3))
        model.eval()
        with torch.no_grad():
            reference = model(held_out)
        serving = fleet.ps.ServingModel(args.export)
        predicted = serving.predict(model, held_out)
        out["max_diff"] = float((predicted - reference).abs().max())
        out["model_config"] = serving.model_config
        unknown = np.array([7, -3, 10**15], dtype=np.int64)
        assert not np.isin(unknown, keys).any()
        out["unknown_max"] = float(np.abs(serving.pull("emb", unknown)).max())
        out["keys"] = keys.tolist()
fleet.barrier_worker()
fleet.stop_worker()
with open(f"{args.out}.{rank}.json", "w") as f:
    json.dump(out, f)
