"""The Ray scheduler behind :class:`~launcher.schedulers.base.Scheduler`."""

from __future__ import annotations

from launcher.schedulers.base import Scheduler
from launcher.schedulers.ray.job import run_ray
from launcher.spec import JobSpec, SchedulerKind


class RayScheduler(Scheduler):
    """Every process of the job as a Ray actor, supervised by this fleetrun (the driver)."""

    kind = SchedulerKind.RAY

    def launch(self, spec: JobSpec, *, dry_run: bool = False) -> int:
        """Run the job on its Ray cluster to the end
        (:func:`~launcher.schedulers.ray.job.run_ray`)."""
        self.check_dry_run(dry_run)
        return run_ray(spec)
