"""The pipeline-parallel engine: :class:`PipelineParallel` runs a :class:`PipelineLayer`'s stage
in a 1F1B or FThenB schedule over micro-batches and steps the optimizer.

::

    strategy.hybrid_configs = {"pp_degree": 2}
    strategy.pipeline_configs = {"micro_batch_size": 4, "accumulate_steps": 8}
    model = PipelineParallel(pipe_layer, hcg, strategy)   # or fleet.distributed_model(pipe_layer)
    loss = model.train_batch([x, y], optimizer, lr_scheduler)

One ``train_batch`` = ``accumulate_steps`` micro-batches of ``micro_batch_size`` samples (the
batch must be exactly their product). The last stage computes ``loss_fn(output, label)`` per
micro-batch and back-propagates ``loss / accumulate_steps``, so the accumulated gradients are
those of the mean loss over the whole batch (the non-pipelined model's, for a mean-reduced loss).
After the last micro-batch: tied (``SharedLayerDesc``) gradients are summed over the stages that
hold them, gradients are averaged over the data-parallel group (one flat all-reduce per dtype)
when ``dp_degree > 1`` (with sharding stage 3 the stage's module is under FSDP2, built by
:mod:`fleet.parallelize.compose`: it accumulates the micro-batches unsharded and
reduce-scatters over the sharding (x dp) mesh with the last backward), then
``scaler.step(optimizer)``/``scaler.update()`` or
``optimizer.step()``, ``lr_scheduler.step()`` and ``optimizer.zero_grad()``. The returned loss is
the mean over micro-batches, passed from the last stage back along the pipeline to every stage
(one point-to-point message per hop, whose receive is posted when the step starts, so no stage
waits for it at the end of the step as it would on a broadcast).

Why our own schedule and not ``torch.distributed.pipelining`` (``PipelineStage`` +
``Schedule1F1B``): (1) Paddle's API hands the engine a stage that was *built* as a stage
(``PipelineLayer``), with tied weights across stages and a loss on the last stage; torch's
``PipelineStage`` wraps a submodule the same way, but has no notion of shared weights, and its
schedule owns the loss call and the micro-batch split, so tied-gradient and data-parallel
reductions would sit outside it anyway; (2) it needs the stage's input/output shapes up front
(or a shape-inference round trip at construction), where Paddle models change sequence length
between ``train_batch`` and ``eval_batch`` calls; (3) measured on the same 2-stage gloo CPU model
(bench/bench_pipeline.py) our 1F1B step is faster than torch's, because our transport posts
every receive ahead of need (see :mod:`fleet.meta_parallel.pp_schedule`) and runs about half
the Python calls per step; and the schedule is a few lines of plain data that the tests check
directly (:mod:`pp_schedule`). The transport is ``torch.distributed`` isend/irecv.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import fleet.telemetry as telemetry
from collective.errors import ConfigError, FleetError
from fleet.meta_parallel.pipeline_layer import PipelineLayer
from fleet.meta_parallel.pp_schedule import P2P, Action, as_tensor_tuple, make_schedule
from fleet.strategy.configs import PipelineSchedule

logger = logging.getLogger(__name__)


def split_micro_batches(data: Any, micro_batch_size: int, num_micro: int, what: str) -> list[Any]:
    """``data`` (a tensor, a tuple of tensors or None) cut into ``num_micro`` micro-batches
    along dim 0; ConfigError when its batch is not ``micro_batch_size * num_micro``."""
    if data is None:
        return [None] * num_micro
    tensors = data if isinstance(data, (tuple, list)) else (data,)
    expected = micro_batch_size * num_micro
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{what} must be tensors, got {type(t).__name__}", key=what)
        if t.dim() == 0 or t.shape[0] != expected:
            got = "a scalar" if t.dim() == 0 else f"batch {t.shape[0]}"
            raise ConfigError(
                f"{what} has {got} but pipeline_configs asks for micro_batch_size("
                f"{micro_batch_size}) * accumulate_steps({num_micro}) = {expected} samples; "
                "feed batches of that size or change pipeline_configs",
                key="pipeline_configs",
            )
    parts = [t.split(micro_batch_size) for t in tensors]
    if isinstance(data, (tuple, list)):
        return [tuple(p[i] for p in parts) for i in range(num_micro)]
    return list(parts[0])


class PipelineParallel(nn.Module):
    """Run ``layers`` (this rank's stage) as one stage of the pipeline of ``hcg``.

    ``strategy.pipeline_configs`` gives ``micro_batch_size``, ``accumulate_steps`` and
    ``schedule_mode``. Construction is collective over the world (it creates one process group
    per tied-weight key and pipeline, broadcasts tied weights from their first stage and every
    parameter from data-parallel rank 0).
    """

    def __init__(self, layers: PipelineLayer, hcg: Any, strategy: Any) -> None:
        super().__init__()
        if not isinstance(layers, PipelineLayer):
            raise ConfigError(
                f"PipelineParallel needs a PipelineLayer, got "
                f"{type(layers).__name__}; describe the model as a PipelineLayer",
                key="layers",
            )
        stages, stage = hcg.get_pipe_parallel_world_size(), hcg.get_stage_id()
        if (layers.num_stages, layers.stage_id) != (stages, stage):
            raise ConfigError(
                f"the PipelineLayer was cut as stage {layers.stage_id} of {layers.num_stages} but "
                f"this rank is stage {stage} of pp_degree={stages}; build it with "
                "topology=hcg.topology()",
                key="layers",
            )
        if layers.is_last_stage() and layers.loss_fn is None:
            raise ConfigError(
                "the PipelineLayer has no loss_fn; pass loss_fn= so the last stage "
                "can compute the loss",
                key="loss_fn",
            )
        self._layers = layers
        self._hcg = hcg
        self.config = strategy.pipeline_configs
        self.num_stages, self.stage_id = stages, stage
        pipe_ranks = hcg.get_group_ranks("pipe")
        self._pipe_group = hcg.get_pipe_parallel_group()
        self._p2p = P2P(
            self._pipe_group,
            pipe_ranks[stage - 1] if stage > 0 else None,
            pipe_ranks[stage + 1] if stage < stages - 1 else None,
        )
        self._dp_group = hcg.get_data_parallel_group()
        self._dp_degree = hcg.get_data_parallel_world_size()
        self._shared_groups = self._build_shared_groups()
        self._broadcast_initial_parameters()
        self._schedules: dict[tuple[PipelineSchedule, bool, int], list[Action]] = {}
        self._backwards_left = 0
        self.last_step_stats: dict[str, float] = {}
        """Timings of the last train_batch: ``step_s`` (wall), ``compute_s`` (forward+backward),
        so ``1 - compute_s / step_s`` is this stage's bubble + communication share."""

    # set-up -------------------------------------------------------------------------------------
    def _build_shared_groups(self) -> dict[str, Any]:
        """One group per tied key and pipeline: the ranks of the stages holding it. Every rank
        creates every group in the same order (torch requires it)."""
        groups: dict[str, Any] = {}
        me = tdist.get_rank()
        pipelines = self._hcg.topology().get_comm_list("pipe")
        for key, stages in sorted(self._layers.shared_stage_map().items()):
            if len(stages) < 2:
                continue
            for pipe in pipelines:
                ranks = [pipe[s] for s in stages]
                group = tdist.new_group(ranks=ranks)
                if me in ranks:
                    groups[key] = (group, ranks[0])
        for key, (group, src) in groups.items():
            with torch.no_grad():
                tdist.broadcast(self._layers.shared_parameter(key).data, src=src, group=group)
        return groups

    def _broadcast_initial_parameters(self) -> None:
        if self._dp_degree < 2:
            return
        src = self._hcg.get_group_ranks("data")[0]
        with torch.no_grad():
            for t in list(self._layers.parameters()) + list(self._layers.buffers()):
                tdist.broadcast(t.data, src=src, group=self._dp_group)

    # public API -------------------------------------------------------------------------------
    @property
    def layers(self) -> PipelineLayer:
        """The wrapped stage."""
        return self._layers

    def is_first_stage(self) -> bool:
        """True on stage 0."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """True on the last stage."""
        return self.stage_id == self.num_stages - 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Not available: a stage's forward alone is not the model's; use train_batch/eval_batch."""
        raise FleetError(
            "a PipelineParallel model runs by train_batch([x, y], optimizer) or "
            "eval_batch([x, y]); calling it directly would run only this stage"
        )

    def train_batch(
        self,
        data: Sequence[Any],
        optimizer: Any,
        lr_scheduler: Any = None,
        scaler: Any = None,
    ) -> torch.Tensor:
        """One optimizer step over ``accumulate_steps`` micro-batches of ``data = [x, y]``;
        returns the mean micro-batch loss (the same value on every stage)."""
        x, y = self._unpack(data)
        t0 = time.perf_counter()
        self._layers.train()
        losses, compute_s = self._run(x, y, train=True, scaler=scaler)
        loss = self._mean_loss(losses)  # on the last stage; on its way to the others
        self._p2p.wait_all()  # nothing in flight when the optimizer changes tensors in place
        self._reduce_gradients()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        optimizer.zero_grad()
        if loss is None:
            loss = self._p2p.recv_loss()
            self._p2p.wait_all()  # the loss passed on to the previous stage
        self.last_step_stats = {"step_s": time.perf_counter() - t0, "compute_s": compute_s}
        step_s = self.last_step_stats["step_s"]
        telemetry.set_pipeline_bubble_ratio(
            max(0.0, 1.0 - compute_s / step_s) if step_s > 0 else 0.0
        )
        return loss

    @torch.no_grad()
    def eval_batch(self, data: Sequence[Any], compute_loss: bool = True) -> Any:
        """Forward ``data = [x, y]`` through the pipeline. With ``compute_loss``: the mean
        micro-batch loss on every stage; else the last stage's outputs (concatenated over
        micro-batches) on the last stage and None elsewhere."""
        x, y = self._unpack(data, need_label=compute_loss)
        self._layers.eval()
        outs, _ = self._run(x, y, train=False, compute_loss=compute_loss)
        if compute_loss:
            loss = self._mean_loss(outs)
            if loss is None:
                loss = self._p2p.recv_loss()
            self._p2p.wait_all()
            return loss
        self._p2p.wait_all()
        if not self.is_last_stage():
            return None
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs)
        return tuple(torch.cat(parts) for parts in zip(*outs))

    # the schedule -------------------------------------------------------------------------------
    def _unpack(self, data: Sequence[Any], need_label: bool = True) -> tuple[Any, Any]:
        if not isinstance(data, (tuple, list)) or len(data) != 2:
            raise ConfigError(
                "data must be [inputs, labels] (labels may be None on stages other than the last)",
                key="data",
            )
        cfg = self.config
        m, mbs = cfg.accumulate_steps, cfg.micro_batch_size
        x = split_micro_batches(data[0] if self.is_first_stage() else None, mbs, m, "inputs")
        y = split_micro_batches(data[1] if self.is_last_stage() else None, mbs, m, "labels")
        if self.is_last_stage() and need_label and data[1] is None:
            raise ConfigError("the last pipeline stage needs the labels: data=[x, y]", key="data")
        return x, y

    def _run(
        self,
        x: list[Any],
        y: list[Any],
        train: bool,
        scaler: Any = None,
        compute_loss: bool = True,
    ) -> tuple[list[Any], float]:
        m = self.config.accumulate_steps
        mode = PipelineSchedule(self.config.schedule_mode) if train else PipelineSchedule.F_THEN_B
        key = (mode, train, m)
        actions = self._schedules.get(key)
        if actions is None:  # the schedule depends only on the key: built once
            actions = make_schedule(mode, self.num_stages, self.stage_id, m)
            if not train:
                actions = [a for a in actions if a.kind == "F"]
            self._schedules[key] = actions
        self._p2p.new_step(m, train, with_loss=compute_loss)
        self._backwards_left = sum(1 for a in actions if a.kind != "F")
        inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        outputs: dict[int, Any] = {}
        results: list[Any] = []
        compute = 0.0
        for action in actions:
            if action.kind == "F":
                compute += self._forward(
                    action, x, y, inputs, outputs, results, train, compute_loss
                )
            else:
                compute += self._backward(action, inputs, outputs, scaler)
        return results, compute

    def _forward(
        self,
        action: Action,
        x: list[Any],
        y: list[Any],
        inputs: dict[int, Any],
        outputs: dict[int, Any],
        results: list[Any],
        train: bool,
        compute_loss: bool,
    ) -> float:
        i = action.micro_batch
        if self.is_first_stage():
            stage_in: Any = x[i]
        else:
            received = self._p2p.recv_forward(requires_grad=train)
            inputs[i] = received
            stage_in = received if len(received) > 1 else received[0]
        t0 = time.perf_counter()
        out = self._layers(stage_in)
        if self.is_last_stage():
            if compute_loss:
                loss = self._layers.loss_fn(out, y[i])
                if loss.dim() != 0:
                    loss = loss.mean()
                results.append(loss.detach())
                if train:
                    outputs[i] = loss / self.config.accumulate_steps
            else:
                results.append(out)
            return time.perf_counter() - t0
        outs = (
            (out,)
            if isinstance(out, torch.Tensor)
            else as_tensor_tuple(out, f"the output of stage {self.stage_id}")
        )
        elapsed = time.perf_counter() - t0
        if train:
            outputs[i] = outs
        self._p2p.send_forward(outs)
        return elapsed

    def _backward(
        self, action: Action, inputs: dict[int, Any], outputs: dict[int, Any], scaler: Any
    ) -> float:
        i = action.micro_batch
        out = outputs.pop(i)
        self._backwards_left -= 1
        fsdp = self._fsdp_layers()
        if fsdp is not None:
            # Sharding stage 3: accumulate the micro-batches' gradients unsharded and
            # reduce-scatter once, with the last backward (torch.distributed.pipelining's way).
            last = self._backwards_left == 0
            fsdp.set_requires_gradient_sync(last)
            fsdp.set_reshard_after_backward(last)
            fsdp.set_is_last_backward(last)
        if self.is_last_stage():
            t0 = time.perf_counter()
            (scaler.scale(out) if scaler is not None else out).backward()
        else:
            grads = self._p2p.recv_backward(out)
            t0 = time.perf_counter()
            needs = [t for t in out if t.requires_grad]
            if needs:
                torch.autograd.backward(needs, grad_tensors=grads)
        elapsed = time.perf_counter() - t0
        received = inputs.pop(i, None)
        if received is not None:
            self._p2p.send_backward(received)
        return elapsed

    # reductions ---------------------------------------------------------------------------------
    def _fsdp_layers(self) -> Any:
        """The stage's module when sharding stage 3 put it under FSDP2 (it then reduces the
        gradients over dp x sharding itself), else None."""
        from torch.distributed.fsdp import FSDPModule

        return self._layers if isinstance(self._layers, FSDPModule) else None

    def _reduce_gradients(self) -> None:
        for key, (group, _) in self._shared_groups.items():
            p = self._layers.shared_parameter(key)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            # sum: the tied weight's total gradient. Under FSDP2 each holder's shard: the
            # stages holding the tie share the sharding coordinate, so the shards line up.
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            tdist.all_reduce(grad, group=group)
        if self._dp_degree < 2 or self._fsdp_layers() is not None:
            return
        params = [p for p in self._layers.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            tdist.all_reduce(flat, group=self._dp_group)
            flat /= self._dp_degree
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor | None:
        """On the last stage: the mean micro-batch loss (float32), sent on towards stage 0 along
        the pipeline (a point-to-point message each hop, whose receive every stage posted at
        the start of the step, instead of a broadcast that waits for the slowest stage). None
        elsewhere: the loss is taken with ``P2P.recv_loss`` at the end of the step."""
        if not self.is_last_stage():
            return None
        loss = torch.stack([t.float() for t in losses]).mean()
        self._p2p.send_loss(loss)
        return loss


__all__ = ["PipelineParallel", "split_micro_batches"]
