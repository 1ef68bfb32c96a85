"""The planner's search and cost model on hand-built calibrations (no torch, no processes)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from fleet.planner import cost, search
from fleet.planner.cost import estimate, group_spans, stage_bounds, stage_costs
from fleet.planner.types import (
    LINK_OPS,
    Calibration,
    Candidate,
    ClusterProfile,
    FsdpOverhead,
    LayerProfile,
    Linear,
    LinkFit,
    ModelProfile,
    ModelSpec,
    fsdp_key,
    link_key,
)

MPS = (1, 2, 4, 8)
PARAM, TP, ACT, OUT, IN = 4000, 3000, 100.0, 10.0, 8.0


def layer(
    i: int, name: str, pb: int, tp: int, shared: str | None = None, act: float = ACT
) -> LayerProfile:
    """An entry whose time and activations split evenly over mp; 0.1 ms fixed per pass."""
    return LayerProfile(
        index=i,
        name=name,
        param_bytes=pb,
        tp_param_bytes=tp,
        shared_key=shared,
        fwd_s={m: Linear(1e-4, 1e-3 / m) for m in MPS},
        bwd_s={m: Linear(2e-4, 2e-3 / m) for m in MPS},
        act_bytes={m: Linear(0.0, act / m) for m in MPS},
        out_bytes=Linear(0.0, OUT),
    )


def make_cal(
    world: int = 4,
    nproc: int | None = None,
    blocks: int = 8,
    layer_list: bool = True,
    tp: bool = True,
    memory: int = 10**9,
    cores: int = 64,
    mp_errors: dict[int, str] | None = None,
    optimizer: str = "adamw",
    amp: str = "O0",
) -> Calibration:
    """Embedding (tied) + ``blocks`` Blocks + Head (tied to the embedding)."""
    nproc = nproc or world
    layers = [layer(0, "Embedding", 1000, 0, "embed")]
    layers += [layer(i, "Block", PARAM, TP if tp else 0) for i in range(1, blocks + 1)]
    layers += [layer(blocks + 1, "Head", 1000, 0, "embed")]
    degrees = {m: "" for m in MPS}
    degrees.update(mp_errors or {})
    model = ModelProfile(
        layers=tuple(layers),
        block_class="Block",
        layer_list=layer_list,
        mp_degrees=degrees,
        optimizer=optimizer,
        optimizer_step_s_per_byte=1e-9,
        micro_batch_sizes=(1, 2, 4),
        input_bytes=Linear(0.0, IN),
        amp=amp,
    )
    links = {
        link_key(op, k, inter): LinkFit(1e-4 * (3 if inter else 1), 1e-8)
        for op in LINK_OPS
        for k in (2, 4, 8)
        for inter in (False, True)
    }
    cluster = ClusterProfile(world // nproc, nproc, "cpu", "gloo", memory, cores, links)
    return Calibration(model, cluster, "fp-test", 1.0)


def spec(batch: int = 16) -> ModelSpec:
    return ModelSpec(model="m:model", sample="m:sample", global_batch_size=batch)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- enumeration ----------------------------------------------------------------------------


@pytest.mark.parametrize("world", [4, 8])
def test_factorisations_match_brute_force(world: int) -> None:
    brute = {t for t in itertools.product(range(1, world + 1), repeat=4) if math.prod(t) == world}
    got = search.factorisations(world)
    assert len(got) == len(set(got)) == len(brute)
    assert set(got) == brute


@pytest.mark.parametrize("world", [4, 8])
def test_enumeration_covers_every_valid_candidate(world: int) -> None:
    G = 16
    cands, refusals = search.enumerate_candidates(make_cal(world), spec(G), {})
    expected = set()
    for dp, mp, pp, sh in itertools.product(range(1, world + 1), repeat=4):
        if dp * mp * pp * sh != world or G % (dp * sh):
            continue
        local = G // (dp * sh)
        for stage in (1, 2, 3) if sh > 1 else (0,):
            for b in divisors(local):
                for rc in (False, True):
                    expected.add(Candidate(dp, mp, pp, sh, stage, b, local // b, rc))
    assert set(cands) == expected
    assert len(cands) == len(expected)
    assert refusals == []  # every factorisation of 4/8 divides 16 and builds


def test_refusals_name_the_reason() -> None:
    cal = make_cal(4, mp_errors={2: "hidden 30 is not divisible by 4"})
    cands, refusals = search.enumerate_candidates(cal, spec(16), {})
    why = {r.what: r.why for r in refusals}
    assert "hidden 30 is not divisible by 4" in why["dp2.mp2.pp1.sh1"]
    assert all(c.mp != 2 for c in cands)
    # no tensor-parallel parameters: mp > 1 only replicates
    _, refusals = search.enumerate_candidates(make_cal(4, tp=False), spec(16), {})
    assert "would only replicate the model" in {r.what: r.why for r in refusals}["dp1.mp4.pp1.sh1"]
    # a plain nn.Module: no pipeline, no recompute
    cands, refusals = search.enumerate_candidates(make_cal(4, layer_list=False), spec(16), {})
    assert "plain nn.Module" in {r.what: r.why for r in refusals}["dp2.mp1.pp2.sh1"]
    assert all(c.pp == 1 and not c.recompute for c in cands)
    # more stages than repeated blocks
    _, refusals = search.enumerate_candidates(make_cal(4, blocks=2), spec(16), {})
    assert (
        "matches 2 layer(s), fewer than 4 stages"
        in {r.what: r.why for r in refusals}["dp1.mp1.pp4.sh1"]
    )
    # a global batch that does not divide over the replicas
    _, refusals = search.enumerate_candidates(make_cal(4), spec(6), {})
    assert (
        "global batch 6 does not divide into 4 data replicas"
        in {r.what: r.why for r in refusals}["dp2.mp1.pp1.sh2"]
    )


def test_composition_refusals_come_from_fleet_strategy() -> None:
    # localsgd cannot run under a pipeline or with sharding: those candidates are refused
    cands, refusals = search.enumerate_candidates(make_cal(4), spec(16), {"localsgd": True})
    assert cands and all(c.pp == 1 and c.sharding == 1 and c.mp == 1 for c in cands)
    texts = " ".join(r.why for r in refusals)
    assert "localsgd" in texts and "not implemented" in texts


def test_pipeline_candidates_accumulate_through_the_pipeline() -> None:
    cands, _ = search.enumerate_candidates(make_cal(4), spec(16), {})
    for c in cands:
        d = c.strategy_dict({})
        if c.pp > 1:
            assert "gradient_merge" not in d
            assert d["pipeline_configs"]["accumulate_steps"] == c.accumulate_steps
        elif c.accumulate_steps > 1:
            assert d["gradient_merge_configs"]["k_steps"] == c.accumulate_steps


# ---- layout and stages ----------------------------------------------------------------------


def test_group_spans_follow_the_topology_order() -> None:
    # 2 nodes x 2: model fastest, then sharding, pipe, data
    spans = group_spans(Candidate(2, 2, 1, 1, 0, 1, 1, False), nproc_per_node=2)
    assert not spans["model"] and spans["data"]
    spans = group_spans(Candidate(1, 1, 2, 2, 1, 1, 1, False), nproc_per_node=2)
    assert not spans["sharding"] and spans["pipe"]
    spans = group_spans(Candidate(2, 1, 1, 2, 1, 1, 1, False), nproc_per_node=2)
    assert not spans["sharding"] and spans["data"] and spans["dp_sharding"]


def test_stage_bounds_match_segment_layers() -> None:
    model = make_cal(4, blocks=6).model
    assert stage_bounds(model, 1) == [0, 8]
    # blocks at 1..6: stage 1 starts at hits[3] = 4; the embedding and head stay put
    assert stage_bounds(model, 2) == [0, 4, 8]
    assert stage_bounds(model, 4) == [0, 2, 4, 5, 8]
    pytest.importorskip("torch")
    from fleet.meta_parallel.pipeline_layer import segment_layers

    class Embedding:
        pass

    class Block:
        pass

    class Head:
        pass

    entries = [Embedding()] + [Block() for _ in range(6)] + [Head()]
    for pp in (2, 3, 4):
        assert stage_bounds(model, pp) == segment_layers(entries, pp, "layer:Block")


# ---- memory ---------------------------------------------------------------------------------


def _mem(c: Candidate, cal: Calibration) -> dict[str, int]:
    return estimate(c, cal).memory_parts


def test_memory_parts_of_each_sharding_stage() -> None:
    cal = make_cal(4, blocks=4)
    P = 1000 + 4 * (PARAM - TP + TP / 1)  # the tied weight once
    base = _mem(Candidate(4, 1, 1, 1, 0, 1, 4, False), cal)
    assert base["params"] == P and base["grads"] == P
    assert base["optimizer"] == 2 * P  # adamw: two moments
    assert base["buffers"] == P  # DDP's gradient buckets
    s1 = _mem(Candidate(1, 1, 1, 4, 1, 1, 4, False), cal)
    assert s1["params"] == P and s1["grads"] == P and s1["optimizer"] == 2 * P / 4
    s2 = _mem(Candidate(1, 1, 1, 4, 2, 4, 1, False), cal)
    # reduced to their owners inside step(); until then they sit next to the buckets
    assert s2["grads"] == P / 4
    assert s2["optimizer"] == 2 * P / 4
    assert s2["buffers"] == max(0.0, P + (P - P / 4) - s2["activations"])
    # gradient merge: the whole gradient accumulates next to the later micro-batches
    assert _mem(Candidate(1, 1, 1, 4, 2, 1, 4, False), cal)["grads"] == P
    s3 = _mem(Candidate(1, 1, 1, 4, 3, 4, 1, False), cal)
    gathered = 1000 + PARAM  # the root (tied weight) and the largest unit
    assert s3["params"] == P / 4 + gathered
    assert s3["grads"] == P / 4 and s3["optimizer"] == 2 * P / 4 and s3["buffers"] == 0
    # micro-batching under stage 3 accumulates unsharded gradients
    assert _mem(Candidate(1, 1, 1, 4, 3, 1, 4, False), cal)["grads"] == P / 4 + P


def test_stage2_gradient_share_is_a_tunable(monkeypatch: pytest.MonkeyPatch) -> None:
    cal = make_cal(4, blocks=4)
    P = 1000 + 4 * PARAM
    monkeypatch.setattr(cost, "STAGE2_PEAK_FULL_GRADS", True)
    assert _mem(Candidate(1, 1, 1, 4, 2, 4, 1, False), cal)["grads"] == P


def test_tensor_parallel_divides_its_share() -> None:
    cal = make_cal(4, blocks=4)
    got = _mem(Candidate(2, 2, 1, 1, 0, 1, 8, False), cal)
    assert got["params"] == 1000 + 4 * (PARAM - TP + TP / 2)


def test_amp_o2_holds_float32_masters() -> None:
    cal = make_cal(4, blocks=4, amp="O2")  # profiled bytes are 16-bit
    P = 1000 + 4 * PARAM
    got = _mem(Candidate(1, 1, 1, 4, 1, 1, 4, False), cal)
    assert got["params"] == P and got["optimizer"] == (2 * 2 * P + 2 * P) / 4


def test_pipeline_flat_all_reduce_buffer_over_dp() -> None:
    cal = make_cal(4, blocks=4)
    with_dp = stage_costs(Candidate(2, 1, 2, 1, 0, 8, 1, False), cal)
    without = stage_costs(Candidate(1, 2, 2, 1, 0, 16, 1, False), cal)
    assert with_dp[0].memory["buffers"] == with_dp[0].param_bytes  # no DDP under a pipeline
    assert without[0].memory["buffers"] == 0


def test_1f1b_keeps_at_most_pp_minus_stage_micro_batches() -> None:
    cal = make_cal(4, blocks=4)  # stages of pp 2: [Embedding, Block, Block] [Block, Block, Head]
    b, m = 2, 8
    stages = stage_costs(Candidate(2, 1, 2, 1, 0, b, m, False), cal)
    per_mb = [sum(e.act_bytes[1].at(b) for e in st.entries) for st in stages]
    assert stages[0].memory["activations"] == 2 * per_mb[0]  # min(m, pp - 0)
    assert stages[1].memory["activations"] == 1 * per_mb[1]
    fthenb = stage_costs(Candidate(2, 1, 2, 1, 0, b, m, False, "FThenB"), cal)
    assert fthenb[0].memory["activations"] == m * per_mb[0]
    few = stage_costs(Candidate(2, 1, 2, 1, 0, 8, 1, False), cal)  # m < pp
    assert few[0].memory["activations"] == sum(e.act_bytes[1].at(8) for e in few[0].entries)


def test_recompute_keeps_only_entry_inputs() -> None:
    cal = make_cal(4, blocks=4)
    b = 2
    st = stage_costs(Candidate(2, 1, 2, 1, 0, b, 8, True), cal)[0]
    # entry 0's input is the sample, the others the previous output; 2 in flight on stage 0
    inputs = IN * b + 2 * OUT * b
    assert st.memory["activations"] == 2 * inputs + ACT * b
    assert st.t_recompute == pytest.approx(sum(e.fwd_s[1].at(b) for e in st.entries))


# ---- time -----------------------------------------------------------------------------------


def test_pipeline_with_fewer_micro_batches_than_stages_has_a_larger_bubble() -> None:
    cal = make_cal(4, blocks=4)
    few = estimate(Candidate(1, 1, 4, 1, 0, 16, 1, False), cal)
    many = estimate(Candidate(1, 1, 4, 1, 0, 2, 8, False), cal)
    assert few.parts["bubble"] / few.step_s > many.parts["bubble"] / many.step_s
    # (m + pp - 1) slots of the slowest stage
    slow = max(stage_costs(few.candidate, cal), key=lambda s: s.t)
    assert few.parts["bubble"] == pytest.approx(3 * slow.t)


def test_a_cpu_bubble_frees_cores_for_busy_ranks() -> None:
    c = Candidate(1, 1, 4, 1, 0, 16, 1, False)
    roomy = estimate(c, make_cal(4, blocks=4, cores=64))
    crowded = estimate(c, make_cal(4, blocks=4, cores=1))
    assert crowded.parts["bubble"] < roomy.parts["bubble"]
    assert crowded.parts["compute"] == pytest.approx(roomy.parts["compute"], rel=0.5)


def test_a_measured_idle_speedup_replaces_the_core_ratio() -> None:
    c = Candidate(1, 2, 2, 1, 0, 16, 1, False)  # mp 2 x pp 2, one micro-batch
    cal = make_cal(4, blocks=4, cores=2)  # 4 ranks on 2 cores: k = 2
    default = estimate(c, cal)
    model = dataclasses.replace(cal.model, idle_speedup={2: 2.5})
    measured = estimate(c, dataclasses.replace(cal, model=model))
    slow = max(stage_costs(c, cal), key=lambda s: s.t)
    # (m + pp - 1) slots of the slowest stage, at the measured speedup instead of k = 2
    section = lambda p: p["compute"] + p["bubble"]  # noqa: E731
    assert section(default.parts) == pytest.approx(2 * slow.t / 2)
    assert section(measured.parts) == pytest.approx(2 * slow.t / 2.5, rel=0.05)
    assert measured.step_s < default.step_s
    assert ModelProfile.from_dict(model.to_dict()) == model  # kept in the cached JSON


def test_ddp_all_reduce_overlaps_backward_and_spans_nodes() -> None:
    one = estimate(Candidate(4, 1, 1, 1, 0, 4, 1, False), make_cal(4, nproc=4))
    two = estimate(Candidate(4, 1, 1, 1, 0, 4, 1, False), make_cal(4, nproc=2))
    assert two.parts["dp_comm"] >= one.parts["dp_comm"]
    assert estimate(Candidate(1, 4, 1, 1, 0, 4, 4, False), make_cal(4)).parts["dp_comm"] == 0


def test_gradient_merge_reduces_once_per_step() -> None:
    cal = make_cal(4)
    one = estimate(Candidate(4, 1, 1, 1, 0, 4, 1, False), cal)
    merged = estimate(Candidate(4, 1, 1, 1, 0, 1, 4, False), cal)
    assert merged.parts["dp_comm"] <= one.parts["dp_comm"] + 1e-12
    assert merged.parts["compute"] > one.parts["compute"]  # 4 x the fixed per-pass cost


# ---- plan, errors, table, explanation -------------------------------------------------------


def test_plan_ranks_fitting_candidates() -> None:
    cal = make_cal(4)
    p = search.plan(cal, spec(16), {})
    assert p.fingerprint == "fp-test" and p.world_size == 4 and p.global_batch_size == 16
    steps = [(e.step_s, e.memory_bytes) for e in p.ranked]
    assert steps == sorted(steps)
    limit = sorted(e.memory_bytes for e in p.ranked)[len(p.ranked) // 2]
    half = search.plan(cal, spec(16), {}, memory_limit_bytes=limit)
    assert half.too_big and all(e.memory_bytes <= limit for e in half.ranked)
    assert all(e.memory_bytes > limit for e in half.too_big)


def test_nothing_fits_says_by_how_much() -> None:
    cal = make_cal(4)
    with pytest.raises(search.NothingFitsError) as info:
        search.plan(cal, spec(16), {}, memory_limit_bytes=1000)
    msg = str(info.value)
    closest = info.value.plan.too_big[0]
    assert "short by" in msg and "on the fullest rank" in msg
    assert search.describe(closest.candidate) in msg
    assert search.size(closest.memory_bytes) in msg and "0.00 GiB" not in msg
    assert "raise memory_per_device" in msg
    assert isinstance(info.value, search.PlannerError)
    table = search.format_table(info.value.plan, top=3)
    assert "none fits; the closest by memory:" in table and "0 fit" in table
    assert f"{closest.memory_bytes / 2**20:.1f}" in table.splitlines()[3]


def test_no_micro_batching_names_replicas_and_nearest_batches() -> None:
    # a plain module without tensor-parallel layers: every factorisation has 4 replicas
    cal = make_cal(4, layer_list=False, tp=False)
    with pytest.raises(search.NoMicroBatchingError) as info:
        search.plan(cal, spec(6), {})
    msg = str(info.value)
    assert "global batch 6" in msg and "tried 4 replica(s)" in msg
    assert "divide: 4, 8" in msg


def test_no_valid_factorisation_lists_reasons() -> None:
    with pytest.raises(search.NoFactorisationError) as info:
        search.plan(make_cal(2), spec(8), {"dgc": True, "lars": True})
    msg = str(info.value)
    assert "dp2.mp1.pp1.sh1" in msg and "DGC" in msg and "world size 2" in msg


def test_table_and_explanation_carry_the_numbers() -> None:
    cal = make_cal(4)
    p = search.plan(cal, spec(16), {})
    top = p.ranked[0]
    table = search.format_table(p, top=5)
    assert f"{top.step_s * 1e3:.2f}" in table and f"{top.memory_bytes / 2**20:.1f}" in table
    assert top.dominant in table and "measured" not in table
    assert len(table.splitlines()) == 2 + 5 + 1
    p.measured = {top.candidate.key: 0.5, p.ranked[1].candidate.key: 0.25}
    assert "measured ms" in search.format_table(p) and "250.00" in search.format_table(p)
    assert p.chosen is p.ranked[1]
    lines = search.explain(p)
    assert lines[0].startswith("verified:") and "250.0 ms" in lines[0]
    knobs = lines[1:]
    prefixes = [("pp ",), ("mp ",), ("dp ",), ("sharding ", "no sharding"), ("micro-batch ",)]
    prefixes.append(("recompute ",))
    assert len(knobs) == 6
    assert all(line.startswith(pre) for line, pre in zip(knobs, prefixes))
    chosen = p.chosen
    assert f"{chosen.step_s * 1e3:.1f} ms" in " ".join(knobs)


def test_explanation_of_a_pipeline_pick_quotes_its_bubble() -> None:
    cal = make_cal(4, blocks=4)
    # with only pipelined candidates fitting, the pick explains its bubble against the rest
    p = search.plan(cal, spec(16), {})
    pick = next(e for e in p.ranked if e.candidate.pp > 1)
    p.ranked = [pick] + [e for e in p.ranked if e is not pick]
    pp_line = search.explain(p)[0]
    assert pp_line.startswith(f"pp {pick.candidate.pp}: the pipeline bubble costs ")
    assert f"{100 * pick.parts['bubble'] / pick.step_s:.0f}%" in pp_line


def test_the_pick_is_a_strategy_fleet_accepts() -> None:
    from fleet import DistributedStrategy
    from fleet.strategy import check_composition

    base = {"amp": True, "amp_configs": {"use_pure_fp16": False}}
    p = search.plan(make_cal(4), spec(16), base)
    for e in [p.chosen, *p.ranked[:20]]:
        strategy = DistributedStrategy.from_dict(e.candidate.strategy_dict(p.base_strategy))
        check_composition(strategy)
        h = strategy.hybrid_configs
        assert (h.dp_degree, h.mp_degree, h.pp_degree, h.sharding_degree) == (
            e.candidate.dp,
            e.candidate.mp,
            e.candidate.pp,
            e.candidate.sharding,
        )
        assert strategy.amp


def test_plan_round_trips_through_json() -> None:
    p = search.plan(make_cal(4), spec(16), {})
    from fleet.planner.types import Plan

    again = Plan.from_dict(p.to_dict())
    assert again.ranked[0] == p.ranked[0] and search.format_table(again) == search.format_table(p)


def test_point_to_point_on_the_critical_path() -> None:
    cal = make_cal(4, blocks=4, tp=False)
    hop = cal.cluster.link("send_recv", 2, False).time(OUT * 8)
    tied = cal.cluster.link("all_reduce", 2, False).time(1000)  # embedding and head
    one = estimate(Candidate(2, 1, 2, 1, 0, 8, 1, False), cal)
    assert one.parts["pp_comm"] == pytest.approx(2 * hop + tied)
    hop = cal.cluster.link("send_recv", 2, False).time(OUT * 2)
    four = estimate(Candidate(2, 1, 2, 1, 0, 2, 4, False), cal)
    assert four.parts["pp_comm"] == pytest.approx(2 * hop + (1 - cost.P2P_OVERLAP) * 6 * hop + tied)


def test_a_crowded_cpu_hides_no_communication() -> None:
    c = Candidate(4, 1, 1, 1, 0, 4, 1, False)
    roomy = estimate(c, make_cal(4, cores=64))
    crowded = estimate(c, make_cal(4, cores=2))
    fit = make_cal(4).cluster.link("all_reduce", 4, False)
    P = 1000 + 8 * PARAM
    assert crowded.parts["dp_comm"] == pytest.approx(fit.time(P))
    assert roomy.parts["dp_comm"] < crowded.parts["dp_comm"]


def _with_fsdp(cal: Calibration, probes: dict[str, FsdpOverhead], count: int) -> Calibration:
    layers = tuple(dataclasses.replace(e, param_count=count) for e in cal.model.layers)
    model = dataclasses.replace(cal.model, layers=layers)
    return dataclasses.replace(
        cal, model=model, cluster=dataclasses.replace(cal.cluster, fsdp=probes)
    )


def test_stage3_pays_the_probed_fsdp_overhead_per_unit_round_and_parameter() -> None:
    probe = FsdpOverhead(unit_forward_s=0.01, unit_backward_s=0.02, param_step_s=0.001)
    base = make_cal(4, cores=2)
    cal = _with_fsdp(base, {fsdp_key(1, 4): probe}, count=3)
    c = Candidate(1, 1, 1, 4, 3, 2, 2, False)  # 2 micro-batches, no pipeline
    est = estimate(c, cal)
    units = 8 + 1  # the blocks, and the root holding the tied embedding
    P = 1000 + 8 * PARAM
    ag, rs = (cal.cluster.link(op, 4, False) for op in ("all_gather", "reduce_scatter"))
    fixed = 2 * units * (0.01 + 0.02)
    bytes_part = 2 * 2 * ag.beta_s_per_byte * P / 4 + rs.beta_s_per_byte * P  # crowded: no overlap
    assert est.parts["sharding_comm"] == pytest.approx(fixed + bytes_part)
    params = 3 * 9  # the tied entries stored once
    plain = estimate(c, base)
    assert est.parts["optimizer"] == pytest.approx(plain.parts["optimizer"] + 0.001 * params)
    # stages 1/2 are untouched by the probe
    s1 = Candidate(1, 1, 1, 4, 1, 2, 2, False)
    assert estimate(s1, cal).step_s == pytest.approx(estimate(s1, base).step_s)


def test_a_pipeline_pays_fsdp_unit_overhead_once_per_step() -> None:
    probe = FsdpOverhead(unit_forward_s=0.01, unit_backward_s=0.02, param_step_s=0.0)
    cal = _with_fsdp(make_cal(4, cores=2), {fsdp_key(1, 2): probe}, count=1)
    one = estimate(Candidate(1, 1, 2, 2, 3, 4, 1, False), cal).parts["sharding_comm"]
    four = estimate(Candidate(1, 1, 2, 2, 3, 1, 4, False), cal).parts["sharding_comm"]
    assert one == pytest.approx(four, rel=1e-6)  # the gathered parameters stay for the step


def test_fsdp_overhead_of_an_unmeasured_shape_is_the_nearest() -> None:
    a = FsdpOverhead(0.001, 0.002, 0.0)
    b = FsdpOverhead(0.004, 0.008, 0.0)
    cl = dataclasses.replace(make_cal(8).cluster, fsdp={fsdp_key(1, 2): a, fsdp_key(1, 4): b})
    assert cl.fsdp_overhead(1, 4) is b
    assert cl.fsdp_overhead(2, 2) is a and cl.fsdp_overhead(1, 8) is b
    assert dataclasses.replace(cl, fsdp={}).fsdp_overhead(1, 2) is None
    assert ClusterProfile.from_dict(dataclasses.asdict(cl)) == cl
