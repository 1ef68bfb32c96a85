"""``fleetrun plan`` and ``DistributedStrategy(auto=True)`` as a user runs them: real fleetrun
processes (the calibration and trial jobs are gloo jobs of 2 ranks), a tiny GPT
(``examples/planner/gpt.py`` sized by PLAN_GPT_*), the cache in the test's directory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SCRIPTS, base_env

from collective.errors import ConfigError
from fleet.planner import auto
from fleet.planner.types import Candidate
from fleet.strategy import DistributedStrategy

GPT = ["--model", "examples.planner.gpt:model", "--sample", "examples.planner.gpt:sample"]
PLAIN = [
    "--model",
    "tests.scripts.planner_models:plain",
    "--sample",
    "tests.scripts.planner_models:sample",
]
TINY_GPT = {
    "PLAN_GPT_HIDDEN": "32",
    "PLAN_GPT_LAYERS": "2",
    "PLAN_GPT_SEQ": "8",
    "PLAN_GPT_VOCAB": "64",
}


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = base_env()
    env.update(TINY_GPT)
    env["FLEETRUN_CACHE_DIR"] = str(cache)
    env.update(extra)
    return env


def _fleetrun(
    args: list[str], env: dict[str, str], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _plan(
    tmp: Path, name: str, args: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    base = ["plan", "--nproc_per_node", "2", "--backend", "gloo", "--log_dir", str(tmp / name)]
    return _fleetrun(base + args, env)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One planner cache for the module: calibrations made by one test serve the next."""
    return tmp_path_factory.mktemp("planner-cache")


@pytest.mark.timeout(300)
def test_plan_ranks_explains_caches_and_applies(tmp_path: Path, cache: Path) -> None:
    env = _env(cache)
    args = [*GPT, "--global_batch_size", "8", "--top", "5"]
    t0 = time.monotonic()
    first = _plan(tmp_path, "p1", [*args, "--json", str(tmp_path / "plan.json")], env)
    first_s = time.monotonic() - t0
    assert first.returncode == 0, first.stderr + first.stdout
    out = first.stdout
    assert "calibration: measured" in out
    assert "dp  mp  pp" in out and "step ms" in out, out
    assert "why dp" in out and "pp " in out and "recompute" in out
    assert "plan cached as" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["ranked"]

    t0 = time.monotonic()
    second = _plan(tmp_path, "p2", [*args, "--apply", str(tmp_path / "job.yaml")], env)
    second_s = time.monotonic() - t0
    assert second.returncode == 0, second.stderr + second.stdout
    assert "calibration: cached" in second.stdout
    assert second_s < first_s, (first_s, second_s)

    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    chosen = Candidate.from_dict(plan["ranked"][0]["candidate"])
    assert job["strategy"]["hybrid_configs"]["dp_degree"] == chosen.dp
    assert job["sizes"] == {"nnodes": 1, "nproc_per_node": 2}
    DistributedStrategy.from_dict(job["strategy"])  # a valid strategy as written
    run = _fleetrun(["-c", str(tmp_path / "job.yaml")], env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "job.result.json").read_text())
    assert result["median_step_s"] > 0


@pytest.mark.timeout(300)
def test_apply_with_a_job_file_keeps_its_keys_and_replaces_the_strategy(
    tmp_path: Path, cache: Path
) -> None:
    base_job = {
        "name": "mine",
        "entrypoint": {"script": "examples/dp/train.py", "args": ["--steps", "3"]},
        "sizes": {"nnodes": 1, "nproc_per_node": 2},
        "backend": "gloo",
        "max_restarts": 1,
        "strategy": {"gradient_merge": True, "fuse_grad_size_in_MB": 16},
    }
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base_job))
    args = ["plan", "-c", str(tmp_path / "base.yaml"), *GPT, "--global_batch_size", "8"]
    args += ["--log_dir", str(tmp_path / "log"), "--apply", str(tmp_path / "out.yaml")]
    proc = _fleetrun(args, _env(cache))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    job = yaml.safe_load((tmp_path / "out.yaml").read_text())
    assert job["name"] == "mine" and job["max_restarts"] == 1
    assert job["entrypoint"] == base_job["entrypoint"]
    strategy = job["strategy"]
    assert strategy["fuse_grad_size_in_MB"] == 16  # the base strategy's own keys stay
    assert "hybrid_configs" in strategy and strategy["tensor_parallel"] is False
    assert strategy["gradient_merge"] == (
        strategy["hybrid_configs"]["pp_degree"] == 1
        and strategy["pipeline_configs"]["accumulate_steps"] > 1
    )


@pytest.mark.timeout(120)
def test_model_function_that_raises_shows_its_traceback_under_the_planner_context(
    tmp_path: Path, cache: Path
) -> None:
    args = ["--model", "tests.scripts.planner_models:broken", "--sample"]
    args += ["tests.scripts.planner_models:sample", "--global_batch_size", "8"]
    proc = _plan(tmp_path, "broken", args, _env(cache))
    assert proc.returncode == 2, proc.stderr + proc.stdout
    err = proc.stderr
    assert "fleetrun plan: the calibration job failed" in err
    assert "tests.scripts.planner_models:broken failed while the planner built it" in err
    assert "this model function fails on purpose" in err and "planner_models.py" in err


@pytest.mark.timeout(120)
def test_missing_module_is_named_before_any_job(tmp_path: Path, cache: Path) -> None:
    args = ["--model", "tests.scripts.no_such_module:model", "--sample"]
    args += ["tests.scripts.planner_models:sample", "--global_batch_size", "8"]
    proc = _plan(tmp_path, "missing", args, _env(cache))
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "--model" in proc.stderr and "tests.scripts.no_such_module" in proc.stderr
    assert not (tmp_path / "missing" / "calibrate").exists()


@pytest.mark.timeout(120)
def test_global_batch_no_replica_count_divides(tmp_path: Path, cache: Path) -> None:
    # a plain nn.Module: no pipeline, no tensor parallelism; world 2 leaves 2 data replicas
    proc = _plan(tmp_path, "batch", [*PLAIN, "--global_batch_size", "7"], _env(cache))
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "global batch 7" in proc.stderr and "6, 8" in proc.stderr


@pytest.mark.timeout(120)
def test_memory_too_small_says_what_is_short(tmp_path: Path, cache: Path) -> None:
    # the GPT of the first test: its calibration is in the module's cache
    args = [*GPT, "--global_batch_size", "8", "--memory_per_device", "1KB"]
    proc = _plan(tmp_path, "memory", args, _env(cache))
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "no configuration fits" in proc.stderr and "short by" in proc.stderr
    assert "closest" in proc.stderr
    assert "none fits; the closest by memory:" in proc.stdout  # the table of what came closest


@pytest.mark.timeout(60)
def test_bad_memory_size_and_multinode_without_calibration(tmp_path: Path, cache: Path) -> None:
    proc = _plan(
        tmp_path,
        "size",
        [*PLAIN, "--global_batch_size", "8", "--memory_per_device", "lots"],
        _env(cache),
    )
    assert proc.returncode == 2 and "4GB" in proc.stderr, proc.stderr
    args = ["plan", "--nnodes", "2", "--nproc_per_node", "2", "--backend", "gloo", *PLAIN]
    args += ["--global_batch_size", "8", "--log_dir", str(tmp_path / "multi")]
    proc = _fleetrun(args, _env(cache))
    assert proc.returncode == 2, proc.stderr
    assert "fleet.planner.calibrate" in proc.stderr and "--calibration" in proc.stderr


def test_auto_with_hand_set_degrees_is_refused() -> None:
    s = DistributedStrategy(auto=True)
    s.auto_configs = {"model": "m:f", "sample": "m:s", "global_batch_size": 8}
    s.hybrid_configs = {"mp_degree": 2}
    with pytest.raises(ConfigError, match="hybrid_configs sets") as err:
        auto.spec_from_configs(s)
    assert err.value.key == "auto"
    s = DistributedStrategy(auto=True)
    s.auto_configs = {"model": "m:f", "global_batch_size": 8}
    with pytest.raises(ConfigError) as err:
        auto.spec_from_configs(s)
    assert err.value.key == "auto_configs.sample"


def test_plan_key_is_the_same_for_a_job_file_and_a_script_strategy() -> None:
    from_file = {"amp": True, "gradient_merge": True, "hybrid_configs": {"dp_degree": 2}}
    script = DistributedStrategy(amp=True, auto=True)
    script.auto_configs = {"model": "m:f", "sample": "m:s", "global_batch_size": 8}
    assert auto.planner_base(from_file) == auto.planner_base(script) == {"amp": True}
    assert auto.plan_key("fp", None, from_file, 8) == auto.plan_key("fp", None, script.to_dict(), 8)
    assert auto.plan_key("fp", None, from_file, 8) != auto.plan_key("fp", 1 << 20, from_file, 8)
    assert auto.amp_level({"amp": True, "amp_configs": {"use_pure_fp16": True}}) == "O2"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_verify_measures_the_top_candidates(tmp_path: Path, cache: Path) -> None:
    args = [*GPT, "--global_batch_size", "8", "--verify", "2", "--verify_steps", "3"]
    args += ["--json", str(tmp_path / "plan.json")]
    proc = _plan(tmp_path, "verify", args, _env(cache))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "verified the top 2 (measured)" in proc.stdout and "measured ms" in proc.stdout
    assert "verify 2/2 " in proc.stdout and "ms/step, peak" in proc.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan["measured"]) == 2 and all(v > 0 for v in plan["measured"].values())
    # the measured candidates lead the re-ranked list: the predicted pick, unless the other
    # was measured faster beyond the trials' spread
    keys = [Candidate.from_dict(e["candidate"]).key for e in plan["ranked"][:2]]
    assert set(keys) == set(plan["measured"])
    step = {Candidate.from_dict(e["candidate"]).key: e["step_s"] for e in plan["ranked"][:2]}
    predicted_first = min(keys, key=lambda k: step[k])
    if keys[0] != predicted_first:
        assert plan["measured"][keys[0]] < plan["measured"][predicted_first]
    # the memory model against the trials' measured peaks (the fullest rank): within 15 %
    predicted = {Candidate.from_dict(e["candidate"]).key: e["memory_bytes"] for e in plan["ranked"]}
    results = sorted((tmp_path / "verify").glob("trial*/result.json"))
    assert len(results) == 2, results
    for path in results:
        key = path.parent.name.split("-", 1)[1]
        measured = max(json.loads(path.read_text())["peak_bytes"])
        assert abs(predicted[key] - measured) <= 0.15 * measured, (key, predicted[key], measured)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_auto_strategy_reproduces_the_cached_plan(tmp_path: Path) -> None:
    # a GPT and a budget for which the pick is hybrid (dp 2 does not fit 2 MiB), so that
    # fleet.init has to rebuild the hybrid groups for the plan
    env = _env(tmp_path / "cache", PLAN_GPT_HIDDEN="64")
    args = [*GPT, "--global_batch_size", "8", "--memory_per_device", "2MB"]
    args += ["--json", str(tmp_path / "plan.json")]
    proc = _plan(tmp_path, "plan", args, env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    chosen = Candidate.from_dict(plan["ranked"][0]["candidate"])
    script = [str(SCRIPTS / "planner_auto.py"), "examples.planner.gpt:model"]
    script += ["examples.planner.gpt:sample", "8", "2"]
    job = ["--nproc_per_node", "2", "--backend", "gloo", "--log_dir", str(tmp_path / "job")]
    run = _fleetrun([*job, *script], env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"fleet: auto strategy: {chosen.key} (cached plan" in run.stdout, run.stdout
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("auto degrees: "))
    degrees = json.loads(line.split(": ", 1)[1])
    assert degrees == {
        "dp": chosen.dp,
        "mp": chosen.mp,
        "pp": chosen.pp,
        "sharding": chosen.sharding,
    }
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("auto planned: "))
    planned = json.loads(line.split(": ", 1)[1])
    assert planned["micro_batch_size"] == chosen.micro_batch_size
    assert planned["recompute"] == chosen.recompute and planned["auto"] is True

    # the same through a job's strategy file, and training on the groups fleet.init rebuilt
    auto_yaml = {"auto": True, "auto_configs": {"model": GPT[1], "sample": GPT[3]}}
    auto_yaml["auto_configs"].update(global_batch_size=8, memory_per_device_MB=2)
    (tmp_path / "auto.yaml").write_text(yaml.safe_dump(auto_yaml))
    spec = {"model": GPT[1], "sample": GPT[3], "global_batch_size": 8, "path": [str(REPO)]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    job = ["--nproc_per_node", "2", "--backend", "gloo", "--log_dir", str(tmp_path / "trial")]
    job += ["--strategy", str(tmp_path / "auto.yaml"), "-m", "fleet.planner.trial"]
    job += ["--spec", str(tmp_path / "spec.json"), "--steps", "3", "--warmup", "1"]
    run = _fleetrun([*job, "--out", str(tmp_path / "result.json")], env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"fleet: auto strategy: {chosen.key} (cached plan" in run.stdout, run.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["strategy"].get("hybrid_configs.sharding_degree", 1) == chosen.sharding
    assert result["loss"][-1] < result["loss"][0]


def test_verify_changes_the_pick_only_beyond_the_trials_spread() -> None:
    from launcher.plan_jobs import clearly_faster

    base = [1.00, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97, 1.00]
    assert not clearly_faster([x - 0.002 for x in base], base)  # 0.2 %: noise
    assert clearly_faster([x - 0.1 for x in base], base)  # 10 % on a 2 % spread
    assert not clearly_faster([x + 0.1 for x in base], base)
    assert clearly_faster([0.9, 0.95], [1.0, 1.0])  # too few steps: the medians decide
