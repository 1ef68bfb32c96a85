"""CommunicateTopology arithmetic (Paddle's rank layout, model axis fastest), the degree equation,
and what fleet.init still refuses; no process group is started."""

from __future__ import annotations

import pytest

from collective.errors import ConfigError, FleetError
from fleet.base.topology import HYBRID_AXES, CommunicateTopology, build_topology
from fleet.strategy import DistributedStrategy
from fleet.strategy.configs import HybridConfig


@pytest.fixture
def topo() -> CommunicateTopology:
    # dp=2 x pp=2 x sharding=1 x mp=2: 8 ranks
    return CommunicateTopology(["data", "pipe", "sharding", "model"], [2, 2, 1, 2])


@pytest.mark.timeout(10)
def test_rank_layout_is_row_major_with_model_fastest(topo: CommunicateTopology) -> None:
    assert topo.world_size() == 8
    assert topo.get_hybrid_group_names() == list(HYBRID_AXES)
    assert topo.get_coord(0) == {"data": 0, "pipe": 0, "sharding": 0, "model": 0}
    assert topo.get_coord(1) == {"data": 0, "pipe": 0, "sharding": 0, "model": 1}
    assert topo.get_coord(2) == {"data": 0, "pipe": 1, "sharding": 0, "model": 0}
    assert topo.get_coord(5) == {"data": 1, "pipe": 0, "sharding": 0, "model": 1}
    for rank in range(8):
        assert topo.get_rank(**topo.get_coord(rank)) == rank
    assert topo.get_rank(data=1, pipe=1, sharding=0, model=1) == 7
    assert [topo.get_dim(a) for a in HYBRID_AXES] == [2, 2, 1, 2]


@pytest.mark.timeout(10)
def test_comm_lists_of_every_axis(topo: CommunicateTopology) -> None:
    assert topo.get_comm_list("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_comm_list("pipe") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_comm_list("data") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_comm_list("sharding") == [[r] for r in range(8)]
    # every axis's groups partition the world
    for axis in HYBRID_AXES:
        assert sorted(r for g in topo.get_comm_list(axis) for r in g) == list(range(8))
    assert topo.get_axis_list("pipe", 0) == [0, 1, 4, 5]
    assert topo.get_axis_list("model", 1) == [1, 3, 5, 7]
    assert topo.get_axis_list("data", 1) == [4, 5, 6, 7]


@pytest.mark.timeout(10)
def test_dp2_mp2_matches_the_tp_fixture_layout() -> None:
    topo = build_topology(HybridConfig(dp_degree=-1, mp_degree=2), 4)
    assert [topo.get_dim(a) for a in HYBRID_AXES] == [2, 1, 1, 2]
    assert topo.get_comm_list("model") == [[0, 1], [2, 3]]
    assert topo.get_comm_list("data") == [[0, 2], [1, 3]]
    assert repr(topo) == "CommunicateTopology({'data': 2, 'pipe': 1, 'sharding': 1, 'model': 2})"


@pytest.mark.timeout(10)
def test_bad_topologies_and_queries_raise_config_error(topo: CommunicateTopology) -> None:
    with pytest.raises(
        ConfigError,
        match=r"dp_degree\(3\) \* mp_degree\(2\) \* pp_degree\(1\) "
        r"\* sharding_degree\(1\) must equal the world size 4",
    ):
        build_topology(HybridConfig(dp_degree=3, mp_degree=2), 4)
    with pytest.raises(ConfigError, match=r"mp_degree\(3\) .* world size 4; set dp_degree"):
        build_topology(HybridConfig(mp_degree=3), 4)
    with pytest.raises(ConfigError, match="4 axis names .* but 3 dims"):
        CommunicateTopology(list(HYBRID_AXES), [1, 1, 1])
    with pytest.raises(ConfigError, match="at least 1 rank, got model=0"):
        CommunicateTopology(list(HYBRID_AXES), [1, 1, 1, 0])
    with pytest.raises(ConfigError, match=r"unknown axis 'tensor'"):
        topo.get_comm_list("tensor")
    with pytest.raises(ConfigError, match="rank 8 is outside 0..7"):
        topo.get_coord(8)
    with pytest.raises(ConfigError, match="get_rank needs exactly the axes"):
        topo.get_rank(data=0, model=0)
    with pytest.raises(ConfigError, match="outside the topology"):
        topo.get_rank(data=2, pipe=0, sharding=0, model=0)


@pytest.mark.timeout(60)
def test_fleet_init_checks_the_equation_for_every_axis(monkeypatch) -> None:
    import fleet.base.runtime

    assert fleet.CommunicateTopology is CommunicateTopology
    monkeypatch.setattr(fleet.base.runtime, "_runtime", None)
    with pytest.raises(FleetError, match=r"get_hybrid_communicate_group\(\) was called before"):
        fleet.get_hybrid_communicate_group()
    # mp_degree is accepted, but 2 ranks do not fit a world of one
    with pytest.raises(ConfigError, match=r"mp_degree\(2\) .* must equal the world size 1"):
        fleet.init(
            is_collective=True,
            strategy=DistributedStrategy.from_dict({"hybrid_configs": {"mp_degree": 2}}),
        )
    for axis in ("pp_degree", "sharding_degree"):  # landed: only the equation can fail
        s = DistributedStrategy.from_dict({"hybrid_configs": {"mp_degree": 2, axis: 2}})
        with pytest.raises(ConfigError, match=rf"{axis}\(2\).* must equal the world size 1"):
            fleet.init(is_collective=True, strategy=s)
