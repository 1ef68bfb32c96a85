"""Entry of an elastic job on this node (placeholder until the agent lands)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from collective.errors import LaunchError

if TYPE_CHECKING:
    from launcher.spec import JobSpec


def launch_elastic(spec: JobSpec) -> int:
    """Run this node's agent of an elastic job (not built yet: raises)."""
    raise LaunchError("elastic jobs (--rdzv_backend c10d/etcd/etcd-v2) are not built yet in this "
                      "commit; use the static backend")
