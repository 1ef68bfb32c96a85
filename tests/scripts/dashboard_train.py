"""A small fleet data-parallel job for the dashboard's real-job browser test.

Trains a tiny MLP (gloo, CPU) with a short sleep per step so it stays cheap on a loaded machine,
reporting loss and samples each step. Rank ``--kill_rank`` SIGKILLs itself after
``--kill_after`` seconds of training, or as soon as the file ``--kill_when`` exists (no error
file: the launcher names it by its signal).

Trainer metrics come from fleet (``fleet.report``) when fleet serves them; on a tree where fleet
does not yet serve ``/metrics`` the script serves the same ``fleet_trainer_*`` names itself on
the port the launcher gave it (FLEET_METRICS_PORT), so the dashboard test pins the page, not the
order in which the pieces landed.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch

import fleet

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=60.0, help="train at most this long")
p.add_argument("--kill_rank", type=int, default=-1)
p.add_argument("--kill_after", type=float, default=10.0)
p.add_argument("--kill_when", default="", help="kill as soon as this file exists")
p.add_argument("--sleep", type=float, default=0.05, help="seconds of sleep per step")
args = p.parse_args()


class OwnMetrics:
    """fleet_trainer_* served by this script (used only when fleet has no ``report``)."""

    def __init__(self) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            start_http_server,
        )

        r = CollectorRegistry()
        self.steps = Counter("fleet_trainer_steps_total", "steps", registry=r)
        self.samples = Counter("fleet_trainer_samples_total", "samples", registry=r)
        self.step_s = Histogram("fleet_trainer_step_seconds", "step time", registry=r)
        self.loss = Gauge("fleet_trainer_loss", "loss", registry=r)
        self.thr = Gauge("fleet_trainer_throughput_samples_per_second", "samples/s", registry=r)
        port = int(os.environ.get("FLEET_METRICS_PORT", "0"))
        start_http_server(port, addr=os.environ.get("FLEET_METRICS_HOST", "127.0.0.1"), registry=r)

    def step(self, loss: float, samples: int, step_s: float) -> None:
        self.steps.inc()
        self.samples.inc(samples)
        self.step_s.observe(step_s)
        self.loss.set(loss)
        self.thr.set(samples / step_s if step_s > 0 else 0.0)


@fleet.record
def main() -> None:
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    own = None if hasattr(fleet, "report") else OwnMetrics()
    torch.manual_seed(0)
    model = fleet.distributed_model(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    )
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(256, 16, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.1
    print(f"rank {rank}: training (fleet.report: {own is None})", flush=True)
    t_start = time.monotonic()
    step = 0
    while time.monotonic() - t_start < args.seconds:
        if rank == args.kill_rank and (
            time.monotonic() - t_start > args.kill_after
            or (args.kill_when and os.path.exists(args.kill_when))
        ):
            print(f"rank {rank}: about to SIGKILL myself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        idx = torch.randint(0, 256, (32,), generator=g)
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()  # DDP all-reduces inside backward
        if own is None:
            fleet.report(loss=loss.item(), samples=32)  # before step(): it closes the step
        opt.step()
        time.sleep(args.sleep)
        step += 1
        if own is not None:
            own.step(loss.item(), 32, time.perf_counter() - t0)
    print(f"rank {rank}: done after {step} steps", flush=True)


if __name__ == "__main__":
    main()
