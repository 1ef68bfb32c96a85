"""Ray scheduler (not landed yet)."""

from __future__ import annotations

from collective.errors import FleetNotImplementedError
from launcher.spec import JobSpec


def run_ray(spec: JobSpec) -> int:
    """Run ``spec`` on a Ray cluster."""
    raise FleetNotImplementedError("scheduler 'ray'", "use --scheduler local for now")
