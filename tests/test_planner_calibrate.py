"""The planner's calibration: loading the user's model (and its errors), the per-entry profile,
the collective fits, a real calibration job under fleetrun, and the calibration cache."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, run_fleetrun

from collective.errors import ConfigError
from fleet.planner import cache
from fleet.planner.types import (
    Calibration,
    ClusterProfile,
    LayerProfile,
    Linear,
    LinkFit,
    ModelProfile,
    ModelSpec,
    Plan,
)

TINY_GPT = {
    "PLAN_GPT_HIDDEN": "32",
    "PLAN_GPT_LAYERS": "2",
    "PLAN_GPT_SEQ": "8",
    "PLAN_GPT_VOCAB": "64",
    "PLAN_GPT_HEADS": "4",
}
TINY_MLP = {"PLAN_MLP_WIDTH": "16", "PLAN_MLP_BLOCKS": "3"}

USER_MODULE = """
import torch
from torch import nn

from fleet.meta_parallel import LayerDesc


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(8) for _ in range(3)])
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        raise RuntimeError("layer init exploded")


def broken(mp_group=None):
    return 1 / 0


def no_loss():
    return [LayerDesc(nn.Linear, 4, 4)]


def plain_module(hcg=None):
    return Net(), nn.MSELoss()


def sequential(mp_group=None):
    return nn.Sequential(nn.Linear(4, 8), Block(8), Block(8), nn.Linear(8, 1))


def exploding_layers():
    return [LayerDesc(nn.Linear, 4, 4), LayerDesc(Exploding)], nn.MSELoss()


def loss(mp_group=None):
    return nn.MSELoss()


def sample(batch_size):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 1)


def bad_sample(batch_size):
    raise ValueError(f"no data for {batch_size}")
"""


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("usermods")
    (d / "planner_user_models.py").write_text(USER_MODULE)
    return str(d)


def _spec(user_dir: str, model: str, **kw: object) -> ModelSpec:
    return ModelSpec(
        model=f"planner_user_models:{model}",
        sample=str(kw.pop("sample", "planner_user_models:sample")),
        global_batch_size=int(kw.pop("global_batch_size", 8)),  # type: ignore[call-overload]
        path=(user_dir,),
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[object]:
    """A gloo process group of one rank and an mp group of size 1 (in this process)."""
    import torch.distributed as tdist

    from collective.env import find_free_port

    made = not tdist.is_initialized()
    if made:
        tdist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1
        )
    group = tdist.new_group([0])
    yield group
    if made:
        tdist.destroy_process_group()


# ---- spec: loading the user's functions ------------------------------------------------------


@pytest.mark.timeout(60)
def test_missing_module_and_function_name_the_flag(user_dir: str) -> None:
    from fleet.planner.spec import load_function

    with pytest.raises(ConfigError, match=r"--model.*no_such_module_xyz.*not found"):
        load_function("no_such_module_xyz:model", "model")
    with pytest.raises(ConfigError, match=r"--sample.*has no function 'nothere'"):
        load_function("planner_user_models:nothere", "sample", (user_dir,))
    with pytest.raises(ConfigError, match="pkg.module:function"):
        load_function("no_colon_here", "model")
    assert sys.path[0] == user_dir  # the spec's path goes first


@pytest.mark.timeout(60)
def test_model_function_failure_carries_traceback_and_context(user_dir: str) -> None:
    from fleet.planner.spec import PlannerModelError, build_model, sample_batch

    with pytest.raises(PlannerModelError) as info:
        build_model(_spec(user_dir, "broken"), None)
    msg = str(info.value)
    assert "the model function planner_user_models:broken failed while the planner built it" in msg
    assert "at mp_degree=1" in msg
    assert "ZeroDivisionError" in msg and "return 1 / 0" in msg  # the user's traceback
    assert isinstance(info.value, ConfigError)

    with pytest.raises(PlannerModelError, match=r"(?s)batch of 3.*no data for 3"):
        sample_batch(_spec(user_dir, "sequential", sample="planner_user_models:bad_sample"), 3)


@pytest.mark.timeout(60)
def test_layer_construction_failure_is_a_planner_model_error(user_dir: str) -> None:
    from fleet.planner.profile import build_stage
    from fleet.planner.spec import PlannerModelError, build_model

    spec = _spec(user_dir, "exploding_layers")
    built = build_model(spec, None)
    with pytest.raises(PlannerModelError, match=r"(?s)at mp_degree=2.*layer init exploded"):
        build_stage(spec, built, 2)


@pytest.mark.timeout(60)
def test_no_loss_says_how_to_give_one(user_dir: str) -> None:
    from fleet.planner.spec import build_model

    with pytest.raises(ConfigError, match=r"\(layers, loss_fn\).*--loss"):
        build_model(_spec(user_dir, "no_loss"), None)
    built = build_model(_spec(user_dir, "no_loss", loss="planner_user_models:loss"), None)
    assert built.layer_list and len(built.entries) == 1 and built.block_class is None


@pytest.mark.timeout(60)
def test_model_forms(user_dir: str) -> None:
    from fleet.planner.spec import build_model

    seq = build_model(_spec(user_dir, "sequential", loss="planner_user_models:loss"), None)
    assert seq.layer_list and len(seq.entries) == 4 and seq.block_class == "Block"
    plain = build_model(_spec(user_dir, "plain_module"), None, hcg=object())
    assert not plain.layer_list and len(plain.entries) == 1 and plain.block_class == "Block"


@pytest.mark.timeout(60)
def test_micro_batch_sizes_and_alpha_beta_fit() -> None:
    from fleet.planner.calibrate import micro_batch_sizes
    from fleet.planner.links import fit_alpha_beta, group_layouts

    assert micro_batch_sizes(32, 4) == [1, 8, 32]
    assert micro_batch_sizes(6, 4) == [1, 3, 6]  # 6/4 is no local batch
    assert micro_batch_sizes(1, 2) == [1]
    fit = fit_alpha_beta([(1e3, 1e-4 + 1e3 * 2e-9), (1e6, 1e-4 + 1e6 * 2e-9), (4e6, 1e-4 + 8e-3)])
    assert fit.alpha_s == pytest.approx(1e-4, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(2e-9, rel=1e-6)
    flat = fit_alpha_beta([(1e3, 2e-3), (1e6, 1e-3)])  # slower for less: beta clamps to 0
    assert flat.beta_s_per_byte == 0.0 and flat.alpha_s > 0
    assert group_layouts(4, 1, 4) == [(2, False, [[0, 1], [2, 3]]), (4, False, [[0, 1, 2, 3]])]
    two_nodes = {(k, spans): g for k, spans, g in group_layouts(4, 2, 2)}
    assert two_nodes[(2, False)] == [[0, 1], [2, 3]]
    assert two_nodes[(2, True)] == [[0, 2], [1, 3]]
    assert two_nodes[(4, True)] == [[0, 1, 2, 3]]


# ---- profile, in this process ----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_profile_tiny_gpt(world_of_one: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.planner.profile import build_stage, profile_model
    from fleet.planner.spec import build_model

    for k, v in TINY_GPT.items():
        monkeypatch.setenv(k, v)
    spec = ModelSpec(
        "examples.planner.gpt:model", "examples.planner.gpt:sample", 4, path=(str(REPO),)
    )
    prof = profile_model(spec, world_of_one, [1, 2], reps=2)
    assert prof.mp_degree == 1 and prof.layer_list and prof.block_class == "GPTBlock"
    names = [e.name for e in prof.entries]
    assert names == ["TokenEmbedding", "PositionEmbedding", "GPTBlock", "GPTBlock", "LayerNorm",
                     "TokenEmbedding"]  # fmt: skip
    for e in prof.entries:
        assert all(e.fwd_s[b] > 0 and e.bwd_s[b] > 0 for b in (1, 2)), e
    block = prof.entries[2]
    assert block.out_bytes == {1: 8 * 32 * 4, 2: 2 * 8 * 32 * 4}
    assert 0 < block.act_bytes[1] < block.act_bytes[2]
    assert prof.entries[0].shared_key == prof.entries[-1].shared_key == "embed"
    assert prof.input_bytes[2] == 2 * (2 * 8 * 8)  # int64 tokens and labels
    # parameter bytes: the whole model's, the tied embedding once
    pipe = build_stage(spec, build_model(spec, world_of_one), 1)
    total = sum(p.numel() * p.element_size() for p in pipe.parameters())
    seen: set[str] = set()
    counted = 0
    for e in prof.entries:
        if e.shared_key is not None:
            if e.shared_key in seen:
                continue
            seen.add(e.shared_key)
        counted += e.param_bytes
    assert counted == total
    assert prof.optimizer_step_s_per_byte > 0


@pytest.mark.timeout(120)
def test_profile_tiny_mlp_tensor_parallel_bytes(
    world_of_one: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleet.planner.profile import profile_model

    for k, v in TINY_MLP.items():
        monkeypatch.setenv(k, v)
    spec = ModelSpec(
        "examples.planner.mlp:model",
        "examples.planner.mlp:sample",
        8,
        optimizer="momentum",
        path=(str(REPO),),
    )
    prof = profile_model(spec, world_of_one, [2, 8], reps=2)
    assert prof.block_class == "MLPBlock"
    w = 16
    blocks = [e for e in prof.entries if e.name == "MLPBlock"]
    assert len(blocks) == 3
    # fc1 (weight and bias split by columns) + fc2's weight (split by rows; its bias is whole)
    tp = (4 * w * w + 4 * w + 4 * w * w) * 4
    norm = 2 * w * 4
    for e in blocks:
        assert e.tp_param_bytes == tp
        assert e.param_bytes == tp + w * 4 + norm
    assert prof.entries[0].tp_param_bytes == 0 and prof.entries[0].param_bytes == (w * w + w) * 4
    assert prof.entries[-1].out_bytes == {2: 2 * 4, 8: 8 * 4}
    assert all(e.fwd_s[8] > 0 and e.bwd_s[8] > 0 for e in prof.entries)
    assert prof.optimizer_step_s_per_byte > 0


@pytest.mark.timeout(120)
def test_profile_under_amp(world_of_one: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.planner.profile import profile_model
    from fleet.strategy.configs import AmpConfig

    for k, v in TINY_MLP.items():
        monkeypatch.setenv(k, v)
    spec = ModelSpec(
        "examples.planner.mlp:model", "examples.planner.mlp:sample", 4, path=(str(REPO),)
    )
    bf16 = AmpConfig(dtype="bfloat16")
    o0 = profile_model(spec, world_of_one, [4], reps=1)
    o1 = profile_model(spec, world_of_one, [4], amp="O1", amp_config=bf16, reps=1)
    o2 = profile_model(spec, world_of_one, [4], amp="O2", amp_config=bf16, reps=1)
    for prof in (o1, o2):
        assert all(e.fwd_s[4] > 0 and e.bwd_s[4] > 0 for e in prof.entries)
    # O1 keeps float32 parameters; O2 holds them in bfloat16
    assert [e.param_bytes for e in o1.entries] == [e.param_bytes for e in o0.entries]
    assert [2 * e.param_bytes for e in o2.entries] == [e.param_bytes for e in o0.entries]
    with pytest.raises(ConfigError, match="amp level"):
        profile_model(spec, world_of_one, [4], amp="O3")


def test_combine_scales_the_slowest_entries_to_the_median_whole_pass() -> None:
    from fleet.planner.calibrate import _combine
    from fleet.planner.profile import EntryFigures, MpProfile

    def rank(times: list[tuple[float, float]], whole: float) -> MpProfile:
        entries = []
        for i, (f, b) in enumerate(times):
            e = EntryFigures(f"E{i}", 8, 0, None)
            e.fwd_s, e.bwd_s = {1: f}, {1: b}
            e.act_bytes, e.out_bytes = {1: 4.0}, {1: 4.0}
            entries.append(e)
        return MpProfile(1, entries, True, None, 1e-9, {1: 8.0}, whole_pass_s={1: whole})

    # per entry, the slowest rank: (2, 1) and (1, 2), adding up to 6; the median pass is 3.5
    ranks = [rank([(1.0, 1.0), (1.0, 1.0)], 3.0), rank([(2.0, 0.5), (0.5, 2.0)], 4.0)]
    layers = _combine({1: ranks, 2: ranks})
    scale = 3.5 / 6.0
    assert layers[0].fwd_s[1].at(1) == pytest.approx(2.0 * scale)
    assert layers[0].bwd_s[1].at(1) == pytest.approx(1.0 * scale)
    assert layers[1].bwd_s[2].at(1) == pytest.approx(2.0 * scale)
    total = sum(x.fwd_s[1].at(1) + x.bwd_s[1].at(1) for x in layers)
    assert total == pytest.approx(3.5)


# ---- a calibration job ------------------------------------------------------------------------


def _run_calibrate(
    tmp_path: Path, spec: ModelSpec, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess, Path]:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    out = tmp_path / "cal.json"
    return run_fleetrun(
        "--nproc_per_node",
        "2",
        "--backend",
        "gloo",
        "--log_dir",
        str(tmp_path / "log"),
        "-m",
        "fleet.planner.calibrate",
        "--spec",
        str(spec_file),
        "--out",
        str(out),
        "--memory_per_device",
        str(1 << 30),
        timeout=170,
        env=env,
    ), out


def _calibrate_job(tmp_path: Path, spec: ModelSpec, env: dict[str, str]) -> Calibration:
    r, out = _run_calibrate(tmp_path, spec, env)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    cal = Calibration.from_dict(data)
    assert json.loads(json.dumps(cal.to_dict())) == data  # round trip
    assert Calibration.from_dict(cal.to_dict()) == cal
    return cal


def test_a_fitted_cost_is_never_negative_inside_the_measured_sizes() -> None:
    """Times that bend up with the micro-batch size (a small layer, caches) gave an
    unconstrained line with a negative intercept: zero cost at b = 1."""
    bent = Linear.fit([(1, 1e-4), (2, 6e-4), (4, 1.7e-3)])
    assert bent.a == 0.0 and bent.at(1) > 0 and bent.at(4) > bent.at(1)
    falling = Linear.fit([(1, 3.0), (2, 2.0), (4, 1.0)])
    assert falling == Linear(2.0, 0.0)
    assert Linear.fit([(1, 2.0), (2, 3.0), (4, 5.0)]) == Linear(1.0, 1.0)  # unconstrained


@pytest.mark.timeout(180)
def test_calibration_job_world_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ModelSpec(
        "examples.planner.gpt:model", "examples.planner.gpt:sample", 4, path=(str(REPO),)
    )
    # on one CPU: two ranks crowd it, so group 0 also times its pass alone (idle_speedup)
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # the job's processes inherit it
    try:
        cal = _calibrate_job(tmp_path, spec, TINY_GPT)
    finally:
        os.sched_setaffinity(0, cpus)
    model, cluster = cal.model, cal.cluster
    assert model.mp_degrees == {1: "", 2: ""}
    assert set(model.idle_speedup) == {1} and model.idle_speedup[1] >= 1.0
    assert cluster.cores_per_node == 1
    assert model.micro_batch_sizes == (1, 2, 4)
    assert model.block_class == "GPTBlock" and model.layer_list and model.amp == "O0"
    assert len(model.layers) == 6
    for layer in model.layers:
        assert set(layer.fwd_s) == set(layer.bwd_s) == set(layer.act_bytes) == {1, 2}
        assert layer.fwd_s[1].at(1) > 0 and layer.bwd_s[2].at(4) > 0
    assert model.layers[2].tp_param_bytes > 0 and model.optimizer_step_s_per_byte > 0
    assert (cluster.nnodes, cluster.nproc_per_node, cluster.world_size) == (1, 2, 2)
    assert (cluster.device, cluster.backend) == ("cpu", "gloo")
    assert cluster.memory_per_device_bytes == 1 << 30 and cluster.cores_per_node >= 1
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"):
        fit = cluster.links[f"{op}/2/intra"]
        assert fit.alpha_s >= 0 and fit.beta_s_per_byte >= 0
        assert fit.time(1 << 20) > 0
    assert set(cluster.fsdp) == {"dp1.sh2"}  # FSDP2's overhead on the one sharding mesh of 2
    probe = cluster.fsdp["dp1.sh2"]
    assert min(probe.unit_forward_s, probe.unit_backward_s, probe.param_step_s) >= 0
    assert model.layers[2].param_count > 0 and model.layers[0].param_count == 1
    for k, v in TINY_GPT.items():  # the sizes the model's source reads are in the fingerprint
        monkeypatch.setenv(k, v)
    os.sched_setaffinity(0, {min(cpus)})  # the core count is in the fingerprint too
    try:
        assert cal.fingerprint == cache.fingerprint(spec, 1, 2, "gloo", "cpu", "O0")
        monkeypatch.setenv("PLAN_GPT_HIDDEN", "64")
        assert cal.fingerprint != cache.fingerprint(spec, 1, 2, "gloo", "cpu", "O0")
    finally:
        os.sched_setaffinity(0, cpus)
    assert cal.seconds > 0


@pytest.mark.slow  # a second and third fleetrun job (~15 s each)
@pytest.mark.timeout(180)
def test_calibration_job_records_a_degree_the_model_cannot_build(tmp_path: Path) -> None:
    spec = ModelSpec(
        "examples.planner.gpt:model", "examples.planner.gpt:sample", 2, path=(str(REPO),)
    )
    cal = _calibrate_job(tmp_path, spec, {**TINY_GPT, "PLAN_GPT_HEADS": "1"})
    assert cal.model.mp_degrees[1] == ""
    assert "num_heads=1 does not divide" in cal.model.mp_degrees[2]
    assert set(cal.model.layers[2].fwd_s) == {1}


@pytest.mark.slow  # a second and third fleetrun job (~15 s each)
@pytest.mark.timeout(180)
def test_calibration_job_of_a_failing_model_fails_with_its_traceback(
    tmp_path: Path, user_dir: str
) -> None:
    r, out = _run_calibrate(tmp_path, _spec(user_dir, "broken"), {})
    assert r.returncode != 0 and not out.exists()
    text = r.stdout + r.stderr
    assert "failed while the planner built it at mp_degree=1" in text, text
    assert "ZeroDivisionError" in text


# ---- cache -----------------------------------------------------------------------------------


def _tiny_calibration(fp: str) -> Calibration:
    layer = LayerProfile(
        index=0,
        name="Block",
        param_bytes=64,
        tp_param_bytes=32,
        shared_key=None,
        fwd_s={1: Linear(1e-4, 1e-5)},
        bwd_s={1: Linear(2e-4, 2e-5)},
        act_bytes={1: Linear(0.0, 128.0)},
        out_bytes=Linear(0.0, 64.0),
    )
    model = ModelProfile(
        layers=(layer,),
        block_class="Block",
        layer_list=True,
        mp_degrees={1: ""},
        optimizer="adamw",
        optimizer_step_s_per_byte=1e-9,
        micro_batch_sizes=(1, 2),
        input_bytes=Linear(0.0, 16.0),
    )
    cluster = ClusterProfile(
        1, 2, "cpu", "gloo", 1 << 30, 2, {"all_reduce/2/intra": LinkFit(1e-4, 1e-9)}
    )
    return Calibration(model, cluster, fp, 1.5)


@pytest.mark.timeout(60)
def test_cache_round_trip_and_corrupt_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert cache.cache_dir() == tmp_path / "cache"
    assert cache.load_calibration("abc") is None
    cal = _tiny_calibration("abc")
    path = cache.save_calibration(cal)
    assert path.parent == tmp_path / "cache" and cache.load_calibration("abc") == cal
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    plan = Plan(world_size=2, global_batch_size=8, ranked=[], too_big=[], refused=[],
                memory_limit_bytes=1 << 30, fingerprint="abc")  # fmt: skip
    cache.save_plan("abc/gpt", plan)
    assert cache.load_plan("abc/gpt") == plan

    path.write_text('{"model": {"layers": [')  # cut short
    with caplog.at_level(logging.WARNING, logger="fleet.planner.cache"):
        assert cache.load_calibration("abc") is None
    assert "does not parse" in caplog.text
    cache.plan_path("abc/gpt").write_text('{"world_size": 2}')  # parses, fields missing
    assert cache.load_plan("abc/gpt") is None


@pytest.mark.timeout(60)
def test_fingerprint_follows_the_model_source(tmp_path: Path) -> None:
    mod = tmp_path / "fp_user_model.py"
    mod.write_text("def model():\n    return []\n")
    spec = ModelSpec("fp_user_model:model", "fp_user_model:model", 8, path=(str(tmp_path),))
    a = cache.fingerprint(spec, 1, 2, "gloo", "cpu", "O0")
    assert a == cache.fingerprint(spec, 1, 2, "gloo", "cpu", "O0")
    assert a != cache.fingerprint(spec, 1, 4, "gloo", "cpu", "O0")
    assert a != cache.fingerprint(spec, 1, 2, "gloo", "cpu", "O1")
    mod.write_text("def model():\n    return [1]\n")
    assert a != cache.fingerprint(spec, 1, 2, "gloo", "cpu", "O0")
    assert "fp_user_model" not in sys.modules  # read, not imported


@pytest.mark.timeout(60)
def test_cache_imports_no_torch() -> None:
    code = "import sys, fleet.planner.cache; assert 'torch' not in sys.modules, 'torch loaded'"
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert r.returncode == 0, r.stderr
