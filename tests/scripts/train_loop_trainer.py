"""One PS trainer running fleet.train_from_dataset, meeting the other trainers through fleetrun's
coordinator (FLEET_PS_COORDINATOR from the test): no process group, so only fleet's worker
index can tell it whether to print the progress lines (tests/test_train_loop.py)."""

from __future__ import annotations

import sys

import torch

import fleet
from fleet.strategy import DistributedStrategy

sys.path.insert(0, sys.argv[1])  # the tests directory: the batches and model of test_train_loop
from test_train_loop import _batches, _Model  # noqa: E402

strategy = DistributedStrategy()
strategy.a_sync = True
fleet.init(is_collective=False, strategy=strategy)
model = _Model()
fleet.train_from_dataset(
    model,
    torch.optim.SGD(model.parameters(), lr=0.1),
    _batches(10),
    torch.nn.BCEWithLogitsLoss(),
    label="click",
    print_period=5,
    auc=False,
)
print(f"trainer {fleet.worker_index()} done", flush=True)
