"""The local scheduler behind :class:`~launcher.schedulers.base.Scheduler`."""

from __future__ import annotations

from launcher.schedulers.base import Scheduler
from launcher.schedulers.local.launch import launch_local
from launcher.spec import JobSpec, SchedulerKind


class LocalScheduler(Scheduler):
    """This node's share of the job, run by fleetrun itself (one fleetrun per node)."""

    kind = SchedulerKind.LOCAL

    def launch(self, spec: JobSpec, *, dry_run: bool = False) -> int:
        """Run this node's processes to the end
        (:func:`~launcher.schedulers.local.launch.launch_local`)."""
        self.check_dry_run(dry_run)
        return launch_local(spec)
