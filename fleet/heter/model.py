"""The cut: :class:`HeterModel` and the CPU trainer's side of a heterogeneous PS job.

``HeterModel(cpu_part, device_part, loss_fn)`` is the model as the script states it, in every
role. What it does depends on the process:

* **CPU trainer** of a job with heter workers (PADDLE_HETER_TRAINER_IP_PORT_LIST set):
  :meth:`HeterModel.train_step` runs ``cpu_part`` (its ``DistributedEmbedding`` pulls and any
  dense layers), sends the activations and the label to heter worker ``rank mod H``, and, when
  that micro-batch's activation gradients return, backpropagates them into ``cpu_part`` and
  ends the PS step (``optimizer.step()`` of the PS optimizer when given, else the
  communicator's step: sparse pushes as the mode says). Up to
  ``strategy.heter_configs.max_in_flight`` micro-batches stay in flight (async); each keeps its
  ``cpu_part`` graph until its gradients return. ``forward`` (evaluation) sends the
  activations for a forward-only pass and returns the heter worker's output.
* **Heter worker:** the model is served by :func:`fleet.run_heter_worker`
  (:mod:`fleet.heter.worker`): ``device_part`` and ``loss_fn`` run there.
* **Anywhere else** (one process, no PS mode, or a PS job without heter workers): both halves
  run here; ``train_step`` is forward, loss, backward and ``optimizer.step()``. This is the
  one-process model sync mode equals.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from collective.env import TrainingRole
from collective.errors import ConfigError, FleetError
from fleet.ps import runtime as ps_runtime

logger = logging.getLogger(__name__)


def as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    """``cpu_part``'s output as a tuple of tensors (a tensor, or a tuple/list of them)."""
    parts = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    for i, t in enumerate(parts):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"cpu_part must return a tensor or a tuple of tensors (the activations sent to "
                f"the heter worker); output {i} is a {type(t).__name__}",
                key="cpu_part",
            )
    return parts


def pack(acts: tuple[torch.Tensor, ...], label: Any = None) -> dict[str, np.ndarray]:
    """The arrays of a Heter request: ``act0..actN`` (and ``label``)."""
    arrays = {f"act{i}": t.detach().cpu().contiguous().numpy() for i, t in enumerate(acts)}
    if label is not None:
        lab = label if isinstance(label, torch.Tensor) else torch.as_tensor(label)
        arrays["label"] = lab.detach().cpu().contiguous().numpy()
    return arrays


_FLOAT_TARGET = (nn.BCEWithLogitsLoss, nn.BCELoss, nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss)
_CLASS_TARGET = (nn.CrossEntropyLoss, nn.NLLLoss)


def as_target(loss_fn: Any, out: Any, label: torch.Tensor) -> torch.Tensor:
    """The label as ``loss_fn`` takes it: float and shaped like the output for BCE-style
    losses, int64 ``[B]`` for class indices (a dataset's label slot is int64 ``[B, 1]``)."""
    if not isinstance(out, torch.Tensor):
        return label
    if isinstance(loss_fn, _FLOAT_TARGET) and label.numel() == out.numel():
        return label.to(out.dtype).reshape(out.shape)
    if isinstance(loss_fn, _CLASS_TARGET) and label.dim() == 2 and label.shape[1] == 1:
        return label.reshape(-1).to(torch.int64)
    return label


@dataclass
class _InFlight:
    seq: int
    acts: tuple[torch.Tensor, ...]
    reply: Future[Any]
    optimizer: Any
    label: torch.Tensor


class _TrainerLink:
    """A CPU trainer's connection to its heter worker."""

    def __init__(
        self, rank: int, endpoint: str, max_in_flight: int, recovery_s: float, start_s: float
    ) -> None:
        from ps_server.heter_client import HeterClient

        self.rank, self.endpoint, self.max_in_flight = rank, endpoint, max_in_flight
        self.client = HeterClient(endpoint, recovery_s=recovery_s, in_flight=max_in_flight + 1)
        self.client.wait_ready(start_s)  # HeterUnavailableError naming it
        info, _ = self.client.call("Hello", {"trainer": rank})
        logger.info(
            "trainer %d -> heter worker %s (index %s, device %s, %s, up to %d in flight)",
            rank,
            endpoint,
            info.get("index"),
            info.get("device"),
            info.get("mode"),
            max_in_flight,
        )


class HeterModel(nn.Module):
    """A model cut in two: ``cpu_part`` on the CPU trainers, ``device_part`` + ``loss_fn`` on the
    heter workers (see the module docstring).

    ``cpu_part(*inputs)`` returns the activations (a tensor or a tuple of tensors, batch first);
    ``device_part(*activations)`` returns the output; ``loss_fn(output, label)`` the mean loss
    of the micro-batch."""

    def __init__(
        self,
        cpu_part: nn.Module,
        device_part: nn.Module,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        for name, part in (("cpu_part", cpu_part), ("device_part", device_part)):
            if not isinstance(part, nn.Module):
                raise ConfigError(f"must be a torch.nn.Module, got {type(part).__name__}", key=name)
        if not callable(loss_fn):
            raise ConfigError(f"must be callable, got {type(loss_fn).__name__}", key="loss_fn")
        self.cpu_part = cpu_part
        self.device_part = device_part
        self.loss_fn = loss_fn
        self._link: _TrainerLink | None = None
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._seq = 0
        self._last_optimizer: Any = None
        self.last_loss: torch.Tensor | None = None
        """The loss of the last micro-batch whose gradients came back."""
        self.last_output: torch.Tensor | None = None
        """That micro-batch's output (from the heter worker; for metrics)."""
        self.last_target: Any = None
        """That micro-batch's label."""
        ps_runtime.note_heter_model()

    # -- where this process stands ------------------------------------------------------------
    def _trainer_link(self) -> _TrainerLink | None:
        """The link to this trainer's heter worker (made on first use), or None when both
        halves run in this process."""
        if self._link is not None:
            return self._link
        st = ps_runtime._state
        if st is None or not st.env.heter_endpoints:
            return None
        role = st.env.training_role
        if role is not TrainingRole.TRAINER:
            raise FleetError(
                f"HeterModel trains on CPU trainers; this process is a {role.value}"
                + (
                    ": serve the model with fleet.run_heter_worker(model, optimizer)"
                    if role is TrainingRole.HETER_TRAINER
                    else ""
                )
            )
        cfg, a_sync = st.strategy.heter_configs, st.strategy.a_sync
        if not a_sync and cfg.max_in_flight > 0:
            raise ConfigError(
                f"max_in_flight={cfg.max_in_flight} needs an asynchronous job (a_sync=True); "
                "sync mode keeps 0 in flight (its math equals one process)",
                key="heter_configs.max_in_flight",
            )
        eps = st.env.heter_endpoints
        endpoint = eps[st.env.rank % len(eps)]
        self._link = _TrainerLink(
            st.env.rank,
            endpoint,
            cfg.max_in_flight if a_sync else 0,
            cfg.recovery_timeout_s,
            cfg.start_timeout_s,
        )
        ps_runtime.add_stop_hook(self.stop)
        return self._link

    # -- training -------------------------------------------------------------------------------
    def train_step(
        self, inputs: Any, label: torch.Tensor, optimizer: Any = None
    ) -> torch.Tensor | None:
        """One training step on ``inputs`` (a tensor or a tuple of ``cpu_part``'s arguments)
        and ``label``. Returns the loss of the micro-batch whose gradients came back in this
        call (sync: this one; async: the oldest in flight, None while the first K are out).
        ``optimizer``: the PS optimizer of ``cpu_part``'s dense parameters
        (``fleet.distributed_optimizer``), stepped and zeroed after each backward; None ends
        each step with the communicator's step (sparse pushes only)."""
        args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        link = self._trainer_link()
        if link is None:
            out = self.device_part(*as_tuple(self.cpu_part(*args)))
            loss = self.loss_fn(out, as_target(self.loss_fn, out, label))
            loss.backward()
            self.last_output, self.last_target = out.detach(), label
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()
            self.last_loss = loss.detach()
            return self.last_loss
        acts = as_tuple(self.cpu_part(*args))
        seq, self._seq = self._seq, self._seq + 1
        reply = link.client.submit("Step", {"trainer": link.rank, "seq": seq}, pack(acts, label))
        self._last_optimizer = optimizer
        self._in_flight.append(_InFlight(seq, acts, reply, optimizer, label))
        loss = None
        while len(self._in_flight) > link.max_in_flight:
            loss = self._complete_oldest()
        return loss

    def _complete_oldest(self) -> torch.Tensor:
        item = self._in_flight.popleft()
        header, arrays = item.reply.result()  # HeterUnavailableError names the worker
        tensors, grads = [], []
        for i, act in enumerate(item.acts):
            if act.requires_grad:
                tensors.append(act)
                grads.append(torch.from_numpy(np.array(arrays[f"grad{i}"])).to(act.dtype))
        if tensors:
            torch.autograd.backward(tensors, grads)
        if item.optimizer is not None:
            item.optimizer.step()
            item.optimizer.zero_grad()
        else:
            ps_runtime.get_communicator().step()
        self.last_loss = torch.tensor(float(header["loss"]))
        self.last_output = torch.from_numpy(np.array(arrays["out"]))
        self.last_target = item.label
        return self.last_loss

    def flush(self) -> torch.Tensor | None:
        """Wait for every micro-batch in flight and finish its step; the last loss."""
        loss = None
        while self._in_flight:
            loss = self._complete_oldest()
        return loss

    def stop(self) -> None:
        """Finish the micro-batches in flight and tell the heter worker this trainer is done
        (``fleet.stop_worker`` calls it)."""
        link = self._link
        if link is None:
            return
        try:
            self.flush()
            link.client.call("Stop", {"trainer": link.rank})
        finally:
            link.client.close()
            self._link = None

    # -- evaluation -----------------------------------------------------------------------------
    def forward(self, *inputs: Any) -> Any:
        """The model's output for ``inputs``. On a CPU trainer of a heter job the activations
        go to the heter worker for a forward-only pass (no gradient flows back: train with
        :meth:`train_step`); elsewhere both halves run here."""
        link = self._trainer_link()
        acts = as_tuple(self.cpu_part(*inputs))
        if link is None:
            return self.device_part(*acts)
        _, arrays = link.client.call("Predict", {"trainer": link.rank}, pack(acts))
        return torch.from_numpy(np.array(arrays["out"]))

    def dense_parameters(self) -> list[nn.Parameter]:
        """``device_part``'s parameters (the heter workers' dense table)."""
        return list(self.device_part.parameters())


__all__ = ["HeterModel", "as_target", "as_tuple", "pack"]
