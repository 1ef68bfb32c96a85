"""The planner's cost model: :func:`estimate` predicts one candidate's step time and the peak
memory of its fullest rank from a :class:`~fleet.planner.types.Calibration`. Plain Python.

The model follows what fleet's own wrappers do (:mod:`fleet.parallelize.compose`), not a
textbook ZeRO/Megatron figure. Assumptions, one per line of reasoning:

Layout
    Ranks are Paddle's grid ``[data, pipe, sharding, model]``, model fastest
    (:mod:`fleet.base.topology`); rank ``r`` lives on node ``r // nproc_per_node``. A group
    "spans nodes" when any of its groups (they all run at once) holds ranks of two nodes, and
    is then costed with the ``inter`` link fits. Tensor-parallel groups are consecutive ranks in
    calibration and in the job alike, so their communication, node-spanning or not, is inside
    the measured layer times.

Stages
    Cut as ``PipelineLayer(seg_method="layer:<block_class>")`` does (:func:`stage_bounds`
    reproduces :func:`fleet.meta_parallel.pipeline_layer.segment_layers`). A stage holding
    several entries of one ``shared_key`` stores that module once. The fullest rank is the
    stage with the largest predicted peak; every data/sharding replica of a stage is alike
    (sharding partitions are taken as exactly ``1/N`` of the stage).

Memory (bytes on one rank = params + grads + optimizer + buffers + activations)
    What a rank holds when its optimizer steps, plus the peak of its saved activations (the
    quantity the trial measures on CPU; an upper bound of the true peak, since gradients grow
    as the activations are freed), and what coexists with the activations beyond that.
    ``param_bytes`` are the parameters as the job holds them (profiled in float32, or in the
    16-bit dtype under AMP O2); tensor-parallel bytes are divided by mp. Gradients have the
    parameters' dtype. AMP O2 adds float32 masters (``1 / AMP_O2_PARAM_RATIO`` x the 16-bit
    bytes) for the parameters this rank updates (counted under ``optimizer``); O0/O1 keep
    float32 parameters, their own masters. Optimizer state is
    ``OPTIMIZER_STATE[optimizer]`` x the float32 bytes this rank updates. Stage 3 under O2
    keeps the model in float32 (the shards are the masters) and gathers 16-bit copies.
    Stage 1: state (and O2 masters) / sharding; DDP still holds every gradient. Stage 2: our
    ShardedOptimizer reduces gradients to their owners inside ``step()``, so at the update a
    rank holds 1/N of them; with several micro-batches (gradient merge, or a pipeline) the
    whole gradient accumulates while the later micro-batches' activations are alive, so it
    counts in full (always with :data:`STAGE2_PEAK_FULL_GRADS`); while ``step()`` reduces, the
    gradients it is about to drop are still there, next to the buckets (the transient below). Stage 3 (FSDP2): float32
    shards of params/grads/state / sharding; without a pipeline every unit reshards after
    forward, so the root unit (the shared layers) and :data:`FSDP_GATHERED_UNITS` of the
    largest entry are gathered at once; under a pipeline the stage's parameters stay gathered
    for the whole step (``reshard_after_forward=False``). Micro-batching with stage 3
    accumulates unsharded gradients: a full gradient on top of the shards. Gradient merge
    itself accumulates into ``.grad`` (no extra buffer). DDP (pp 1, stage < 3, a gradient
    group of > 1 rank) keeps buckets the size of the gradients (no
    ``gradient_as_bucket_view``). PipelineParallel's flat gradient all-reduce over dp (stage
    < 3, dp > 1) holds a second copy of the stage's gradients next to them. ShardedOptimizer's
    reduce / all-reduce / broadcast buckets come after backward, when the activations are
    gone: they count only where they exceed the activations (``buffers``).
    Activations: the stage's ``act_bytes`` at mp and micro-batch size ``b``, times the
    micro-batches in flight (1F1B: ``min(m, pp - stage)``; FThenB: ``m``; no pipeline: 1).
    With recompute (every entry checkpointed, ``recompute_interval=1``) each in-flight
    micro-batch keeps only every entry's input (the previous entry's ``out_bytes``; the
    sample's bytes for entry 0), plus one entry's full activations while it is recomputed.

Time (seconds per optimizer step = one global batch)
    The layer times were measured with all of the job's ranks computing at once, so they hold
    the contention for the machine: nothing is divided by cores again. Per stage and
    micro-batch ``t_s`` = forward + backward of its entries (+ forward again with recompute).
    No pipeline: ``m * t``. 1F1B and FThenB: ``(m + pp - 1) * max_s t_s`` (the bubble is the
    ``pp - 1`` extra slots), plus the point-to-point messages on the critical path: a
    ``send_recv`` of the widest cut's ``out_bytes`` forward and one back over each of the
    ``pp - 1`` cuts (fill and drain), and one pair per further micro-batch (the steady state,
    :data:`P2P_OVERLAP` of it hidden). On CPU, when a node has more ranks
    than cores (contention ``k = ranks / cores > 1``), a rank idle in the bubble frees its
    core and the busy ranks run faster (:data:`CPU_BUBBLE_REUSE`): by the speedup ``u``
    calibration measured for one model-parallel group running while the others idle
    (``ModelProfile.idle_speedup``; ``k`` where it was not measured; tensor-parallel ranks gain
    more than ``k``, as their collectives stop waiting for descheduled peers): the schedule is
    played out task by task (:mod:`fleet.planner.pipeline_sim`), each stage at its alone speed
    while the computing ranks fit the cores and at the crowded figures when every stage
    computes, messages included (:func:`_crowded_pipeline`).
    Gradient reduction: no pipeline and stage 0/1: DDP's all-reduce over the gradient group
    (dp, or dp x sharding for stage 1) overlaps :data:`DDP_OVERLAP` of the last micro-batch's
    backward (:data:`CROWDED_CPU_OVERLAP` on a CPU node with more ranks than cores, for this
    and FSDP2's overlap); stage 2: DDP over dp, then reduce-to-owner over sharding at ``step()``;
    pipeline: one flat all-reduce over dp after the last micro-batch (not overlapped), then
    stage 1 all-reduces and stage 2 reduces over sharding in ``step()``. Stages 1/2 broadcast
    every updated parameter from its owner (buckets of :data:`SHARDING_SEGMENT_BYTES`).
    Stage 3: FSDP2 all-gathers every unit in forward and in backward of every micro-batch (a
    pipeline: once per step) and reduce-scatters once per step (HSDP: then an all-reduce of
    the shard over dp); :data:`FSDP_OVERLAP` of the compute hides the gathers. What FSDP2 costs
    beyond the bytes (per unit and round: latency, hooks, copies, on a crowded CPU the waits for
    the slowest rank; per parameter tensor: the optimizer's DTensor dispatch) is the
    calibration's probe of that mesh shape (``ClusterProfile.fsdp``), not hidden by compute;
    without a probe the fits' latency stands for it. A tied weight
    held by several stages is all-reduced over them. Optimizer step:
    ``optimizer_step_s_per_byte`` x the float32 bytes this rank updates. The reduction after
    the pipeline is costed for every stage and the slowest counts.
    Collective payloads follow the calibration: ``all_gather`` the shard each rank gives,
    ``reduce_scatter`` / ``all_reduce`` / ``broadcast`` the whole buffer, ``send_recv`` the
    message; stage 2's reduce-to-owner (``tdist.reduce`` of each owner's buckets) is costed as
    an all-reduce of the buffer: a reduce is a reduce-scatter and a gather to its root, so the
    owners' reduces together move what one all-reduce (a reduce-scatter and an all-gather) does.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from fleet.planner.pipeline_sim import simulate
from fleet.planner.types import (
    OPTIMIZER_STATE,
    Calibration,
    Candidate,
    Estimate,
    LayerProfile,
    Linear,
    LinkFit,
    ModelProfile,
)

# ---- tunable constants (trial runs calibrate them) ----------------------------------------

DDP_OVERLAP = 0.5
"""Fraction of the last micro-batch's backward that hides DDP's bucketed all-reduce."""
FSDP_OVERLAP = 0.5
"""Fraction of the compute that hides FSDP2's all-gathers (and of the last backward that
hides its reduce-scatter)."""
P2P_OVERLAP = 0.0
"""Fraction of the steady-state point-to-point messages hidden behind compute (receives are
posted ahead, but gloo moves the bytes on the CPU the stage computes with)."""
CROWDED_CPU_OVERLAP = 0.0
"""The overlap factors on CPU when a node has more ranks than cores: a communication thread
finds no free core to run beside the compute, so (by default) nothing hides."""
CPU_BUBBLE_REUSE = True
"""On CPU, a rank idle in the pipeline bubble gives its core to the busy ones (see above)."""
STAGE2_PEAK_FULL_GRADS = False
"""Stage 2 reduces gradients inside ``step()``: after the update a rank holds 1/N of them;
while it reduces them to their owners it still holds every one next to the flat buckets that
carry them, which the transient part counts (after backward, when the activations are gone).
True counts the full gradient at the update as well."""
FSDP_GATHERED_UNITS = 1
"""FSDP2 units (besides the root) held gathered at once without a pipeline."""
AMP_O2_PARAM_RATIO = 0.5
"""Bytes of an O2 (16-bit) parameter or gradient per float32 byte."""
SHARDING_SEGMENT_BYTES = 32 * 2**20
"""ShardedOptimizer's bucket (``sharding_configs.segment_broadcast_MB`` default)."""
DDP_BUCKET_BYTES = 32 * 2**20
"""DDP's bucket (``fuse_grad_size_in_MB`` default): one all-reduce call each."""
REDUCE_LINK = "all_reduce"
"""The calibrated collective stage 2's reduce-to-owner of the whole buffer is costed as (see the
module docstring)."""

LAYOUT_AXES = ("data", "pipe", "sharding", "model")
"""The hybrid grid's axes, outermost first (model fastest), as :mod:`fleet.base.topology`."""


class CostModelError(KeyError):
    """The calibration lacks a figure the candidate needs (a link fit, a timing at an mp)."""


# ---- layout ---------------------------------------------------------------------------------


def _rank(c: Candidate, data: int, pipe: int, shard: int, model: int) -> int:
    return ((data * c.pp + pipe) * c.sharding + shard) * c.mp + model


def group_spans(c: Candidate, nproc_per_node: int) -> dict[str, bool]:
    """Whether the groups of each axis span nodes: ``data``, ``pipe``, ``sharding``,
    ``model`` and ``dp_sharding`` (the ranks holding the same model shard: dp x sharding)."""
    return dict(_spans(c.dp, c.mp, c.pp, c.sharding, nproc_per_node))


@functools.lru_cache(maxsize=1024)
def _spans(dp: int, mp: int, pp: int, sh: int, nproc: int) -> tuple[tuple[str, bool], ...]:
    c = Candidate(dp, mp, pp, sh, 0, 1, 1, False)
    dims = {"data": c.dp, "pipe": c.pp, "sharding": c.sharding, "model": c.mp}
    names = list(LAYOUT_AXES)
    out: dict[str, bool] = {}
    for label, axes in [(a, (a,)) for a in names] + [("dp_sharding", ("data", "sharding"))]:
        spans = False
        fixed = [a for a in names if a not in axes]
        for base in _product([dims[a] for a in fixed]):
            coord = dict(zip(fixed, base))
            nodes = set()
            for free in _product([dims[a] for a in axes]):
                coord.update(zip(axes, free))
                r = _rank(c, coord["data"], coord["pipe"], coord["sharding"], coord["model"])
                nodes.add(r // max(1, nproc))
            if len(nodes) > 1:
                spans = True
                break
        out[label] = spans
    return tuple(out.items())


def _product(dims: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for d in dims:
        out = [t + (i,) for t in out for i in range(d)]
    return out


# ---- stages ---------------------------------------------------------------------------------


def stage_bounds(model: ModelProfile, pp: int) -> list[int]:
    """``pp + 1`` entry indices, stage ``s`` runs ``[b[s], b[s+1])``: the cut of
    ``segment_layers(entries, pp, "layer:<block_class>")``. ValueError when it cannot cut."""
    n = len(model.layers)
    if pp == 1:
        return [0, n]
    if n < pp:
        raise ValueError(f"{n} layer(s) cannot fill {pp} pipeline stages")
    if not model.block_class:
        raise ValueError("the model has no repeated block class to cut stages at")
    regex = re.compile(model.block_class, re.IGNORECASE)
    hits = [i for i, layer in enumerate(model.layers) if regex.search(layer.name)]
    if len(hits) < pp:
        raise ValueError(
            f"seg_method 'layer:{model.block_class}' matches {len(hits)} layer(s), fewer than "
            f"{pp} stages"
        )
    return [0, *(hits[s * len(hits) // pp] for s in range(1, pp)), n]


def _at(table: dict[int, Linear], mp: int, what: str, layer: LayerProfile) -> Linear:
    fit = table.get(mp)
    if fit is None:
        raise CostModelError(
            f"calibration has no {what} of layer {layer.index} ({layer.name}) at mp={mp} "
            f"(profiled: {sorted(table)})"
        )
    return fit


def _param_bytes(layer: LayerProfile, mp: int) -> float:
    return (layer.param_bytes - layer.tp_param_bytes) + layer.tp_param_bytes / mp


def _unique(entries: list[LayerProfile]) -> list[LayerProfile]:
    """The entries whose parameters this stage stores (a shared key once)."""
    seen: set[str] = set()
    out = []
    for e in entries:
        if e.shared_key is not None:
            if e.shared_key in seen:
                continue
            seen.add(e.shared_key)
        out.append(e)
    return out


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage's figures for one candidate (per rank of that stage)."""

    index: int
    entries: tuple[LayerProfile, ...]
    param_bytes: float
    """float32 bytes of the parameters the stage stores, at mp."""
    t_compute: float
    """Forward + backward of one micro-batch."""
    t_recompute: float
    """The extra forward of one micro-batch under recompute."""
    t_bwd: float
    memory: dict[str, float]
    post_s: dict[str, float]
    """After-backward parts: dp_comm, sharding_comm, optimizer (and pp==1 stage 3 gathers)."""

    @property
    def t(self) -> float:
        return self.t_compute + self.t_recompute

    @property
    def peak(self) -> float:
        return sum(self.memory.values())


# ---- links ----------------------------------------------------------------------------------


def _fit(cal: Calibration, op: str, size: int, spans: bool) -> LinkFit:
    try:
        return cal.cluster.link(op, size, spans)
    except KeyError as exc:
        raise CostModelError(
            f"calibration has no fit of {op} (group of {size}); recalibrate the cluster"
        ) from exc


def _coll(fit: LinkFit, total_bytes: float, calls: int) -> float:
    """``calls`` collectives carrying ``total_bytes`` between them."""
    return calls * fit.alpha_s + fit.beta_s_per_byte * max(0.0, total_bytes)


def _calls(nbytes: float, bucket: int, at_least: int = 1) -> int:
    return max(at_least, math.ceil(nbytes / bucket)) if nbytes > 0 else 0


# ---- the estimate ---------------------------------------------------------------------------


def _f32(amp: str) -> float:
    """float32 bytes per profiled parameter byte (O2 profiles 16-bit parameters)."""
    return 1.0 / AMP_O2_PARAM_RATIO if amp.upper() == "O2" else 1.0


def _stage_cost(
    c: Candidate,
    cal: Calibration,
    s: int,
    entries: list[LayerProfile],
    spans: dict[str, bool],
) -> StageCost:
    model, mp, b, m = cal.model, c.mp, c.micro_batch_size, c.accumulate_steps
    crowded = _crowding(cal) > 1
    fwd = sum(_at(e.fwd_s, mp, "forward time", e).at(b) for e in entries)
    bwd = sum(_at(e.bwd_s, mp, "backward time", e).at(b) for e in entries)
    rc = fwd if c.recompute else 0.0
    held = _unique(entries)
    P = sum(_param_bytes(e, mp) for e in held)
    f = _f32(model.amp)  # masters, state and stage-3 shards are float32
    master = f if model.amp.upper() == "O2" else 0.0
    S = c.sharding if c.stage else 1
    k_state = OPTIMIZER_STATE.get(model.optimizer.lower(), 2.0)

    # -- memory --
    if c.stage < 3:
        params = P
        full = c.stage < 2 or m > 1 or STAGE2_PEAK_FULL_GRADS
        grads = P if full else P / S
        optimizer = (k_state * f + master) * P / S
    else:
        if c.pp == 1:
            units = [_param_bytes(e, mp) for e in held if e.shared_key is None]
            root = sum(_param_bytes(e, mp) for e in held if e.shared_key is not None)
            biggest = sorted(units, reverse=True)[:FSDP_GATHERED_UNITS]
            gathered = root + sum(biggest)
        else:
            gathered = P
        params = f * P / S + gathered
        grads = f * P / S + (P if m > 1 else 0.0)
        optimizer = k_state * f * P / S
    ddp = _ddp_group(c)
    buffers = P if ddp else 0.0
    if c.pp > 1 and c.dp > 1 and c.stage < 3:
        buffers += P  # PipelineParallel's flat gradient all-reduce over dp
    # reduce / all-reduce / broadcast buckets; stage 2 reduces while every gradient is still
    # there, so the gradients it will drop count with its buckets
    transient = P + (P - grads if c.stage == 2 else 0.0) if c.stage in (1, 2) else 0.0
    inflight = 1
    if c.pp > 1:
        inflight = m if c.schedule == "FThenB" else min(m, c.pp - s)
    acts = [_at(e.act_bytes, mp, "activation bytes", e).at(b) for e in entries]
    if c.recompute:
        inputs = 0.0
        for e in entries:
            prev = e.index - 1
            inputs += model.layers[prev].out_bytes.at(b) if prev >= 0 else model.input_bytes.at(b)
        activations = inputs * inflight + (max(acts) if acts else 0.0)
    else:
        activations = sum(acts) * inflight
    memory = {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "activations": activations,
        "buffers": buffers + max(0.0, transient - activations),
    }

    # -- after-backward time --
    post = {"dp_comm": 0.0, "sharding_comm": 0.0, "optimizer": 0.0}
    if c.stage == 3:
        post["sharding_comm"] = _fsdp_time(c, cal, spans, held, P, fwd + bwd + rc, bwd + rc)
    else:
        if c.pp == 1 and ddp > 1:
            fit = _fit(cal, "all_reduce", ddp, spans["dp_sharding" if c.stage == 1 else "data"])
            comm = _coll(fit, P, _calls(P, DDP_BUCKET_BYTES))
            overlap = CROWDED_CPU_OVERLAP if crowded else DDP_OVERLAP
            post["dp_comm"] = max(0.0, comm - overlap * (bwd + rc))
        elif c.pp > 1 and c.dp > 1:
            fit = _fit(cal, "all_reduce", c.dp, spans["data"])
            post["dp_comm"] = _coll(fit, P, 1)
        if c.stage in (1, 2):
            post["sharding_comm"] = _sharding_time(c, cal, spans, P)
    post["optimizer"] = model.optimizer_step_s_per_byte * f * P / S
    if c.stage == 3:
        post["optimizer"] += _fsdp_step_time(c, cal, held)
    return StageCost(s, tuple(entries), P, fwd + bwd, rc, bwd + rc, memory, post)


def _ddp_group(c: Candidate) -> int:
    """Ranks of the DDP gradient group (0: no DDP): pp 1 and stage < 3 only."""
    if c.pp > 1 or c.stage == 3:
        return 0
    if c.dp * c.mp * c.sharding == 1:
        return 1  # world of one: DDP still wraps (no topology), nothing to reduce
    size = c.dp * c.sharding if c.stage == 1 else c.dp
    return size if size > 1 else 0


def _sharding_time(c: Candidate, cal: Calibration, spans: dict[str, bool], P: float) -> float:
    """ShardedOptimizer.step's communication over the sharding group (stages 1/2)."""
    S, sp = c.sharding, spans["sharding"]
    per_owner = _calls(P / S, SHARDING_SEGMENT_BYTES)
    t = 0.0
    presence = _fit(cal, "all_reduce", S, sp).alpha_s  # which gradients exist (tiny)
    if c.stage == 2:
        t += presence + _coll(_fit(cal, REDUCE_LINK, S, sp), P, S * per_owner)
    elif c.pp > 1:  # stage 1 under a pipeline: the model was not wrapped over sharding
        t += presence + _coll(_fit(cal, "all_reduce", S, sp), P, _calls(P, SHARDING_SEGMENT_BYTES))
    return t + _coll(_fit(cal, "broadcast", S, sp), P, S * per_owner)


def _fsdp_time(
    c: Candidate,
    cal: Calibration,
    spans: dict[str, bool],
    held: list[LayerProfile],
    P: float,
    compute_per_mb: float,
    bwd_last: float,
) -> float:
    """FSDP2's exposed communication per step (stage 3)."""
    S, m = c.sharding, c.accumulate_steps
    f = _f32(cal.model.amp)
    overlap = CROWDED_CPU_OVERLAP if _crowding(cal) > 1 else FSDP_OVERLAP
    units = sum(1 for e in held if e.shared_key is None and e.param_bytes > 0)
    units += 1 if any(e.shared_key is not None for e in held) else 0
    units = max(1, units)
    ag = _fit(cal, "all_gather", S, spans["sharding"])
    rs = _fit(cal, "reduce_scatter", S, spans["sharding"])
    dp = _fit(cal, "all_reduce", c.dp, spans["data"]) if c.dp > 1 else None
    probe = cal.cluster.fsdp_overhead(c.dp, S)
    rounds = m if c.pp == 1 else 1  # a pipeline keeps the gathered parameters for the step
    if probe is None:
        gather_once = _coll(ag, P / S, units)  # cast to the compute dtype before the gather
        scatter = _coll(rs, f * P, units)  # reduced in float32 under O2
        hsdp = _coll(dp, f * P / S, 1) if dp else 0.0
        fixed = 0.0
    else:
        # the probe's figures hold every per-unit cost (latency, hooks, copies, the waits on
        # a crowded CPU): only the bytes are left to the link fits
        gather_once = ag.beta_s_per_byte * P / S
        scatter = rs.beta_s_per_byte * f * P
        hsdp = dp.beta_s_per_byte * f * P / S if dp else 0.0
        fixed = rounds * units * (probe.unit_forward_s + probe.unit_backward_s)
    if c.pp == 1:
        gathers = 2 * m * gather_once  # forward and backward of every micro-batch
        exposed = max(0.0, gathers - overlap * m * compute_per_mb)
    else:
        exposed = gather_once  # once per step, before the first forward
    return fixed + exposed + max(0.0, scatter - overlap * bwd_last) + hsdp


def _fsdp_step_time(c: Candidate, cal: Calibration, held: list[LayerProfile]) -> float:
    """The optimizer's per-parameter cost over FSDP2's DTensor parameters (stage 3)."""
    probe = cal.cluster.fsdp_overhead(c.dp, c.sharding)
    if probe is None:
        return 0.0
    return probe.param_step_s * sum(e.param_count for e in held)


def _crowding(cal: Calibration) -> float:
    """Ranks per core of a CPU node (1.0 on accelerators or with enough cores)."""
    cl = cal.cluster
    if cl.device != "cpu" or not cl.cores_per_node:
        return 1.0
    return max(1.0, cl.nproc_per_node / cl.cores_per_node)


def stage_costs(
    c: Candidate, cal: Calibration, spans: dict[str, bool] | None = None
) -> list[StageCost]:
    """Every pipeline stage's figures (one stage without a pipeline)."""
    bounds = stage_bounds(cal.model, c.pp)
    spans = spans or group_spans(c, cal.cluster.nproc_per_node)
    layers = list(cal.model.layers)
    return [_stage_cost(c, cal, s, layers[bounds[s] : bounds[s + 1]], spans) for s in range(c.pp)]


def estimate(c: Candidate, cal: Calibration) -> Estimate:
    """Predicted seconds per step and peak bytes of the fullest rank (module docstring)."""
    spans = group_spans(c, cal.cluster.nproc_per_node)
    stages = stage_costs(c, cal, spans)
    m, pp, b = c.accumulate_steps, c.pp, c.micro_batch_size
    slow = max(stages, key=lambda st: st.t)
    T = slow.t
    parts = dict.fromkeys(
        ("compute", "recompute", "bubble", "pp_comm", "dp_comm", "sharding_comm", "optimizer"),
        0.0,
    )
    if pp == 1:
        section = m * T
    else:
        section = (m + pp - 1) * T
        bounds = stage_bounds(cal.model, pp)
        link = _fit(cal, "send_recv", 2, spans["pipe"])
        cut = max(cal.model.layers[bounds[s] - 1].out_bytes.at(b) for s in range(1, pp))
        hop = link.time(cut)
        # fill and drain: an activation forward and a gradient back over every cut; in the
        # steady state, one of each per further micro-batch at the bottleneck (receives are
        # posted ahead: P2P_OVERLAP of them hide behind compute)
        parts["pp_comm"] = 2 * (pp - 1) * hop + (1 - P2P_OVERLAP) * 2 * (m - 1) * hop
        if CPU_BUBBLE_REUSE and _crowding(cal) > 1:
            section, parts["pp_comm"] = _crowded_pipeline(c, cal, stages, hop)
        parts["pp_comm"] += _tied_time(c, cal, stages, spans)
    busy = m * T
    scale = min(1.0, section / busy) if busy > 0 else 1.0
    parts["compute"] = m * slow.t_compute * scale
    parts["recompute"] = m * slow.t_recompute * scale
    parts["bubble"] = max(0.0, section - busy)
    post = max(stages, key=lambda st: sum(st.post_s.values()))
    for key, v in post.post_s.items():
        parts[key] += v
    full = max(stages, key=lambda st: st.peak)
    memory_parts = {k: int(round(v)) for k, v in full.memory.items()}
    return Estimate(
        candidate=c,
        step_s=sum(parts.values()),
        memory_bytes=sum(memory_parts.values()),
        parts=parts,
        memory_parts=memory_parts,
    )


def _crowded_pipeline(
    c: Candidate, cal: Calibration, stages: list[StageCost], hop: float
) -> tuple[float, float]:
    """The pipeline section and its exposed messages on a CPU node with more ranks than cores:
    the schedule played out (:func:`fleet.planner.pipeline_sim.simulate`) with each task at
    its alone speed (the crowded figures divided by the measured ``idle_speedup`` ``u``) slowed
    by ``max(1, busy / cores) ** (ln u / ln k)``, ``busy`` the ranks of the computing stages and
    ``k`` ranks per core: alone below the cores, the crowded figures with every stage busy."""
    k = _crowding(cal)
    u = max(1.0, cal.model.idle_speedup.get(c.mp, k))
    power = math.log(u) / math.log(k)
    cores = max(1, cal.cluster.cores_per_node)
    per_stage = max(1, cal.cluster.nproc_per_node // c.pp)

    def rate(n: int) -> float:
        return 1.0 / max(1.0, n * per_stage / cores) ** power

    fwd = [(st.t - st.t_bwd) / u for st in stages]
    bwd = [st.t_bwd / u for st in stages]
    m = c.accumulate_steps
    section = simulate(fwd, bwd, m, 0.0, rate, c.schedule)
    with_hops = simulate(fwd, bwd, m, hop, rate, c.schedule)
    return section, max(0.0, with_hops - section)


def _tied_time(
    c: Candidate, cal: Calibration, stages: list[StageCost], spans: dict[str, bool]
) -> float:
    """The all-reduce of each tied weight over the stages holding it."""
    holders: dict[str, list[StageCost]] = {}
    for st in stages:
        for e in _unique(list(st.entries)):
            if e.shared_key is not None:
                holders.setdefault(e.shared_key, []).append(st)
    t = 0.0
    for key, sts in holders.items():
        if len(sts) > 1:
            e = next(x for x in sts[0].entries if x.shared_key == key)
            fit = _fit(cal, "all_reduce", len(sts), spans["pipe"])
            t += fit.time(_param_bytes(e, c.mp))
    return t


__all__ = [
    "AMP_O2_PARAM_RATIO",
    "CPU_BUBBLE_REUSE",
    "CROWDED_CPU_OVERLAP",
    "DDP_BUCKET_BYTES",
    "DDP_OVERLAP",
    "FSDP_GATHERED_UNITS",
    "FSDP_OVERLAP",
    "P2P_OVERLAP",
    "REDUCE_LINK",
    "SHARDING_SEGMENT_BYTES",
    "STAGE2_PEAK_FULL_GRADS",
    "CostModelError",
    "StageCost",
    "estimate",
    "group_spans",
    "stage_bounds",
    "stage_costs",
]
