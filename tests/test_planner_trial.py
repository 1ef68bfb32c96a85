"""``python -m fleet.planner.trial``: one candidate configuration run for a few steps through
the real job path under fleetrun (world 2, gloo, a tiny GPT), for data, pipeline, tensor and
sharding-stage-3 parallelism and gradient merge; the result file is complete and the loss finite.
A strategy fleet refuses exits non-zero with the message."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_fleetrun

TINY_GPT = {
    "PLAN_GPT_HIDDEN": "32",
    "PLAN_GPT_LAYERS": "2",
    "PLAN_GPT_SEQ": "8",
    "PLAN_GPT_VOCAB": "64",
}
GLOBAL_BATCH = 8

CASES = {
    "dp2": {"hybrid_configs": {"dp_degree": 2}, "pipeline_configs": {"micro_batch_size": 4}},
    "pp2": {
        "hybrid_configs": {"pp_degree": 2},
        "pipeline": True,
        "pipeline_configs": {"micro_batch_size": 4, "accumulate_steps": 2},
        "recompute": True,
    },
    "mp2": {"hybrid_configs": {"mp_degree": 2}, "pipeline_configs": {"micro_batch_size": 8}},
    "sharding2_s3": {
        "hybrid_configs": {"sharding_degree": 2},
        "sharding": True,
        "sharding_configs": {"stage": 3},
        "pipeline_configs": {"micro_batch_size": 4},
    },
    "dp2_merge2": {
        "hybrid_configs": {"dp_degree": 2},
        "pipeline_configs": {"micro_batch_size": 2, "accumulate_steps": 2},
        "gradient_merge": True,
        "gradient_merge_configs": {"k_steps": 2, "avg": True},
    },
}


def _trial(tmp_path: Path, name: str, strategy: dict) -> tuple[object, Path]:
    spec = {
        "model": "examples.planner.gpt:model",
        "sample": "examples.planner.gpt:sample",
        "global_batch_size": GLOBAL_BATCH,
        "optimizer": "adamw",
        "lr": 1e-3,
        "path": [str(REPO)],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(strategy))
    out = tmp_path / f"{name}.json"
    r = run_fleetrun(
        "--nproc_per_node", "2", "--backend", "gloo", "--log_dir", str(tmp_path / f"log_{name}"),
        "--strategy", str(tmp_path / f"{name}.yaml"),
        "-m", "fleet.planner.trial", "--spec", str(tmp_path / "spec.json"),
        "--steps", "3", "--warmup", "1", "--out", str(out),
        timeout=100, env=TINY_GPT,
    )  # fmt: skip
    return r, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name",
    # dp2 stays in the quick suite; the four other jobs (about 15 s each here) are slow
    [n if n == "dp2" else pytest.param(n, marks=pytest.mark.slow) for n in CASES],
)
def test_trial_runs_the_candidate_and_writes_a_complete_result(tmp_path: Path, name: str) -> None:
    r, out = _trial(tmp_path, name, CASES[name])
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / f"log_{name}").glob("workerlog.*")))
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{logs}"
    res = json.loads(out.read_text())
    # the last line rank 0 prints is the same JSON
    last = [ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1]
    assert json.loads(last) == res
    assert len(res["step_s"]) == 3 and all(t > 0 for t in res["step_s"])
    assert min(res["step_s"]) <= res["median_step_s"] <= max(res["step_s"])
    keys = ("peak_bytes", "state_bytes", "activation_peak_bytes", "memory_parts")
    keys += ("gathered_and_activation_peak_bytes", "transient_bytes")
    for key in keys:
        assert len(res[key]) == 2, key
    for peak, state, act, parts, both, transient in zip(*(res[k] for k in keys), strict=True):
        assert act > 0 and both >= act
        assert peak == state + max(both, transient)
        assert state == sum(parts.values())
        assert parts["params"] > 0 and parts["grads"] > 0
        assert parts["optimizer"] == pytest.approx(2 * parts["params"], rel=0.01)  # AdamW
    # warm-up + timed + the metered step
    assert len(res["loss"]) == 5 and all(math.isfinite(x) for x in res["loss"])
    strategy = CASES[name]
    for key, value in strategy["hybrid_configs"].items():
        assert res["strategy"][f"hybrid_configs.{key}"] == value
    parts0, parts1 = res["memory_parts"]
    if name == "mp2":  # each rank holds about half of the tensor-parallel weights
        assert parts0["params"] == parts1["params"]
    if name == "sharding2_s3":  # FSDP2: each rank holds half of every parameter
        assert parts0["params"] == parts1["params"]
        # the parameters gathered for the forward count apart from the activations
        assert res["gathered_and_activation_peak_bytes"][0] > res["activation_peak_bytes"][0]
    if name.startswith("dp2"):  # DDP's gradient buckets
        assert parts0["buffers"] == parts0["grads"]
    if name == "pp2":  # two stages, different parameters
        assert parts0["params"] != parts1["params"]


@pytest.mark.timeout(120)
def test_a_refused_strategy_exits_non_zero_with_the_message(tmp_path: Path) -> None:
    # micro-batching that does not add up to the global batch
    bad = {"hybrid_configs": {"dp_degree": 2}, "pipeline_configs": {"micro_batch_size": 3}}
    r, out = _trial(tmp_path, "bad", bad)
    logs = "\n".join(p.read_text() for p in (tmp_path / "log_bad").glob("workerlog.*"))
    assert r.returncode != 0
    assert "ConfigError" in logs and "global batch is 8" in logs, logs
    assert not out.exists()
