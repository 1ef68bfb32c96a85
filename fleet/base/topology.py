"""The hybrid-parallel topology: which global ranks form each data/pipe/sharding/model group.

Paddle's layout, kept exactly so that rank numbering matches Paddle jobs: the world is a grid of
``dims = [dp, pp, sharding, mp]`` along the axes ``["data", "pipe", "sharding", "model"]``, the
**model axis fastest** (row-major over the coordinates)::

    rank = ((data * pp + pipe) * sharding + sharding_idx) * mp + model

so the ``mp`` ranks of one tensor-parallel group are neighbours (on one node when ``mp`` divides
``nproc_per_node``). :class:`CommunicateTopology` is pure arithmetic (no torch); and
:class:`HybridCommunicateGroup` creates one torch process group per group of every axis, plus
Paddle's "check" group (the ranks of this pipeline stage: the whole world when ``pp == 1``).

``fleet.init`` builds the :class:`HybridCommunicateGroup` when any of ``hybrid_configs``
``mp_degree``, ``pp_degree``, ``sharding_degree`` is > 1; ``fleet.get_hybrid_communicate_group()``
returns it.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from typing import Any

from collective.errors import ConfigError

logger = logging.getLogger(__name__)

HYBRID_AXES: tuple[str, ...] = ("data", "pipe", "sharding", "model")
"""Paddle's axis names, outermost first (``model`` varies fastest along the ranks)."""


class CommunicateTopology:
    """A grid of ranks: ``dims[i]`` ranks along axis ``hybrid_group_names[i]``, last axis fastest.

    Pure arithmetic: no process group is touched.
    """

    def __init__(
        self,
        hybrid_group_names: Sequence[str] = HYBRID_AXES,
        dims: Sequence[int] = (1, 1, 1, 1),
    ) -> None:
        names, sizes = list(hybrid_group_names), [int(d) for d in dims]
        if len(names) != len(sizes):
            raise ConfigError(
                f"{len(names)} axis names {names} but {len(sizes)} dims {sizes}; give one size "
                "per axis",
                key="dims",
            )
        if len(set(names)) != len(names):
            raise ConfigError(f"axis names repeat: {names}", key="hybrid_group_names")
        bad = [f"{n}={d}" for n, d in zip(names, sizes) if d < 1]
        if bad:
            raise ConfigError(f"every axis needs at least 1 rank, got {', '.join(bad)}", key="dims")
        self._names = names
        self._dims = sizes
        self._world_size = math.prod(sizes)
        coords = itertools.product(*(range(d) for d in sizes))  # row-major: last axis fastest
        self._rank2coord: list[tuple[int, ...]] = list(coords)
        self._coord2rank = {c: r for r, c in enumerate(self._rank2coord)}

    def get_hybrid_group_names(self) -> list[str]:
        """The axis names, outermost first."""
        return list(self._names)

    def get_dim(self, axis_name: str) -> int:
        """Number of ranks along ``axis_name``."""
        return self._dims[self._axis(axis_name)]

    def world_size(self) -> int:
        """Product of the dims."""
        return self._world_size

    def get_rank(self, **coords: int) -> int:
        """The global rank at the coordinates given by axis name (every axis must be named)."""
        if set(coords) != set(self._names):
            raise ConfigError(
                f"get_rank needs exactly the axes {self._names}, got {sorted(coords)}", key="coords"
            )
        coord = tuple(coords[n] for n in self._names)
        if coord not in self._coord2rank:
            raise ConfigError(
                f"coordinates {coords} are outside the topology "
                f"{dict(zip(self._names, self._dims))}",
                key="coords",
            )
        return self._coord2rank[coord]

    def get_coord(self, rank: int) -> dict[str, int]:
        """The coordinates of global ``rank``, by axis name."""
        if not 0 <= rank < self._world_size:
            raise ConfigError(f"rank {rank} is outside 0..{self._world_size - 1}", key="rank")
        return dict(zip(self._names, self._rank2coord[rank]))

    def get_axis_list(self, axis_name: str, index: int) -> list[int]:
        """All global ranks whose coordinate along ``axis_name`` is ``index`` (ascending)."""
        axis = self._axis(axis_name)
        return [r for r, c in enumerate(self._rank2coord) if c[axis] == index]

    def get_comm_list(self, axis_name: str) -> list[list[int]]:
        """The rank lists of every group along ``axis_name``: ranks that differ only in that
        coordinate, each list ordered by it. Groups are ordered by the other coordinates."""
        axis = self._axis(axis_name)
        others = [range(d) if i != axis else range(1) for i, d in enumerate(self._dims)]
        groups = []
        for base in itertools.product(*others):
            coord = list(base)
            group = []
            for i in range(self._dims[axis]):
                coord[axis] = i
                group.append(self._coord2rank[tuple(coord)])
            groups.append(group)
        return groups

    def _axis(self, axis_name: str) -> int:
        if axis_name not in self._names:
            raise ConfigError(
                f"unknown axis {axis_name!r}; axes are {self._names}", key="axis_name"
            )
        return self._names.index(axis_name)

    def __repr__(self) -> str:
        return f"CommunicateTopology({dict(zip(self._names, self._dims))})"


def build_topology(hybrid: Any, world_size: int) -> CommunicateTopology:
    """The topology for a strategy's ``hybrid_configs`` (a HybridConfig) at ``world_size`` ranks.

    ConfigError with the equation when the degrees do not multiply to the world size.
    """
    dp = hybrid.resolve_dp_degree(world_size)
    return CommunicateTopology(
        HYBRID_AXES, [dp, hybrid.pp_degree, hybrid.sharding_degree, hybrid.mp_degree]
    )


class HybridCommunicateGroup:
    """This rank's torch process groups along every axis of ``topology``.

    Construction is collective: every rank creates every group of every axis in the same order
    (torch requires it), so all ranks must construct it together, after the default group is up.
    """

    def __init__(self, topology: CommunicateTopology) -> None:
        import torch.distributed as tdist

        if tdist.get_world_size() != topology.world_size():
            raise ConfigError(
                f"{topology} has {topology.world_size()} ranks but the process group has "
                f"{tdist.get_world_size()}",
                key="hybrid_configs",
            )
        self._topo = topology
        self.global_rank = tdist.get_rank()
        self._coord = topology.get_coord(self.global_rank)
        self._groups: dict[str, Any] = {}
        self._ranks: dict[str, list[int]] = {}
        for axis in HYBRID_AXES:
            self._ranks[axis], self._groups[axis] = self._new_groups(topology.get_comm_list(axis))
        # Paddle's check group: the ranks of this pipeline stage (all ranks when pp == 1).
        stages = [topology.get_axis_list("pipe", s) for s in range(topology.get_dim("pipe"))]
        self._ranks["check"], self._groups["check"] = self._new_groups(stages)
        logger.debug("hybrid groups of rank %d: %s", self.global_rank, self._ranks)

    def _new_groups(self, rank_lists: list[list[int]]) -> tuple[list[int], Any]:
        import torch.distributed as tdist

        mine: tuple[list[int], Any] | None = None
        for ranks in rank_lists:  # every rank creates every group, in the same order
            group = tdist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                mine = (ranks, group)
        assert mine is not None  # the comm lists of an axis cover every rank
        return mine

    def topology(self) -> CommunicateTopology:
        """The topology these groups were built from."""
        return self._topo

    def get_global_rank(self) -> int:
        """This process's rank in the default group."""
        return self.global_rank

    def get_group_ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis`` (or ``"check"``)."""
        return list(self._ranks[axis])

    # data parallel
    def get_data_parallel_rank(self) -> int:
        """Index of this rank in its data-parallel group."""
        return self._coord["data"]

    def get_data_parallel_world_size(self) -> int:
        """The data-parallel degree."""
        return self._topo.get_dim("data")

    def get_data_parallel_group(self) -> Any:
        """The torch process group of this rank's data-parallel replicas."""
        return self._groups["data"]

    # model (tensor) parallel
    def get_model_parallel_rank(self) -> int:
        """Index of this rank in its tensor-parallel group (which shard it holds)."""
        return self._coord["model"]

    def get_model_parallel_world_size(self) -> int:
        """The tensor-parallel degree."""
        return self._topo.get_dim("model")

    def get_model_parallel_group(self) -> Any:
        """The torch process group of this rank's tensor-parallel peers."""
        return self._groups["model"]

    # pipeline parallel
    def get_pipe_parallel_rank(self) -> int:
        """Index of this rank along the pipeline axis."""
        return self._coord["pipe"]

    def get_stage_id(self) -> int:
        """This rank's pipeline stage (= :meth:`get_pipe_parallel_rank`)."""
        return self._coord["pipe"]

    def get_pipe_parallel_world_size(self) -> int:
        """The pipeline degree (number of stages)."""
        return self._topo.get_dim("pipe")

    def get_pipe_parallel_group(self) -> Any:
        """The torch process group of this rank's pipeline."""
        return self._groups["pipe"]

    # sharding parallel
    def get_sharding_parallel_rank(self) -> int:
        """Index of this rank along the sharding axis."""
        return self._coord["sharding"]

    def get_sharding_parallel_world_size(self) -> int:
        """The sharding degree."""
        return self._topo.get_dim("sharding")

    def get_sharding_parallel_group(self) -> Any:
        """The torch process group of this rank's sharding peers."""
        return self._groups["sharding"]

    def get_check_parallel_group(self) -> Any:
        """The ranks of this pipeline stage (all ranks when pp == 1), e.g. for a global
        found-inf or gradient-norm reduction."""
        return self._groups["check"]


__all__ = [
    "HYBRID_AXES",
    "CommunicateTopology",
    "HybridCommunicateGroup",
    "build_topology",
]
