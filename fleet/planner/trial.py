"""Run one candidate configuration for a few steps through the real job path, timing each step
and measuring each rank's memory.

::

    fleetrun --nproc_per_node 4 --backend gloo --strategy CANDIDATE.yaml \\
        -m fleet.planner.trial --spec SPEC.json --steps 5 --warmup 2 --out RESULT.json

The strategy is the job's (``--strategy`` / the job file's ``strategy:``, FLEET_STRATEGY).
Every rank: ``fleet.init(is_collective=True)``; the model function of the spec
(:mod:`fleet.planner.spec`) builds a :class:`~fleet.meta_parallel.PipelineLayer` with the hybrid
topology (stages cut at the repeated block, ``recompute_interval=1`` when ``strategy.recompute``);
then

* ``pp_degree > 1``: ``fleet.distributed_model`` gives the pipeline engine, and a step is
  ``model.train_batch([x, y], fleet.distributed_optimizer(opt))``;
* ``pp_degree == 1``: ``fleet.distributed_model`` wraps DDP / FSDP2 as the strategy says, the
  optimizer goes through ``fleet.distributed_optimizer`` (sharding stage 1/2, gradient merge),
  and a step is ``k_steps`` micro-batches of forward, backward and ``opt.step()`` (one of
  ``micro_batch_size`` samples each).

Each data replica (index ``dp_rank * sharding_degree + sharding_rank``) trains on its share of
one global batch of the spec's sample function. Timing: a barrier, then ``--warmup`` untimed
steps, then ``--steps`` timed ones; a step's time is the slowest rank's. Memory per rank: on
CUDA ``torch.cuda.max_memory_allocated``; on CPU the bytes of the live tensors the rank holds when
the optimizer steps (parameters, gradients, optimizer state, AMP master weights, DDP's gradient
buckets, the pipeline's flat gradient buffer) plus the larger of two peaks: the saved
activations over one more step (:class:`~fleet.meta_parallel.pp_memory.SavedActivationMeter`)
together with the parameters sharding stage 3 has gathered at that moment, and the flat
communication buckets of a stage-1/2 sharded optimizer around its step (activations are gone
by then).

Rank 0 writes ``--out`` and prints the same JSON as its last line: ``step_s``,
``median_step_s``, ``peak_bytes``, ``state_bytes``, ``activation_peak_bytes``,
``gathered_and_activation_peak_bytes``, ``transient_bytes`` (lists over ranks),
``memory_parts`` (per rank), ``loss``, ``strategy`` (the settings that differ from the
defaults, flattened: ``hybrid_configs.mp_degree``). A strategy fleet refuses exits non-zero with
the error's message.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as tdist

from collective.errors import ConfigError, FleetError
from fleet.base.runtime import get_runtime, init_runtime
from fleet.base.topology import HybridCommunicateGroup, build_topology
from fleet.meta_optimizers.amp import MasterWeightOptimizer
from fleet.meta_optimizers.sharding import ShardedOptimizer
from fleet.meta_parallel import PipelineLayer
from fleet.meta_parallel.pp_memory import SavedActivationMeter
from fleet.parallelize.model import distributed_model
from fleet.parallelize.optimizer import distributed_optimizer
from fleet.planner.auto import apply_to_runtime
from fleet.planner.spec import build_model, make_optimizer, sample_batch
from fleet.planner.types import ModelSpec


def replica(hcg: Any) -> tuple[int, int]:
    """``(index, count)`` of this rank among the data replicas (dp x sharding)."""
    sh = hcg.get_sharding_parallel_world_size()
    return (
        hcg.get_data_parallel_rank() * sh + hcg.get_sharding_parallel_rank(),
        hcg.get_data_parallel_world_size() * sh,
    )


def _nbytes(t: Any) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def _find_inner(opt: Any, cls: type) -> Any:
    """The first optimizer of class ``cls`` down the chain of fleet's wrappers (or None)."""
    seen: set[int] = set()
    while opt is not None and id(opt) not in seen:
        if isinstance(opt, cls):
            return opt
        seen.add(id(opt))
        nxt = None
        for attr in ("_inner", "inner_optimizer", "optimizer"):
            nxt = opt.__dict__.get(attr)
            if nxt is not None:
                break
        opt = nxt
    return None


def _ddp_bucket_bytes(model: Any) -> int:
    """Bytes of DDP's gradient buckets (the reducer copies the gradients into flat buckets
    unless ``gradient_as_bucket_view``): the gradient bytes of the parameters it reduces."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return 0
    if getattr(model, "gradient_as_bucket_view", False):
        return 0
    return sum(_nbytes(p) for p in model.module.parameters() if p.requires_grad)


class MemoryProbe:
    """The live bytes of what a rank holds when its optimizer steps (gradients still there),
    by part; registered as a step pre-hook of the innermost torch optimizer."""

    def __init__(self, params: list[torch.Tensor], opt: Any, model: Any, flat_buffer: bool):
        self.params, self.opt, self.model, self.flat_buffer = params, opt, model, flat_buffer
        self.parts: dict[str, int] = {}
        self.transient = 0

    def __call__(self, *_: Any) -> None:
        params = sum(_nbytes(p) for p in self.params)
        grads = sum(_nbytes(p.grad) for p in self.params)
        masters = 0
        mw = _find_inner(self.opt, MasterWeightOptimizer)
        if mw is not None:
            masters = sum(_nbytes(m) for m in mw._masters.values())
        state = 0
        for st in _innermost(self.opt).state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    state += _nbytes(v)
        buffers = _ddp_bucket_bytes(self.model)
        if self.flat_buffer:  # the pipeline's flat all-reduce of the stage's gradients
            buffers += sum(_nbytes(p) for p in self.params if p.requires_grad)
        self.parts = {
            "params": params,
            "grads": grads,
            "optimizer": state + masters,
            "buffers": buffers,
        }
        self.transient = sharding_transient_bytes(self.opt, grads)


def sharding_transient_bytes(opt: Any, grads_at_step: int) -> int:
    """Bytes the sharded optimizer's flat communication buckets add around its step (one
    phase at a time: the gradient reduce before it, every gradient still there; the parameter
    broadcast after it); 0 without one. A bucket of one contiguous tensor is sent in place."""
    sh = _find_inner(opt, ShardedOptimizer)
    if sh is None:
        return 0
    flat = sum(
        sum(_nbytes(p) for p in bucket)
        for _, bucket in sh._bucket_list
        if len(bucket) > 1 or not bucket[0].is_contiguous()
    )
    reduce = 0
    if sh.stage == 2 or sh.reduce_grads:
        full = sum(_nbytes(p) for p in sh._params if p.requires_grad)
        reduce = flat + max(0, full - grads_at_step)
    return max(flat, reduce)


class ActivationMeter(SavedActivationMeter):
    """Saved activations of one step, without the parameters FSDP2 gathers for the layers
    (sharding stage 3 swaps the full tensors in while a unit runs): those, and the unsharded
    gradients accumulating on them between micro-batches, are tracked apart as ``gathered``,
    and :attr:`combined_peak` is the peak of activations + gathered parameters and gradients."""

    def __init__(self, module: torch.nn.Module) -> None:
        params = list(module.parameters())
        self._fsdp = any(hasattr(p, "to_local") for p in params)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        super().__init__(local)
        self._module = module
        self._base = set(self._param_storages)
        self.combined_peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        gathered = 0
        if self._fsdp:  # the unsharded parameters swapped in right now
            unsharded = [p for p in self._module.parameters() if not hasattr(p, "to_local")]
            full = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in unsharded}
            self._param_storages = self._base | set(full)
            # and the unsharded gradients earlier micro-batches left on them (the gradient
            # is reduce-scattered only after the step's last backward)
            grads = {
                p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in unsharded
                if p.grad is not None
            }
            gathered = sum(full.values()) + sum(grads.values())
        out = super()._pack(t)
        self.combined_peak = max(self.combined_peak, self.live_bytes + gathered)
        return out


def _innermost(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer that actually updates (under fleet's delegating wrappers)."""
    inner = opt
    while True:
        nxt = None
        for attr in ("_inner", "inner_optimizer"):
            cand = inner.__dict__.get(attr)
            if isinstance(cand, torch.optim.Optimizer):
                nxt = cand
                break
        if nxt is None:
            return inner
        inner = nxt


class Trial:
    """One candidate's model, optimizer and step function on this rank."""

    def __init__(self, spec: ModelSpec) -> None:
        runtime = get_runtime("planner trial")
        self.strategy = strategy = runtime.strategy
        world = tdist.get_world_size()
        # pure data parallel gets no hybrid groups from fleet.init; the PipelineLayer and the
        # tensor-parallel layers need the (trivial) topology and a model-parallel group
        self.hcg = hcg = runtime.hcg or HybridCommunicateGroup(
            build_topology(strategy.hybrid_configs, world)
        )
        self.pp = hcg.get_pipe_parallel_world_size()
        pc = strategy.pipeline_configs
        self.micro_batch_size = pc.micro_batch_size
        if self.pp > 1:
            self.micro_steps = 1
            self.accumulate = pc.accumulate_steps
        else:
            gm = strategy.gradient_merge_configs
            self.micro_steps = gm.k_steps if strategy.gradient_merge else 1
            self.accumulate = self.micro_steps
        idx, count = replica(hcg)
        local = self.micro_batch_size * self.accumulate
        if local * count != spec.global_batch_size:
            raise ConfigError(
                f"micro_batch_size {self.micro_batch_size} x {self.accumulate} micro-batches x "
                f"{count} data replicas = {local * count} samples, but the global batch is "
                f"{spec.global_batch_size}; make them agree",
                key="pipeline_configs.micro_batch_size",
            )
        mp_group = hcg.get_model_parallel_group()
        torch.manual_seed(1234)  # the same on every rank: TP shards and replicas start alike
        built = build_model(spec, mp_group, hcg)
        if self.pp > 1 and not built.layer_list:
            raise ConfigError(
                f"pp_degree={self.pp} needs a layer list, but {spec.model} returned one "
                "nn.Module; set pp_degree to 1",
                key="hybrid_configs.pp_degree",
            )
        # stages are cut at the repeated block (a plain nn.Module is one entry: uniform)
        block = built.block_class if built.layer_list else None
        seg = f"layer:^{block}$" if block else "uniform"
        self.pipe = PipelineLayer(
            built.entries,
            topology=hcg.topology(),
            loss_fn=built.loss_fn,
            seg_method=seg,
            # strategy.recompute without named checkpoints: fleet.distributed_model makes it
            # every entry (recompute_interval 1), as a job running the planned strategy gets
        )
        self.loss_fn = built.loss_fn
        device = _device(runtime)
        if device.type == "cuda":  # the model must be on its device before it is wrapped
            self.pipe.to(device)
        self.model = distributed_model(self.pipe)
        params = [p for p in self.pipe.parameters()]
        opt = make_optimizer(spec.optimizer, params, spec.lr)
        self.opt = distributed_optimizer(opt)
        x, y = sample_batch(spec, spec.global_batch_size)
        self.x, self.y = x[idx * local : (idx + 1) * local], y[idx * local : (idx + 1) * local]
        if device.type == "cuda":
            self.x, self.y = self.x.to(device), self.y.to(device)
        flat = self.pp > 1 and hcg.get_data_parallel_world_size() > 1 and not _stage3(strategy)
        self.probe = MemoryProbe(params, self.opt, self.model, flat)
        _innermost(self.opt).register_step_pre_hook(self.probe)

    def step(self) -> float:
        """One optimizer step over this replica's share of the global batch; its loss."""
        if self.pp > 1:
            return float(self.model.train_batch([self.x, self.y], self.opt))
        b = self.micro_batch_size
        total = 0.0
        for i in range(self.micro_steps):
            xs, ys = self.x[i * b : (i + 1) * b], self.y[i * b : (i + 1) * b]
            loss = self.loss_fn(self.model(xs), ys)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            total += float(loss.detach())
        return total / self.micro_steps


def _stage3(strategy: Any) -> bool:
    return bool(strategy.sharding) and strategy.sharding_configs.stage == 3


def _device(runtime: Any) -> torch.device:
    if torch.cuda.is_available() and tdist.get_backend() == "nccl":
        return torch.device("cuda", runtime.env.local_rank)
    return torch.device("cpu")


def run(spec: ModelSpec, steps: int, warmup: int) -> dict[str, Any] | None:
    """The trial on this rank (collective); the result on rank 0, None elsewhere."""
    # fleet.init of a collective job (the trial has no PS roles): the runtime, then the plan
    # when the job's strategy says auto
    runtime = init_runtime(True, None, None)
    if runtime.strategy.auto:
        apply_to_runtime(runtime)
    runtime = get_runtime("planner trial")
    strategy_dict = runtime.strategy.non_default_settings()
    cuda = _device(runtime).type == "cuda"
    if cuda:
        torch.cuda.set_device(_device(runtime))
    trial = Trial(spec)
    losses: list[float] = []
    for _ in range(warmup):
        losses.append(trial.step())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tdist.barrier()
    times: list[float] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(trial.step())
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    cuda_peak = torch.cuda.max_memory_allocated() if cuda else 0
    # one more step under the saved-activation meter (its hooks would slow the timed steps)
    with ActivationMeter(trial.pipe) as meter:
        losses.append(trial.step())
    parts = dict(trial.probe.parts)
    state = sum(parts.values())
    mine = {
        "times": times,
        "state": state,
        "act": int(meter.peak_bytes),
        "combined": int(meter.combined_peak),
        "transient": int(trial.probe.transient),
        "parts": parts,
        "cuda_peak": int(cuda_peak),
    }
    gathered: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, mine)
    if tdist.get_rank() != 0:
        return None
    step_s = [max(r["times"][i] for r in gathered) for i in range(steps)]
    # the flat buckets of a sharded optimizer live after backward, when activations are gone
    peak = [
        r["cuda_peak"] if cuda else r["state"] + max(r["combined"], r["transient"])
        for r in gathered
    ]
    return {
        "step_s": step_s,
        "median_step_s": statistics.median(step_s) if step_s else math.nan,
        "min_step_s": min(step_s) if step_s else math.nan,
        "max_step_s": max(step_s) if step_s else math.nan,
        "peak_bytes": peak,
        "state_bytes": [r["state"] for r in gathered],
        "activation_peak_bytes": [r["act"] for r in gathered],
        "gathered_and_activation_peak_bytes": [r["combined"] for r in gathered],
        "transient_bytes": [r["transient"] for r in gathered],
        "memory_parts": [r["parts"] for r in gathered],
        "device": "cuda" if cuda else "cpu",
        "world_size": tdist.get_world_size(),
        "warmup": warmup,
        "strategy": strategy_dict,
        "loss": losses,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m fleet.planner.trial --spec SPEC.json --steps N --warmup W --out RESULT.json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="ModelSpec JSON (ModelSpec.to_dict())")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--out", default=None, help="result JSON, written by rank 0")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        print("error: --steps must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    try:
        with open(args.spec, encoding="utf-8") as f:
            spec = ModelSpec.from_dict(json.load(f))
        result = run(spec, args.steps, args.warmup)
    except (ConfigError, FleetError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    if result is not None:
        text = json.dumps(result)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text)
        print(text, flush=True)
    # tear the process group down before interpreter exit (gloo + FSDP2 at exit)
    if tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
