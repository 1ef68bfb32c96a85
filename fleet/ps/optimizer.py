"""``fleet.distributed_optimizer`` in parameter-server mode: dense parameters live on the PS.

The torch optimizer the script built names the rule and its hyper-parameters; the servers apply
the same rule (:mod:`ps_server.core.optimizers`, torch.optim math) to the dense table, block per
parameter. ``step()`` hands this step's gradients to the communicator (sync / async / half-async
push them to the servers; GEO applies the torch optimizer locally and exchanges deltas every K
steps) and copies the servers' values back into the parameters.

Supported rules: SGD (no momentum, weight decay or nesterov), Adagrad (no lr_decay/weight decay),
Adam (no weight decay, no amsgrad). Anything else is a ConfigError saying what to use — the
server cannot run arbitrary torch optimizers, and silently substituting one would train a
different model.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from collective.env import TrainingRole
from collective.errors import ConfigError
from fleet.ps import auto_checkpoint
from fleet.ps.communicator import DENSE_BLOCK, DENSE_TABLE, GeoCommunicator
from fleet.ps.runtime import _barrier, _require, get_client, get_communicator

logger = logging.getLogger(__name__)


def rule_from_torch(opt: torch.optim.Optimizer) -> Any:
    """The ps_server rule equal to ``opt`` (first param group's hyper-parameters)."""
    from ps_server import SGD, Adagrad, Adam

    g = opt.param_groups[0]
    name = type(opt).__name__

    def refuse(what: str) -> ConfigError:
        return ConfigError(
            f"{name} with {what} cannot run on the parameter servers; supported: "
            "SGD(lr), Adagrad(lr, initial_accumulator_value, eps), Adam(lr, betas, eps)",
            key="optimizer",
        )

    if isinstance(opt, torch.optim.SGD):
        for k in ("momentum", "weight_decay", "dampening"):
            if g.get(k):
                raise refuse(f"{k}={g[k]}")
        if g.get("nesterov"):
            raise refuse("nesterov=True")
        return SGD(float(g["lr"]))
    if isinstance(opt, torch.optim.Adagrad):
        for k in ("lr_decay", "weight_decay"):
            if g.get(k):
                raise refuse(f"{k}={g[k]}")
        return Adagrad(
            float(g["lr"]),
            initial_accumulator_value=float(g["initial_accumulator_value"]),
            eps=float(g["eps"]),
        )
    if type(opt) is torch.optim.Adam:
        if g.get("weight_decay"):
            raise refuse(f"weight_decay={g['weight_decay']}")
        if g.get("amsgrad"):
            raise refuse("amsgrad=True")
        b1, b2 = g["betas"]
        return Adam(float(g["lr"]), betas=(float(b1), float(b2)), eps=float(g["eps"]))
    raise refuse("this type")


def _dense_exists(client: Any) -> bool:
    from ps_server.rpc.status import PSNotFoundError

    try:
        client.pull_dense(DENSE_TABLE, DENSE_BLOCK)
    except PSNotFoundError:
        return False
    return True


class PSOptimizer(torch.optim.Optimizer):
    """The wrapped optimizer's param groups and state; ``step`` goes through the communicator."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        st = _require("distributed_optimizer()", TrainingRole.TRAINER)
        self.inner = optimizer
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state = optimizer.state
        self.comm = get_communicator()
        client = get_client()
        # a job with automatic checkpoints resumes here: the servers load the newest good one
        # (dense values included, so they win over this trainer's below) before the first step
        self.auto = auto_checkpoint.start()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        geo = isinstance(self.comm, GeoCommunicator)
        rule = rule_from_torch(optimizer) if not geo else None
        from ps_server import SGD

        client.create_dense_table(DENSE_TABLE, optimizer=rule or SGD(0.0))
        self.comm.add_dense(params)
        if st.env.rank == 0 and not _dense_exists(client):
            # one trainer's initial values are the job's; servers that loaded a checkpoint
            # already hold the block, and their values win (as Paddle's init_worker pulls them)
            client.init_dense(DENSE_TABLE, DENSE_BLOCK, self.comm.dense_values())
        _barrier()
        self.comm._set_dense(self.comm.pull_dense())
        if geo:
            assert isinstance(self.comm, GeoCommunicator)
            self.comm.dense_step = optimizer.step
            self.comm.set_dense_base()

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """End of a training step: exchange with the servers as the strategy's mode says."""
        loss = closure() if closure is not None else None
        self.comm.step()
        if self.auto is not None:
            self.auto.after_step()  # a step boundary: maybe the job's automatic checkpoint
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"PSOptimizer({self.comm.mode}, {self.inner!r})"
