"""fleet.DistributedStrategy: typed sections, dict merge, errors with key paths, YAML round-trip,
printing, validation; not-landed features refused where a strategy is used (pure, one process:
every fleet.init call here fails before a process group would be created)."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest
import yaml

import fleet
from collective.env import read_worker_env
from collective.errors import ConfigError, FleetError, FleetNotImplementedError
from fleet.base.role_maker import PaddleCloudRoleMaker
from fleet.strategy import DistributedStrategy
from fleet.strategy.configs import AmpDtype, HybridConfig, PipelineSchedule
from fleet.util import shard_files


@pytest.mark.timeout(30)
def test_defaults_are_paddles() -> None:
    s = DistributedStrategy()
    assert s.amp is False and s.gradient_merge is False and s.sharding is False
    assert s.fuse_grad_size_in_MB == 32 and s.find_unused_parameters is False
    assert s.amp_configs.init_loss_scaling == 32768.0 and s.amp_configs.dtype is AmpDtype.FLOAT16
    assert s.gradient_merge_configs.k_steps == 1 and s.gradient_merge_configs.avg is True
    assert s.hybrid_configs == HybridConfig(
        dp_degree=-1, mp_degree=1, pp_degree=1, sharding_degree=1
    )
    assert s.pipeline_configs.schedule_mode is PipelineSchedule.ONE_F_ONE_B
    assert s.lars_configs.lars_coeff == 0.001 and s.lamb_configs.lamb_weight_decay == 0.01
    assert s.hybrid_configs["dp_degree"] == -1  # Paddle-style read access


@pytest.mark.timeout(30)
def test_every_config_field_has_a_docstring() -> None:
    import ast

    import fleet.strategy as strategy_mod
    import fleet.strategy.configs as configs_mod

    missing = []
    for mod in (strategy_mod, configs_mod):
        tree = ast.parse(Path(mod.__file__).read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            body = cls.body
            for i, node in enumerate(body):
                if (
                    isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Name)
                    and not ast.unparse(node.annotation).startswith("ClassVar")
                ):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    has_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    if not has_doc:
                        missing.append(f"{cls.name}.{node.target.id}")
    assert not missing


@pytest.mark.timeout(30)
def test_attribute_setting_merges_dicts_into_typed_sections() -> None:
    s = DistributedStrategy()
    s.amp = True
    s.hybrid_configs = {"dp_degree": 2}
    s.hybrid_configs = {"mp_degree": 1}  # a later dict keeps the earlier keys (Paddle semantics)
    assert s.hybrid_configs.dp_degree == 2 and s.hybrid_configs.mp_degree == 1
    s.amp_configs = {"dtype": "bfloat16", "custom_white_list": ["matmul"], "incr_ratio": 3}
    assert s.amp_configs.dtype is AmpDtype.BFLOAT16
    assert s.amp_configs.custom_white_list == ("matmul",)
    assert s.amp_configs.incr_ratio == 3.0 and isinstance(s.amp_configs.incr_ratio, float)
    s.pipeline_configs = {"schedule_mode": "FThenB", "accumulate_steps": 4}
    assert s.pipeline_configs.schedule_mode is PipelineSchedule.F_THEN_B
    s.hybrid_configs = HybridConfig(dp_degree=4)  # a whole section object replaces
    assert s.hybrid_configs.dp_degree == 4
    # keyword construction takes dicts too
    t = DistributedStrategy(gradient_merge=True, gradient_merge_configs={"k_steps": 4})
    assert t.gradient_merge_configs.k_steps == 4 and t.gradient_merge_configs.avg is True


@pytest.mark.timeout(30)
def test_sections_are_immutable() -> None:
    s = DistributedStrategy()
    with pytest.raises(FrozenInstanceError):
        s.hybrid_configs.dp_degree = 2  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"strategy.hybrid_configs = \{'dp_degree': 2\}"):
        s.hybrid_configs["dp_degree"] = 2  # type: ignore[index]


@pytest.mark.parametrize(
    ("attr", "value", "message"),
    [
        (
            "hybrid_configs",
            {"dp_degre": 2},
            r"^hybrid_configs\.dp_degre: unknown key .*allowed keys: dp_degree, mp_degree, "
            + r"pp_degree, sharding_degree",
        ),
        ("hybrid_configs", {"dp_degree": "two"}, r"^hybrid_configs\.dp_degree: .*integer.*'two'"),
        ("hybrid_configs", {"mp_degree": 1.5}, r"^hybrid_configs\.mp_degree: .*integer.*1\.5"),
        ("hybrid_configs", [("dp_degree", 2)], r"^hybrid_configs: expected a dict"),
        ("amp", 3, r"^amp: expected true/false, got 3"),
        ("amp_configs", {"dtype": "int8"}, r"^amp_configs\.dtype: .*'int8'.*float16.*bfloat16"),
        (
            "amp_configs",
            {"custom_black_list": 5},
            r"^amp_configs\.custom_black_list: expected a list",
        ),
        (
            "pipeline_configs",
            {"schedule_mode": "GPipe"},
            r"^pipeline_configs\.schedule_mode: .*1F1B",
        ),
        ("dp_degre", 2, r"^dp_degre: unknown key.*allowed keys: amp, amp_configs"),
        (
            "dp_degree",
            2,
            r"^dp_degree: unknown key; it belongs to hybrid_configs: "
            + r"strategy.hybrid_configs = \{'dp_degree': 2\}",
        ),
        ("fuse_grad_size_in_MB", "big", r"^fuse_grad_size_in_MB: expected an integer"),
    ],
)
@pytest.mark.timeout(30)
def test_unknown_keys_and_wrong_types_name_the_key_path(
    attr: str, value: object, message: str
) -> None:
    s = DistributedStrategy()
    with pytest.raises(ConfigError, match=message):
        setattr(s, attr, value)
    assert s == DistributedStrategy()  # a refused assignment changes nothing


@pytest.mark.parametrize(
    ("attr", "value", "message"),
    [
        (
            "gradient_merge_configs",
            {"k_steps": 0},
            r"^gradient_merge_configs\.k_steps: must be >= 1, got 0",
        ),
        ("hybrid_configs", {"dp_degree": 0}, r"^hybrid_configs\.dp_degree: must be -1 .* got 0"),
        ("hybrid_configs", {"pp_degree": -1}, r"^hybrid_configs\.pp_degree: must be >= 1, got -1"),
        ("amp_configs", {"decr_ratio": 1.5}, r"^amp_configs\.decr_ratio: .*between 0 and 1"),
        (
            "amp_configs",
            {"custom_white_list": ["a"], "custom_black_list": ["a"]},
            r"^amp_configs\.custom_white_list: ops \['a'\] are in both",
        ),
        ("sharding_configs", {"stage": 4}, r"^sharding_configs\.stage: must be 1, 2 or 3, got 4"),
        ("a_sync_configs", {"k_steps": -2}, r"^a_sync_configs\.k_steps: must be -1"),
        ("lars_configs", {"lars_coeff": 0.0}, r"^lars_configs\.lars_coeff: must be > 0"),
        ("fuse_grad_size_in_MB", 0, r"^fuse_grad_size_in_MB: must be >= 1"),
    ],
)
@pytest.mark.timeout(30)
def test_values_are_validated(attr: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        setattr(DistributedStrategy(), attr, value)


@pytest.mark.timeout(30)
def test_hybrid_degrees_must_multiply_to_world_size() -> None:
    assert HybridConfig().resolve_dp_degree(4) == 4
    assert HybridConfig(dp_degree=2, mp_degree=2).resolve_dp_degree(4) == 2
    with pytest.raises(ConfigError, match=r"dp_degree\(3\) \* mp_degree\(1\) .* world size 2"):
        HybridConfig(dp_degree=3).resolve_dp_degree(2)


@pytest.mark.timeout(30)
def test_dict_and_yaml_round_trip(tmp_path: Path) -> None:
    s = DistributedStrategy()
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": 4, "avg": False}
    s.amp_configs = {"dtype": "bfloat16", "custom_black_list": ["softmax", "layer_norm"]}
    s.recompute_configs = {"checkpoints": ["block.0", "block.1"]}
    s.fuse_grad_size_in_MB = 64
    d = s.to_dict()
    assert d["amp_configs"]["dtype"] == "bfloat16" and d["amp_configs"]["custom_black_list"] == [
        "softmax",
        "layer_norm",
    ]
    assert DistributedStrategy.from_dict(d) == s
    path = tmp_path / "s.yaml"
    path.write_text(s.to_yaml())
    assert DistributedStrategy.from_yaml(path) == s
    # a hand-written file lists only what differs; a job spec's `strategy:` wrapper is accepted
    path.write_text("strategy:\n  gradient_merge: true\n  gradient_merge_configs: {k_steps: 2}\n")
    loaded = DistributedStrategy.from_yaml(path)
    assert loaded.gradient_merge and loaded.gradient_merge_configs.k_steps == 2
    assert loaded.gradient_merge_configs.avg is True
    # the example config loads
    repo = Path(__file__).resolve().parent.parent
    assert DistributedStrategy.from_yaml(repo / "configs" / "strategy_dp.yaml").gradient_merge


@pytest.mark.timeout(30)
def test_loading_errors_name_the_key_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^lamb_configs\.lamb_weight_decy: unknown key"):
        DistributedStrategy.from_dict({"lamb_configs": {"lamb_weight_decy": 0.1}})
    with pytest.raises(ConfigError, match=r"^sharding: expected true/false"):
        DistributedStrategy.from_dict({"sharding": [1]})
    with pytest.raises(ConfigError, match=r"^gradient_merge_configs\.k_steps: must be >= 1"):
        DistributedStrategy.from_dict({"gradient_merge_configs": {"k_steps": -3}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        DistributedStrategy.from_yaml(bad)
    bad.write_text("amp: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        DistributedStrategy.from_yaml(bad)
    with pytest.raises(ConfigError, match="cannot read strategy file"):
        DistributedStrategy.from_yaml(tmp_path / "missing.yaml")


@pytest.mark.timeout(30)
def test_printing_shows_non_default_settings() -> None:
    s = DistributedStrategy()
    assert "all settings at their defaults" in str(s)
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": 4}
    s.amp_configs = {"custom_white_list": ["matmul", "conv2d"]}
    text = str(s)
    lines = text.splitlines()
    assert lines[0].startswith("DistributedStrategy")
    rows = {line.split()[0]: line.split(None, 1)[1] for line in lines[3:]}
    assert rows == {
        "amp_configs.custom_white_list": "[matmul, conv2d]",
        "gradient_merge": "True",
        "gradient_merge_configs.k_steps": "4",
    }
    assert "amp " not in text  # defaults stay out of the table
    assert repr(s).startswith("DistributedStrategy(")
    assert "gradient_merge_configs.k_steps=4" in repr(s)


@pytest.mark.timeout(30)
def test_file_shard_is_contiguous_with_extras_first() -> None:
    files = [f"f{i}" for i in range(10)]
    shards = [shard_files(files, r, 4) for r in range(4)]
    assert shards == [["f0", "f1", "f2"], ["f3", "f4", "f5"], ["f6", "f7"], ["f8", "f9"]]
    assert [shard_files(["a", "b"], r, 3) for r in range(3)] == [["a"], ["b"], []]
    with pytest.raises(ConfigError, match="expected a list of file names"):
        shard_files("abc", 0, 1)


@pytest.mark.timeout(60)
def test_api_before_init_is_a_clear_error() -> None:
    for call in (
        fleet.worker_index,
        fleet.worker_num,
        fleet.is_first_worker,
        fleet.local_rank,
        fleet.worker_endpoints,
        fleet.barrier_worker,
    ):
        with pytest.raises(FleetError, match=r"before fleet.init\(\); call fleet.init"):
            call()
    with pytest.raises(FleetError, match=r"distributed_model\(\) was called before fleet.init"):
        fleet.distributed_model(None)  # type: ignore[arg-type]
    with pytest.raises(FleetError, match=r"get_file_shard\(\) was called before fleet.init"):
        fleet.util.get_file_shard(["a"])


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"tensor_parallel": True}, "strategy.tensor_parallel"),
    ],
)
@pytest.mark.timeout(60)
def test_features_not_landed_raise_when_used(settings: dict, named: str) -> None:
    import torch

    s = DistributedStrategy.from_dict(settings)  # constructing and setting is fine
    with pytest.raises(FleetNotImplementedError, match=r"is not implemented yet") as err:
        fleet.init(is_collective=True, strategy=s)
    assert named in str(err.value) and "fleet.init" in str(err.value)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(FleetNotImplementedError, match="fleet.distributed_optimizer") as err:
        fleet.distributed_optimizer(opt, strategy=s)
    assert named in str(err.value)


@pytest.mark.timeout(60)
def test_parameter_server_mode_needs_servers_and_a_sync_needs_it() -> None:
    with pytest.raises(ConfigError, match=r"parameter-server mode needs servers"):
        fleet.init(is_collective=False)
    with pytest.raises(ConfigError, match="parameter-server mode needs servers"):
        fleet.init(PaddleCloudRoleMaker())  # Paddle's fleet.init(role); its default is PS mode
    with pytest.raises(ConfigError, match="^a_sync: strategy.a_sync is a parameter-server setting"):
        fleet.init(is_collective=True, strategy=DistributedStrategy(a_sync=True))
    with pytest.raises(ConfigError, match="is_collective: expected True or False"):
        fleet.init(is_collective="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^strategy: expected a fleet.DistributedStrategy"):
        fleet.init(strategy={"amp": True})  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_job_strategy_file_and_explicit_strategy_must_agree(tmp_path: Path) -> None:
    path = tmp_path / "job_strategy.yaml"
    path.write_text(yaml.safe_dump({"fuse_grad_size_in_MB": 16}))
    env = replace(read_worker_env({}), strategy_file=str(path))
    role = PaddleCloudRoleMaker(is_collective=True, env=env)
    with pytest.raises(ConfigError, match=r"^strategy: the job's strategy file .* differ"):
        fleet.init(role_maker=role, strategy=DistributedStrategy(fuse_grad_size_in_MB=8))
    # the file alone is used (and its not-landed features are refused like any strategy's)
    path.write_text(yaml.safe_dump({"tensor_parallel": True}))
    with pytest.raises(FleetNotImplementedError, match="strategy.tensor_parallel"):
        fleet.init(role_maker=PaddleCloudRoleMaker(is_collective=True, env=env))
