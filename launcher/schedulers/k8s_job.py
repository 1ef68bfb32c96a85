"""Kubernetes scheduler (not landed yet)."""

from __future__ import annotations

from collective.errors import FleetNotImplementedError
from launcher.spec import JobSpec


def run_k8s(spec: JobSpec, *, dry_run: bool = False) -> int:
    """Render (and unless ``dry_run``, apply) the job's Kubernetes objects."""
    raise FleetNotImplementedError("scheduler 'k8s'", "use --scheduler local for now")
