"""Kubernetes value formats for :mod:`launcher.schedulers.k8s.render`: resource quantities
(``2Gi`` times N, ``500m`` CPUs), the warm-start arguments of a pod's command, and the YAML stream ``kubectl apply -f -`` reads (multi-line
strings, the ConfigMap's files, as ``|`` blocks)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from collective.errors import ConfigError

GPU_RESOURCE = "nvidia.com/gpu"
"""The extended resource NVIDIA's device plugin offers."""
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")


def warm_args(spec: Any) -> list[str]:
    """The ``--warm_start`` / ``--warm_imports`` arguments of a pod's fleetrun command (none
    when warm starts are off)."""
    if str(spec.warm_start) != "on":
        return []
    args = ["--warm_start", "on"]
    if spec.warm_imports:
        args += ["--warm_imports", ",".join(spec.warm_imports)]
    return args


def scale_quantity(quantity: str, factor: int, key: str) -> str:
    """``quantity`` (Kubernetes syntax, e.g. ``2Gi``) times ``factor``; ConfigError when
    malformed."""
    m = _QUANTITY.match(str(quantity).strip())
    if not m:
        raise ConfigError(
            f"{quantity!r} is not a Kubernetes quantity like 512Mi, 4Gi or 1000000000", key=key
        )
    if factor == 1:
        return str(quantity).strip()
    value = float(m.group(1)) * factor
    text = str(int(value)) if value.is_integer() else f"{value:g}"
    return text + (m.group(2) or "")


def cpu_quantity(cores: float) -> str:
    """``1.0`` -> ``"1"``, ``0.5`` -> ``"500m"``."""
    return str(int(cores)) if float(cores).is_integer() else f"{round(cores * 1000)}m"


class _Dumper(yaml.SafeDumper):
    """SafeDumper writing multi-line strings (the ConfigMap's files) as ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = (
        "|"
        if "\n" in value and not any(line != line.rstrip() for line in value.splitlines())
        else None
    )
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(objs: list[dict[str, Any]]) -> str:
    """A YAML multi-document stream (``kubectl apply -f -`` reads it)."""
    return yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


__all__ = ["GPU_RESOURCE", "cpu_quantity", "scale_quantity", "to_yaml"]
