"""ZeRO-style sharding over the hybrid topology's sharding axis (``hybrid_configs.sharding_degree``).

``strategy.sharding = True`` with ``sharding_configs.stage``:

* **stage 1** (optimizer state): every parameter gets one *owner* among the ``N`` ranks of the
  sharding group (greedy, largest parameter first, to the least-loaded rank: the partition of
  torch's ``ZeroRedundancyOptimizer``). The user's optimizer keeps only its owned parameters in
  its ``param_groups`` (the group dicts themselves stay, so LR schedulers built on it work), so
  its state (momentum, Adam moments) exists for ~1/N of the model. Gradients are averaged over
  the data-parallel x sharding ranks (DDP over that combined group, overlapped with backward;
  under pipeline parallelism the pipeline reduces over ``dp`` and :meth:`ShardedOptimizer.step`
  over the sharding group); each rank updates its own parameters and broadcasts them to the
  sharding group (bucketed by ``sharding_configs.segment_broadcast_MB``).
* **stage 2** (+ gradients): no all-reduce over the sharding axis; at ``step()`` each bucket of
  gradients is *reduced to its owner* (``dist.reduce``), the other ranks drop theirs
  (``grad = None``), then the owner steps and broadcasts as in stage 1. The reduction happens at
  step time, after backward: the gradient memory saved is the one held between steps (and, with
  gradient merge, none is saved during accumulation). Stage 3 is the one that lowers the peak.
* **stage 3** (+ parameters): torch's FSDP2 ``fully_shard`` over a DeviceMesh of the sharding
  group (2-D ``(dp, sharding)`` mesh, i.e. HSDP, when ``dp_degree > 1``); see
  :func:`apply_fsdp`. It works on CPU with gloo in torch 2.13 (tests/test_sharding.py runs it).
* ``offload`` (stages 1/2): the owned parameters' float32 master copies and the optimizer state
  live in pinned host memory; gradients are copied there before the update and the parameters
  back after it. Meaningful only with the model on a GPU (ConfigError on CPU); stage 3 uses
  FSDP2's ``CPUOffloadPolicy``.

Ours vs torch's, and why: stage 3 is torch's FSDP2 (it does the job and overlaps its collectives
with compute). Stages 1 and 2 are ours (the class below) rather than ``ZeroRedundancyOptimizer``,
because (a) ZeroRedundancyOptimizer builds its own optimizer from ``optimizer_class`` and
keyword arguments, while fleet receives an optimizer the user already built (and may have
attached an LR scheduler or GradScaler to) — here that object keeps doing the update; (b) it has
no gradient side (stage 2's reduce-to-owner) and (c) it assumes the gradient is already reduced
over its one group, whereas a hybrid job reduces over ``dp`` and ``sharding`` separately (the
pipeline schedule owns the ``dp`` reduction). bench/bench_sharding.py compares both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as tdist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from collective.errors import ConfigError
from fleet.meta_optimizers.base import DelegatingOptimizer

logger = logging.getLogger(__name__)


def partition_parameters(sizes: list[int], num_ranks: int) -> list[int]:
    """Owner (0 .. num_ranks-1) of each parameter, by ``sizes`` (element counts).

    Largest first to the least-loaded rank (ties: the lower rank), as ZeroRedundancyOptimizer
    does; deterministic, so every rank computes the same partition.
    """
    loads = [0] * num_ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors held in ``optimizer.state`` on this rank (local shards of DTensors)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _buckets(params: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``params`` of one dtype, each at most ``cap_bytes`` (or one tensor)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if out and out[-1][0].dtype == p.dtype and size + nbytes <= cap_bytes:
            out[-1].append(p)
            size += nbytes
        else:
            out.append([p])
            size = nbytes
    return out


class ShardedOptimizer(DelegatingOptimizer):
    """Stage 1/2 sharding around the user's optimizer (which then updates only owned params).

    Like every fleet optimizer wrapper (:class:`~fleet.meta_optimizers.base.DelegatingOptimizer`),
    ``param_groups`` and ``state`` are the wrapped optimizer's.
    ``param_groups`` lists only this rank's parameters; :meth:`zero_grad` clears all of them.
    ``state_dict()`` is this rank's shard; use :func:`fleet.save_checkpoint` for a full one.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int,
        group: Any,
        group_ranks: list[int],
        reduce_grads: bool,
        offload: bool = False,
        segment_MB: float = 32.0,
    ) -> None:
        if stage not in (1, 2):
            raise ConfigError(
                f"ShardedOptimizer handles stages 1 and 2, got {stage}",
                key="sharding_configs.stage",
            )
        if optimizer.state:
            raise ConfigError(
                "the optimizer already holds state (it has stepped); sharding partitions the "
                "state, so pass it to fleet.distributed_optimizer before the first step",
                key="optimizer",
            )
        super().__init__(optimizer)
        self.stage = stage
        self.group = group
        self.group_ranks = list(group_ranks)
        self.num_shards = len(group_ranks)
        self.shard_rank = group_ranks.index(tdist.get_rank())
        self.reduce_grads = reduce_grads
        self.offload = offload
        self._cap = int(segment_MB * 2**20)
        self._grads_reduced = False

        seen: set[int] = set()
        self._params: list[torch.Tensor] = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    self._params.append(p)
        owners = partition_parameters([p.numel() for p in self._params], self.num_shards)
        self._owner = {id(p): o for p, o in zip(self._params, owners)}
        # Per owner: its parameters in model order, cut into communication buckets.
        self._owned_by: list[list[torch.Tensor]] = [
            [p for p in self._params if self._owner[id(p)] == s] for s in range(self.num_shards)
        ]
        self._bucket_list: list[tuple[int, list[torch.Tensor]]] = [
            (s, bucket)
            for s in range(self.num_shards)
            for bucket in _buckets(self._owned_by[s], self._cap)
        ]
        self._master: dict[int, torch.Tensor] = {}
        if offload:
            self._make_masters()
        for g in optimizer.param_groups:
            g["params"] = [self._state_param(p) for p in g["params"] if self.is_owned(p)]
        self._sync_initial_params()
        logger.debug(
            "sharding stage %d: rank %d of %d owns %d of %d parameters (%d of %d elements)",
            stage,
            self.shard_rank,
            self.num_shards,
            len(self._owned_by[self.shard_rank]),
            len(self._params),
            sum(p.numel() for p in self._owned_by[self.shard_rank]),
            sum(p.numel() for p in self._params),
        )

    # ---- ownership -------------------------------------------------------------------------

    def is_owned(self, p: torch.Tensor) -> bool:
        """True when this rank updates ``p`` and holds its optimizer state."""
        return self._owner[id(p)] == self.shard_rank

    def owner_of(self, p: torch.Tensor) -> int:
        """Index in the sharding group of the rank that owns ``p``."""
        return self._owner[id(p)]

    def all_params(self) -> list[torch.Tensor]:
        """Every parameter the user's optimizer was built with (owned or not), in order."""
        return list(self._params)

    def owned_params(self) -> list[torch.Tensor]:
        """The model parameters this rank owns."""
        return list(self._owned_by[self.shard_rank])

    def _state_param(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizer updates for model parameter ``p`` (its host master
        copy when offloading, else ``p`` itself); ``optimizer.state`` is keyed by it."""
        return self._master.get(id(p), p)

    state_param = _state_param

    # ---- torch.optim.Optimizer surface -------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Reduce gradients (stage 2, or stage 1 when nobody did), update the owned parameters,
        broadcast every parameter from its owner."""
        if closure is not None:
            raise ConfigError(
                "optimizer.step(closure) is not supported with sharding (the closure would run "
                "on one shard); call step() without one",
                key="closure",
            )
        self.reduce_gradients()
        self._grads_reduced = False
        with torch.no_grad():
            if self.offload:
                self._grads_to_masters()
            loss = self._inner.step()
            if self.offload:
                self._masters_to_params()
            self._broadcast_params()
        return loss

    def reduce_gradients(self) -> None:
        """Reduce this step's gradients now (stage 2: to their owners; stage 1 under pipeline
        parallelism: all-reduce over the sharding group), at most once per step.

        :meth:`step` calls it; a loss scaler calls it first (torch's ``ShardedGradScaler``
        order), so it unscales and checks for inf/nan the *reduced* gradients of this rank's
        partition and agrees on the result with every other partition
        (:class:`fleet.meta_optimizers.amp.GradScaler`)."""
        if self._grads_reduced:
            return
        with torch.no_grad():
            if self.stage == 2:
                self._reduce_to_owners()
            elif self.reduce_grads:
                self._all_reduce_grads()
        self._grads_reduced = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter (owned or not)."""
        self._grads_reduced = False
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()
        for m in self._master.values():
            m.grad = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: the partition is fixed when sharding starts."""
        raise ConfigError(
            "add_param_group after fleet.distributed_optimizer is not supported with sharding "
            "(the parameter partition is fixed); add every group before wrapping",
            key="param_group",
        )

    def param_ids(self) -> set[int]:
        """``id()`` of every model parameter (owned or not), for gradient-merge linking."""
        return {id(p) for p in self._params}

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank."""
        return optimizer_state_bytes(self._inner)

    def __repr__(self) -> str:
        return (
            f"ShardedOptimizer(stage={self.stage}, shard {self.shard_rank} of "
            f"{self.num_shards}, offload={self.offload}, {self._inner!r})"
        )

    # ---- communication -----------------------------------------------------------------------

    def _sync_initial_params(self) -> None:
        """Every sharding peer starts from the values of the group's first rank."""
        with torch.no_grad():
            for bucket in _buckets(self._params, self._cap):
                self._broadcast_bucket(bucket, self.group_ranks[0])

    def _broadcast_bucket(self, bucket: list[torch.Tensor], src: int) -> Any:
        flat = _flatten_dense_tensors([p.detach() for p in bucket])
        tdist.broadcast(flat, src=src, group=self.group)
        if tdist.get_rank() != src:
            for p, v in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                p.detach().copy_(v)

    def _broadcast_params(self) -> None:
        pending = []
        for owner, bucket in self._bucket_list:
            src = self.group_ranks[owner]
            in_place = len(bucket) == 1 and bucket[0].is_contiguous()
            if in_place:
                flat = bucket[0].detach()  # one tensor: broadcast it directly, no copies
            elif owner == self.shard_rank:
                flat = _flatten_dense_tensors([p.detach() for p in bucket])
            else:
                flat = torch.empty(
                    sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device
                )
            work = tdist.broadcast(flat, src=src, group=self.group, async_op=True)
            pending.append((owner, bucket, flat, in_place, work))
        for owner, bucket, flat, in_place, work in pending:
            work.wait()
            if owner != self.shard_rank and not in_place:
                torch._foreach_copy_(
                    [p.detach() for p in bucket], _unflatten_dense_tensors(flat, bucket)
                )

    def _grad_presence(self) -> list[bool]:
        """Which parameters have a gradient on at least one sharding peer (one small
        all-reduce), so a parameter unused everywhere keeps ``grad None`` as without sharding."""
        mine = torch.tensor([p.grad is not None for p in self._params], dtype=torch.uint8)
        tdist.all_reduce(mine, op=tdist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in mine.tolist()]

    def _filled_grads(
        self, params: Iterable[torch.Tensor], present: dict[int, bool]
    ) -> list[torch.Tensor]:
        out = []
        for p in params:
            if not present[id(p)]:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p)
        return out

    def _all_reduce_grads(self) -> None:
        """Stage 1 when the model was not wrapped over the sharding axis (pipeline parallel):
        average the gradients over the sharding group."""
        present = dict(zip(map(id, self._params), self._grad_presence()))
        params = self._filled_grads(self._params, present)
        pending = []
        for bucket in _buckets(params, self._cap):
            flat = _flatten_dense_tensors([p.grad for p in bucket])
            pending.append((bucket, flat, tdist.all_reduce(flat, group=self.group, async_op=True)))
        for bucket, flat, work in pending:
            work.wait()
            flat.div_(self.num_shards)
            for p, v in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                p.grad.copy_(v)

    def _reduce_to_owners(self) -> None:
        """Stage 2: sum every bucket of gradients onto its owner; the others drop theirs."""
        present = dict(zip(map(id, self._params), self._grad_presence()))
        pending = []
        for owner, bucket in self._bucket_list:
            params = self._filled_grads(bucket, present)
            if not params:
                continue
            flat = _flatten_dense_tensors([p.grad for p in params])
            dst = self.group_ranks[owner]
            pending.append(
                (owner, params, flat, tdist.reduce(flat, dst=dst, group=self.group, async_op=True))
            )
        for owner, params, flat, work in pending:
            work.wait()
            if owner == self.shard_rank:
                flat.div_(self.num_shards)
                for p, v in zip(params, _unflatten_dense_tensors(flat, params)):
                    p.grad.copy_(v)
            else:
                for p in params:
                    p.grad = None

    # ---- offload -----------------------------------------------------------------------------

    def _make_masters(self) -> None:
        for p in self._owned_by[self.shard_rank]:
            if p.device.type != "cuda":
                raise ConfigError(
                    f"sharding_configs.offload keeps the optimizer state in host memory, but the "
                    f"model is already there (parameter on {p.device}); set "
                    f"strategy.sharding_configs = {{'offload': False}} or move the model to GPU",
                    key="sharding_configs.offload",
                )
            master = p.detach().to("cpu", dtype=torch.float32, copy=True).pin_memory()
            self._master[id(p)] = torch.nn.Parameter(master, requires_grad=p.requires_grad)

    def refresh_masters(self) -> None:
        """Copy the owned parameters into their host master copies (after a checkpoint load
        changed the parameters in place); nothing to do without offload."""
        with torch.no_grad():
            for p in self._owned_by[self.shard_rank]:
                if id(p) in self._master:
                    self._master[id(p)].copy_(p.detach())

    def _grads_to_masters(self) -> None:
        for p in self._owned_by[self.shard_rank]:
            m = self._master[id(p)]
            m.grad = None if p.grad is None else p.grad.to("cpu", dtype=m.dtype)

    def _masters_to_params(self) -> None:
        for p in self._owned_by[self.shard_rank]:
            p.detach().copy_(self._master[id(p)], non_blocking=True)
        torch.cuda.synchronize()


def apply_fsdp(
    model: torch.nn.Module,
    mesh: Any,
    offload: bool,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Stage 3: FSDP2 ``fully_shard`` on every direct child that holds parameters (the modules
    inside a ``ModuleList`` child; see :func:`_shard_units`), then on the root (one all-gather per unit in
    forward, reshard after; the root picks up the rest).

    ``mesh``: 1-D over the sharding group, or 2-D ``(dp, sharding)`` for HSDP (replicate over
    ``dp``, shard over ``sharding``). The parameters may be tensor-parallel shards (fleet's TP
    layers): each rank's TP shard is sharded again over ``mesh``, whose ranks share the model
    coordinate, so the TP layers' own collectives see their whole shard in forward.
    ``param_dtype`` (AMP O2): the float32 shards stay the master weights (partitioned with the
    optimizer state) and are all-gathered as this dtype for compute; gradients are
    reduce-scattered in float32 (torch's ``MixedPrecisionPolicy``).
    ``reshard_after_forward``: False under pipeline parallelism (torchtitan's default there):
    the gathered parameters stay for the step's other micro-batches and are freed after the
    last backward, one all-gather per step instead of one per micro-batch.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    policy: OffloadPolicy = OffloadPolicy()
    if offload:
        if any(p.device.type != "cuda" for p in model.parameters()):
            raise ConfigError(
                "sharding_configs.offload keeps parameters and optimizer state in host memory, "
                "but the model is already there; set strategy.sharding_configs = "
                "{'offload': False} or move the model to GPU",
                key="sharding_configs.offload",
            )
        policy = CPUOffloadPolicy()
    # fully_shard replaces the parameters; keep the tensor-parallel marks (is_distributed,
    # split_axis: global-norm clipping and hybrid checkpoints read them) on the new ones.
    marks = {
        name: {k: p.__dict__[k] for k in _TP_MARKS if k in p.__dict__}
        for name, p in model.named_parameters()
    }
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None
    )
    for child in _shard_units(model):
        fully_shard(
            child,
            mesh=mesh,
            offload_policy=policy,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
        )
    fully_shard(
        model,
        mesh=mesh,
        offload_policy=policy,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
    )
    for name, p in model.named_parameters():
        for k, v in marks.get(name, {}).items():
            setattr(p, k, v)
    return model


_TP_MARKS = ("is_distributed", "split_axis", "fleet_name")


def _shard_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The direct children holding parameters, looking through an ``nn.ModuleList`` (a
    container without a forward, which fully_shard refuses: a GPT's ``layers``) to the modules
    in it. An ``nn.ModuleDict``'s modules stay in the root's unit: they are looked up by key and
    may be used without their forward (a PipelineLayer's ``shared_layers``: the unembedding
    reads the tied embedding's weight), which only the root's all-gather covers."""
    units: list[torch.nn.Module] = []
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            units += _shard_units(child)
        elif isinstance(child, torch.nn.ModuleDict):
            continue
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


__all__ = [
    "ShardedOptimizer",
    "apply_fsdp",
    "optimizer_state_bytes",
    "partition_parameters",
]
