"""The pipeline schedule simulation the planner's cost model uses on a crowded CPU."""

from __future__ import annotations

import pytest

from fleet.planner.pipeline_sim import simulate, stage_orders

pytestmark = pytest.mark.timeout(30)


def test_1f1b_orders_warm_up_then_alternate() -> None:
    orders = stage_orders(3, 4)
    assert orders[0] == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("F", 3),
        ("B", 1),
        ("B", 2),
        ("B", 3),
    ]
    assert orders[2] == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
        ("F", 3),
        ("B", 3),
    ]
    for order in orders + stage_orders(3, 4, "FThenB"):
        assert sorted(order) == sorted([("F", i) for i in range(4)] + [("B", i) for i in range(4)])


@pytest.mark.parametrize("schedule", ["1F1B", "FThenB"])
@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 4), (4, 4), (4, 8), (3, 2)])
def test_uniform_stages_with_free_cores_take_m_plus_pp_minus_one_slots(
    schedule: str, pp: int, m: int
) -> None:
    t = simulate([1.0] * pp, [2.0] * pp, m, 0.0, lambda n: 1.0, schedule)
    assert t == pytest.approx((m + pp - 1) * 3.0)


def test_hops_add_to_the_fill_and_drain() -> None:
    base = simulate([1.0] * 2, [2.0] * 2, 1, 0.0, lambda n: 1.0)
    assert simulate([1.0] * 2, [2.0] * 2, 1, 0.5, lambda n: 1.0) == pytest.approx(base + 2 * 0.5)


def test_stages_sharing_one_core_take_the_whole_work() -> None:
    # one core: two computing stages run at half speed each, so nothing overlaps usefully
    t = simulate([1.0, 1.0], [2.0, 2.0], 8, 0.0, lambda n: 1.0 / n)
    assert t == pytest.approx(2 * 8 * 3.0)


def test_the_slowest_stage_bounds_the_steady_state() -> None:
    t = simulate([1.0, 3.0], [1.0, 3.0], 10, 0.0, lambda n: 1.0)
    assert t == pytest.approx(10 * 6.0 + 2.0, rel=1e-9)
