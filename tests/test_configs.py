"""Every file in configs/ loads and validates (job files as JobSpec, strategies as
DistributedStrategy)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO

from fleet.strategy import DistributedStrategy
from launcher.spec import build_spec, load_yaml

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_file_is_valid(path: Path) -> None:
    data = load_yaml(str(path))
    if path.name.startswith("strategy_"):
        DistributedStrategy.from_yaml(str(path))
        return
    spec = build_spec(data)
    assert spec.entrypoint.script or spec.entrypoint.module
    if spec.entrypoint.script:
        assert (REPO / spec.entrypoint.script).exists(), spec.entrypoint.script
    if isinstance(spec.strategy, dict):
        DistributedStrategy.from_dict(spec.strategy)
    elif isinstance(spec.strategy, str):
        DistributedStrategy.from_yaml(str(REPO / spec.strategy))


def test_there_are_configs() -> None:
    assert any(p.name == "dp_local.yaml" for p in CONFIGS)
