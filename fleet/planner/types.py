"""The planner's plain data: what calibration measured, a candidate configuration, its estimate,
and the plan. Standard library only (no torch), JSON round-trips through ``to_dict`` /
``from_dict`` so calibrations and plans can be cached and read by the launcher.

Units: seconds, bytes. A per-micro-batch quantity that grows with the micro-batch size ``b`` is
a :class:`Linear` ``a + c * b`` fitted from the profiled sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

OPTIMIZER_STATE = {"adamw": 2.0, "adam": 2.0, "momentum": 1.0, "sgd": 0.0}
"""Optimizer state bytes per parameter byte (Adam: two moments; momentum SGD: one buffer)."""

LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
"""The collectives calibration fits (``send_recv``: one message between two ranks)."""


@dataclass(frozen=True)
class Linear:
    """``a + c * b``: a per-micro-batch cost as a function of the micro-batch size ``b``."""

    a: float
    c: float

    def at(self, b: float) -> float:
        """The value at micro-batch size ``b`` (never below 0)."""
        return max(0.0, self.a + self.c * b)

    @staticmethod
    def fit(points: list[tuple[float, float]]) -> Linear:
        """Least-squares line through ``(b, value)`` points with ``a >= 0`` and ``c >= 0`` (one
        point: proportional to b). A cost has no negative part: measured times of a small
        layer can bend up with ``b`` (caches) or wobble, and an unconstrained line then crosses
        zero inside the measured sizes; the constrained one is the nearest line that does not
        (through the origin when the intercept would be negative, flat at the mean when the
        slope would be)."""
        if not points:
            return Linear(0.0, 0.0)
        if len({b for b, _ in points}) == 1:
            b, v = points[0]
            mean = sum(v for _, v in points) / len(points)
            return Linear(0.0, mean / b if b else 0.0)
        n = len(points)
        mb = sum(b for b, _ in points) / n
        mv = sum(v for _, v in points) / n
        sbb = sum((b - mb) ** 2 for b, _ in points)
        c = sum((b - mb) * (v - mv) for b, v in points) / sbb
        if mv - c * mb < 0:  # through the origin instead
            return Linear(
                0.0, max(0.0, sum(b * v for b, v in points) / sum(b * b for b, _ in points))
            )
        if c < 0:  # flat
            return Linear(max(0.0, mv), 0.0)
        return Linear(mv - c * mb, c)


def _int_keys(d: dict[Any, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


@dataclass(frozen=True)
class LayerProfile:
    """One entry of the model's layer list, measured on one device.

    Times and activation bytes are keyed by tensor-parallel degree: calibration builds the
    layer with a real model-parallel group of that size and times it while every group of the
    job runs at once, so the tensor-parallel communication and the contention of the job's
    ranks for the machine are inside the figures.
    """

    index: int
    """Position in the layer list."""
    name: str
    """Class name of the entry (the repeated block's name, ``LayerNorm``, a function's name)."""
    param_bytes: int
    """Bytes of its parameters when it is not split (mp = 1)."""
    tp_param_bytes: int
    """The part of ``param_bytes`` that tensor parallelism splits over the mp ranks."""
    shared_key: str | None
    """The ``SharedLayerDesc`` key: a stage holding several entries of a key stores it once."""
    fwd_s: dict[int, Linear]
    """mp degree -> forward seconds per micro-batch."""
    bwd_s: dict[int, Linear]
    """mp degree -> backward seconds per micro-batch."""
    act_bytes: dict[int, Linear]
    """mp degree -> bytes autograd keeps for this entry's backward, per micro-batch."""
    out_bytes: Linear
    """Bytes of the entry's output per micro-batch (what a pipeline stage sends, and what
    recompute keeps of the next entry's input)."""
    param_count: int = 0
    """Parameter tensors it holds (what a per-parameter cost, such as the optimizer step
    over FSDP2's DTensor parameters, counts)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> LayerProfile:
        lin = {
            k: {int(m): Linear(**v) for m, v in d[k].items()}
            for k in ("fwd_s", "bwd_s", "act_bytes")
        }
        return LayerProfile(
            index=int(d["index"]),
            name=str(d["name"]),
            param_bytes=int(d["param_bytes"]),
            tp_param_bytes=int(d["tp_param_bytes"]),
            shared_key=d.get("shared_key"),
            out_bytes=Linear(**d["out_bytes"]),
            param_count=int(d.get("param_count", 0)),
            **lin,
        )


@dataclass(frozen=True)
class ModelProfile:
    """The whole model as calibration saw it."""

    layers: tuple[LayerProfile, ...]
    block_class: str | None
    """Class name of the repeated block (stages are cut with ``seg_method="layer:<it>"``)."""
    layer_list: bool
    """True when the model is a layer list (LayerDesc list or nn.Sequential) that pipeline
    stages can cut; False for a plain nn.Module (pp_degree must be 1)."""
    mp_degrees: dict[int, str]
    """mp degree -> "" when the model builds at that degree, else why not (the error)."""
    optimizer: str
    """``adamw``, ``adam``, ``momentum`` or ``sgd`` (the state bytes follow OPTIMIZER_STATE)."""
    optimizer_step_s_per_byte: float
    """Seconds of ``optimizer.step()`` per parameter byte updated."""
    micro_batch_sizes: tuple[int, ...]
    """The micro-batch sizes that were profiled."""
    input_bytes: Linear
    """Bytes of one micro-batch of the sample (inputs and labels)."""
    amp: str = "O0"
    """AMP level the profile was taken under (from the base strategy): O0, O1 or O2."""
    idle_speedup: dict[int, float] = field(default_factory=dict)
    """mp degree -> how much faster one model-parallel group's whole pass runs while the other
    ranks idle than while every rank computes (CPU nodes with more ranks than cores; 1.0 or
    absent elsewhere): what a pipeline stage gains while its neighbours wait in the bubble."""

    @property
    def param_bytes(self) -> int:
        """Bytes of all parameters, shared ones once."""
        seen: set[str] = set()
        total = 0
        for layer in self.layers:
            if layer.shared_key is not None:
                if layer.shared_key in seen:
                    continue
                seen.add(layer.shared_key)
            total += layer.param_bytes
        return total

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = [layer.to_dict() for layer in self.layers]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelProfile:
        return ModelProfile(
            layers=tuple(LayerProfile.from_dict(x) for x in d["layers"]),
            block_class=d.get("block_class"),
            layer_list=bool(d["layer_list"]),
            mp_degrees=_int_keys(d["mp_degrees"]),
            optimizer=str(d["optimizer"]),
            optimizer_step_s_per_byte=float(d["optimizer_step_s_per_byte"]),
            micro_batch_sizes=tuple(int(b) for b in d["micro_batch_sizes"]),
            input_bytes=Linear(**d["input_bytes"]),
            amp=str(d.get("amp", "O0")),
            idle_speedup={int(k): float(v) for k, v in d.get("idle_speedup", {}).items()},
        )


@dataclass(frozen=True)
class LinkFit:
    """``alpha + beta * bytes``: one collective's time on one group shape."""

    alpha_s: float
    beta_s_per_byte: float

    def time(self, nbytes: float) -> float:
        """Seconds for a message of ``nbytes`` (the payload each rank contributes)."""
        return self.alpha_s + self.beta_s_per_byte * max(0.0, nbytes)


def link_key(op: str, group_size: int, spans_nodes: bool) -> str:
    """The key of a :class:`LinkFit` in :attr:`ClusterProfile.links`."""
    return f"{op}/{group_size}/{'inter' if spans_nodes else 'intra'}"


@dataclass(frozen=True)
class FsdpOverhead:
    """What FSDP2 (sharding stage 3) costs beyond its collectives' bytes, measured on one mesh
    shape with tiny parameters (:mod:`fleet.planner.fsdp_probe`): the hooks, the copies in and
    out of the flat buffers, the collectives' latency and, on a crowded CPU, the wait of every
    rank of the mesh for the slowest at each unit; and the optimizer's per-parameter cost over
    DTensor parameters."""

    unit_forward_s: float
    """Seconds per unit (a ``fully_shard`` module) per forward."""
    unit_backward_s: float
    """Seconds per unit per backward (its all-gather again and its reduce-scatter)."""
    param_step_s: float
    """Seconds per parameter tensor per optimizer step, beyond the step on plain tensors."""


def fsdp_key(dp: int, sharding: int) -> str:
    """The key of a :class:`FsdpOverhead` in :attr:`ClusterProfile.fsdp`."""
    return f"dp{dp}.sh{sharding}"


@dataclass(frozen=True)
class ClusterProfile:
    """The job's machines as calibration saw them."""

    nnodes: int
    nproc_per_node: int
    device: str
    """``cpu`` or the accelerator's name (``cuda:NVIDIA H100 80GB HBM3``)."""
    backend: str
    """``gloo`` or ``nccl``."""
    memory_per_device_bytes: int
    """The memory budget of one rank (the device's memory, or the given CPU budget)."""
    cores_per_node: int
    """CPU cores the node's ranks share (what contention is measured against on CPU)."""
    links: dict[str, LinkFit]
    """:func:`link_key` -> fit."""
    fsdp: dict[str, FsdpOverhead] = field(default_factory=dict)
    """:func:`fsdp_key` -> FSDP2's overhead on that mesh shape (empty: not measured)."""

    def fsdp_overhead(self, dp: int, sharding: int) -> FsdpOverhead | None:
        """The overhead measured on the ``(dp, sharding)`` mesh, else on the measured shape
        nearest in sharding size then in dp; None when nothing was measured."""
        exact = self.fsdp.get(fsdp_key(dp, sharding))
        if exact is not None or not self.fsdp:
            return exact

        def distance(key: str) -> tuple[int, int]:
            d, s = (int(x[2:]) for x in key.split("."))
            return abs(s - sharding), abs(d - dp)

        return self.fsdp[min(self.fsdp, key=distance)]

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def link(self, op: str, group_size: int, spans_nodes: bool) -> LinkFit:
        """The fit for ``op`` on a group of ``group_size`` ranks; the nearest measured group
        size of the same kind when that exact one was not measured; zero cost for one rank."""
        if group_size <= 1:
            return LinkFit(0.0, 0.0)
        exact = self.links.get(link_key(op, group_size, spans_nodes))
        if exact is not None:
            return exact
        kind = "inter" if spans_nodes else "intra"
        same = [
            (abs(int(k.split("/")[1]) - group_size), v)
            for k, v in self.links.items()
            if k.startswith(op + "/") and k.endswith("/" + kind)
        ]
        if not same:
            same = [
                (abs(int(k.split("/")[1]) - group_size), v)
                for k, v in self.links.items()
                if k.startswith(op + "/")
            ]
        if not same:
            raise KeyError(f"no calibration of {op} (calibrated: {sorted(self.links)})")
        return min(same, key=lambda t: t[0])[1]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ClusterProfile:
        return ClusterProfile(
            nnodes=int(d["nnodes"]),
            nproc_per_node=int(d["nproc_per_node"]),
            device=str(d["device"]),
            backend=str(d["backend"]),
            memory_per_device_bytes=int(d["memory_per_device_bytes"]),
            cores_per_node=int(d["cores_per_node"]),
            links={k: LinkFit(**v) for k, v in d["links"].items()},
            fsdp={k: FsdpOverhead(**v) for k, v in d.get("fsdp", {}).items()},
        )


@dataclass(frozen=True)
class Calibration:
    """What one calibration run measured (cached by :attr:`fingerprint`)."""

    model: ModelProfile
    cluster: ClusterProfile
    fingerprint: str
    seconds: float
    """Wall time the calibration took."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
            "fingerprint": self.fingerprint,
            "seconds": self.seconds,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Calibration:
        return Calibration(
            model=ModelProfile.from_dict(d["model"]),
            cluster=ClusterProfile.from_dict(d["cluster"]),
            fingerprint=str(d["fingerprint"]),
            seconds=float(d["seconds"]),
        )


@dataclass(frozen=True, order=True)
class Candidate:
    """One hybrid configuration: the degrees (their product is the world size), the sharding
    stage (0 without sharding), the micro-batching of each data replica's share of the global
    batch, and recompute."""

    dp: int
    mp: int
    pp: int
    sharding: int
    stage: int
    micro_batch_size: int
    accumulate_steps: int
    recompute: bool
    schedule: str = "1F1B"

    @property
    def key(self) -> str:
        """A short stable name: ``dp2.mp1.pp2.sh1.s0.mb4x2.rc0``."""
        return (
            f"dp{self.dp}.mp{self.mp}.pp{self.pp}.sh{self.sharding}.s{self.stage}."
            f"mb{self.micro_batch_size}x{self.accumulate_steps}.rc{int(self.recompute)}"
        )

    def strategy_dict(self, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """The DistributedStrategy keys of this candidate, over ``base`` (a strategy dict whose
        other keys, AMP for one, are kept)."""
        out: dict[str, Any] = {k: v for k, v in (base or {}).items() if k != "auto"}
        out["hybrid_configs"] = {
            "dp_degree": self.dp,
            "mp_degree": self.mp,
            "pp_degree": self.pp,
            "sharding_degree": self.sharding,
        }
        # tensor parallelism is hybrid_configs.mp_degree; fleet refuses the separate
        # strategy.tensor_parallel switch, so it is left off
        out.pop("tensor_parallel", None)
        out["pipeline"] = self.pp > 1
        out["pipeline_configs"] = {
            **dict(out.get("pipeline_configs") or {}),
            "micro_batch_size": self.micro_batch_size,
            "accumulate_steps": self.accumulate_steps,
            "schedule_mode": self.schedule,
        }
        out["sharding"] = self.sharding > 1
        if self.sharding > 1:
            out["sharding_configs"] = {
                **dict(out.get("sharding_configs") or {}),
                "stage": self.stage,
            }
        else:
            out.pop("sharding_configs", None)
        # pp == 1 micro-batches through gradient merge (the pipeline accumulates by itself)
        if self.pp == 1 and self.accumulate_steps > 1:
            out["gradient_merge"] = True
            out["gradient_merge_configs"] = {"k_steps": self.accumulate_steps, "avg": True}
        else:
            out.pop("gradient_merge", None)
            out.pop("gradient_merge_configs", None)
        out["recompute"] = self.recompute
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Candidate:
        return Candidate(**d)


@dataclass(frozen=True)
class Estimate:
    """The cost model's figures for one candidate."""

    candidate: Candidate
    step_s: float
    """Predicted seconds per optimizer step (one global batch)."""
    memory_bytes: int
    """Predicted peak bytes on the fullest rank."""
    parts: dict[str, float]
    """Step-time parts: ``compute``, ``recompute``, ``bubble``, ``pp_comm``, ``dp_comm``,
    ``sharding_comm``, ``optimizer`` (tensor-parallel communication is inside ``compute``:
    it was measured with the layers)."""
    memory_parts: dict[str, int]
    """Memory parts on the fullest rank: ``params``, ``grads``, ``optimizer``,
    ``activations``, ``buffers``."""

    @property
    def dominant(self) -> str:
        """The largest step-time part."""
        return max(self.parts, key=lambda k: self.parts[k]) if self.parts else "compute"

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate.to_dict(),
            "step_s": self.step_s,
            "memory_bytes": self.memory_bytes,
            "parts": dict(self.parts),
            "memory_parts": dict(self.memory_parts),
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Estimate:
        return Estimate(
            candidate=Candidate.from_dict(d["candidate"]),
            step_s=float(d["step_s"]),
            memory_bytes=int(d["memory_bytes"]),
            parts={k: float(v) for k, v in d["parts"].items()},
            memory_parts={k: int(v) for k, v in d["memory_parts"].items()},
        )


@dataclass(frozen=True)
class Refusal:
    """A configuration that is not valid, and why (``what``: the degrees or the candidate)."""

    what: str
    why: str


@dataclass
class Plan:
    """The search's result: valid candidates that fit, ranked by predicted (or, after
    verification, measured) step time; those that do not fit; the refused ones."""

    world_size: int
    global_batch_size: int
    ranked: list[Estimate]
    too_big: list[Estimate]
    refused: list[Refusal]
    memory_limit_bytes: int
    measured: dict[str, float] = field(default_factory=dict)
    """Candidate key -> measured seconds per step (``--verify``)."""
    fingerprint: str = ""
    base_strategy: dict[str, Any] = field(default_factory=dict)

    @property
    def chosen(self) -> Estimate:
        """The pick: the fastest measured when any were verified, else the top prediction."""
        if not self.ranked:
            raise LookupError("no configuration fits")
        if self.measured:
            verified = [e for e in self.ranked if e.candidate.key in self.measured]
            if verified:
                return min(verified, key=lambda e: self.measured[e.candidate.key])
        return self.ranked[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "global_batch_size": self.global_batch_size,
            "ranked": [e.to_dict() for e in self.ranked],
            "too_big": [e.to_dict() for e in self.too_big],
            "refused": [dataclasses.asdict(r) for r in self.refused],
            "memory_limit_bytes": self.memory_limit_bytes,
            "measured": dict(self.measured),
            "fingerprint": self.fingerprint,
            "base_strategy": dict(self.base_strategy),
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Plan:
        return Plan(
            world_size=int(d["world_size"]),
            global_batch_size=int(d["global_batch_size"]),
            ranked=[Estimate.from_dict(x) for x in d["ranked"]],
            too_big=[Estimate.from_dict(x) for x in d["too_big"]],
            refused=[Refusal(**x) for x in d["refused"]],
            memory_limit_bytes=int(d["memory_limit_bytes"]),
            measured={k: float(v) for k, v in d.get("measured", {}).items()},
            fingerprint=str(d.get("fingerprint", "")),
            base_strategy=dict(d.get("base_strategy", {})),
        )


@dataclass(frozen=True)
class ModelSpec:
    """What the user names: the model, its sample batch and loss as ``module:function``
    strings, the global batch size and the optimizer the job uses."""

    model: str
    """``pkg.module:function`` returning a layer list (LayerDesc entries), an nn.Module, or
    either paired with the loss: ``(layers, loss_fn)``. It may take ``mp_group`` and/or
    ``hcg`` keyword arguments (given when it declares them)."""
    sample: str
    """``pkg.module:function(batch_size)`` returning ``(inputs, labels)``."""
    global_batch_size: int
    loss: str | None = None
    """``pkg.module:function`` returning the loss callable (may take ``mp_group``); needed when
    the model function returns no loss."""
    optimizer: str = "adamw"
    """``adamw``, ``adam``, ``momentum`` or ``sgd``; trials use it with ``lr``."""
    lr: float = 1e-3
    path: tuple[str, ...] = ()
    """Directories put first on ``sys.path`` to import the functions (the job's cwd)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"] = list(self.path)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        d["path"] = tuple(d.get("path") or ())
        return ModelSpec(**d)


__all__ = [
    "LINK_OPS",
    "OPTIMIZER_STATE",
    "Calibration",
    "Candidate",
    "ClusterProfile",
    "Estimate",
    "FsdpOverhead",
    "LayerProfile",
    "Linear",
    "LinkFit",
    "ModelProfile",
    "ModelSpec",
    "Plan",
    "Refusal",
    "fsdp_key",
    "link_key",
]
