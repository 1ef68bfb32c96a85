"""Fixture for tests/test_telemetry*.py and test_prometheus*.py: a small DP or PS training job
that reports loss, then (optionally) holds until a file exists so tests can scrape it alive."""

import argparse
import os
import time

import torch

import fleet

p = argparse.ArgumentParser()
p.add_argument("--mode", default="dp", choices=["dp", "ps"])
p.add_argument("--steps", type=int, default=20)
p.add_argument("--hold_file", default="", help="after training, wait (<= 120 s) until it exists")
args = p.parse_args()


def hold() -> None:
    deadline = time.monotonic() + 120
    while args.hold_file and not os.path.exists(args.hold_file) and time.monotonic() < deadline:
        time.sleep(0.1)


torch.manual_seed(0)
if args.mode == "dp":
    fleet.init(is_collective=True)
    model = fleet.distributed_model(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    for _ in range(args.steps):
        x = torch.randn(32, 8)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        opt.step()
        opt.zero_grad()
        fleet.report(loss=loss)
        time.sleep(0.01)
    hold()
else:
    from ps_server import SGD, Uniform

    fleet.init(is_collective=False)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = fleet.DistributedEmbedding(
                "emb", 4, optimizer=SGD(0.1), initializer=Uniform(-0.5, 0.5), pooling="sum"
            )
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.fc(self.emb(ids)).squeeze(-1)

    model = Net()
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
    else:
        fleet.init_worker()
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.fc.parameters(), lr=0.1))
        for _ in range(args.steps):
            ids = torch.randint(0, 1000, (16, 3))
            loss = torch.nn.functional.mse_loss(model(ids), torch.randn(16))
            loss.backward()
            opt.step()
            opt.zero_grad()
            fleet.report(loss=loss, samples=16)
            time.sleep(0.01)
        hold()
        fleet.stop_worker()
