"""The files a launch writes into its ``log_dir`` before any process starts: the resolved job
(``job.yaml``, node-scoped on multi-node jobs) and the strategy file the workers read
(``FLEET_STRATEGY``). One module for every scheduler that runs processes (local, Ray), so the
files are the same whichever runs the job.
"""

from __future__ import annotations

import os

import yaml

from collective.errors import ConfigError
from launcher.spec import JobSpec, spec_to_dict

SECRET_ENV_KEYS = frozenset({"FLEET_PS_TOKEN"})
"""Environment entries never written to the log dir (job.yaml is for people to read)."""
REDACTED = "<redacted>"


def write_job_file(spec: JobSpec, name: str = "job.yaml") -> str:
    """Write the resolved job as ``log_dir/name`` (creating log_dir), secrets of its ``env:``
    replaced by ``<redacted>``; return the path."""
    os.makedirs(spec.log_dir, exist_ok=True)
    path = os.path.join(spec.log_dir, name)
    data = spec_to_dict(spec)
    env = data.get("env")
    if isinstance(env, dict):
        data["env"] = {k: REDACTED if k in SECRET_ENV_KEYS else v for k, v in env.items()}
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return path


def write_strategy(spec: JobSpec) -> str | None:
    """The strategy file the workers read: the job's own file when ``strategy:`` names one, else
    the inline strategy written to ``log_dir/strategy.yaml``; None without a strategy."""
    if spec.strategy is None:
        return None
    if isinstance(spec.strategy, str):
        if not os.path.exists(spec.strategy):
            raise ConfigError(f"strategy file {spec.strategy!r} does not exist", key="strategy")
        return os.path.abspath(spec.strategy)
    path = os.path.abspath(os.path.join(spec.log_dir, "strategy.yaml"))
    # every node of a job writes the same text here; tmp + os.replace so that in a shared
    # log_dir no process ever reads a half-written file
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(spec.strategy, f, sort_keys=False)
    os.replace(tmp, path)
    return path


__all__ = ["write_job_file", "write_strategy"]
