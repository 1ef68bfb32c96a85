"""Calibrations and plans on disk, keyed by the model and cluster fingerprint.

The directory is ``$FLEETRUN_CACHE_DIR`` or ``~/.cache/fleetrun/planner``. Files are JSON
(``calibration-<fingerprint>.json``, ``plan-<key>.json``), written atomically (a temporary file
renamed over the old one), so a reader never sees half a file; a file that does not parse is
ignored with a warning and calibration or planning runs again. Plain Python: the launcher reads
the cache without importing torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleet.planner.types import Calibration, ModelSpec, Plan

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "FLEETRUN_CACHE_DIR"


def cache_dir() -> Path:
    """``$FLEETRUN_CACHE_DIR`` or ``~/.cache/fleetrun/planner``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "fleetrun" / "planner"


def _module_file(module: str, path: Sequence[str]) -> str | None:
    """The source file of ``module`` looked up on ``path`` then ``sys.path``, not imported
    (the last resort, ``importlib.util.find_spec``, imports the parent packages only)."""
    parts = module.split(".")
    for base in [*path, *sys.path]:
        root = Path(base or ".").joinpath(*parts)
        for candidate in (root.with_suffix(".py"), root / "__init__.py"):
            if candidate.is_file():
                return str(candidate)
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return found.origin if found is not None and found.origin else None


def _source_digest(ref: str | None, path: Sequence[str]) -> str:
    if not ref:
        return "-"
    module = ref.split(":")[0]
    origin = _module_file(module, path)
    if origin is None:
        return f"missing:{module}"
    try:
        text = Path(origin).read_bytes()
    except OSError:
        return f"unreadable:{module}"
    # A model sized from environment variables (os.environ.get("HIDDEN")) is another model
    # when they change: the variables whose names the source quotes are part of the digest.
    source = text.decode(errors="replace")
    env = sorted((k, v) for k, v in os.environ.items() if f'"{k}"' in source or f"'{k}'" in source)
    return hashlib.sha256(text + json.dumps(env).encode()).hexdigest()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_count() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


CALIBRATION_FORMAT = 3
"""Bumped when what a calibration measures changes, so older cached ones are measured again."""


def fingerprint(
    spec: ModelSpec, nnodes: int, nproc_per_node: int, backend: str, device: str, amp: str
) -> str:
    """sha256 over what a calibration depends on: the spec's strings, global batch and
    optimizer, the source text of the model/sample/loss modules, the world shape, the backend,
    the device's name, the CPU model and core count, torch's version, the AMP level and :data:`CALIBRATION_FORMAT`."""
    parts: dict[str, Any] = {
        "format": CALIBRATION_FORMAT,
        "model": spec.model,
        "sample": spec.sample,
        "loss": spec.loss,
        "global_batch_size": spec.global_batch_size,
        "optimizer": spec.optimizer,
        "sources": [_source_digest(r, spec.path) for r in (spec.model, spec.sample, spec.loss)],
        "nnodes": nnodes,
        "nproc_per_node": nproc_per_node,
        "backend": backend,
        "device": device,
        "cpu": cpu_model(),
        "cores": cpu_count(),
        "torch": _torch_version(),
        "amp": amp,
    }
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the cached %s %s: it does not parse (%s)", what, path, exc)
        return None


def _safe(key: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9._-]{1,120}", key):
        return key
    return hashlib.sha256(key.encode()).hexdigest()


def calibration_path(fp: str) -> Path:
    """Where the calibration of fingerprint ``fp`` is cached."""
    return cache_dir() / f"calibration-{_safe(fp)}.json"


def plan_path(key: str) -> Path:
    """Where the plan of ``key`` is cached."""
    return cache_dir() / f"plan-{_safe(key)}.json"


def load_calibration(fp: str) -> Calibration | None:
    """The cached calibration of fingerprint ``fp``; None when absent or unreadable."""
    path = calibration_path(fp)
    data = _read_json(path, "calibration")
    if data is None:
        return None
    try:
        cal = Calibration.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.warning("ignoring the cached calibration %s: %r", path, exc)
        return None
    if cal.fingerprint != fp:
        logger.warning("ignoring the cached calibration %s: it is of another fingerprint", path)
        return None
    return cal


def save_calibration(cal: Calibration) -> Path:
    """Cache ``cal`` under its fingerprint; returns the file."""
    return write_json_atomic(calibration_path(cal.fingerprint), cal.to_dict())


def load_plan(key: str) -> Plan | None:
    """The cached plan of ``key``; None when absent or unreadable."""
    path = plan_path(key)
    data = _read_json(path, "plan")
    if data is None:
        return None
    try:
        return Plan.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.warning("ignoring the cached plan %s: %r", path, exc)
        return None


def save_plan(key: str, plan: Plan) -> Path:
    """Cache ``plan`` under ``key``; returns the file."""
    return write_json_atomic(plan_path(key), plan.to_dict())


__all__ = [
    "CACHE_DIR_ENV",
    "cache_dir",
    "calibration_path",
    "cpu_count",
    "cpu_model",
    "fingerprint",
    "load_calibration",
    "load_plan",
    "plan_path",
    "save_calibration",
    "save_plan",
    "write_json_atomic",
]
