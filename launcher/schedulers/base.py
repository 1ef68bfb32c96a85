"""The one interface the command line calls a scheduler through.

``fleetrun`` (:func:`launcher.cli.launch`) and its subcommands (:mod:`launcher.commands`) get a
:class:`Scheduler` from :func:`launcher.schedulers.get_scheduler` and call it without knowing
which peer it is:

* :meth:`Scheduler.launch` runs a validated :class:`~launcher.spec.JobSpec` to the end and
  returns fleetrun's exit code (every scheduler);
* :meth:`Scheduler.status`, :meth:`~Scheduler.logs`, :meth:`~Scheduler.delete` and
  :meth:`~Scheduler.scale` act on a running job addressed by name (``fleetrun status JOB`` ...):
  the Kubernetes scheduler's; a local or Ray job is read from its ``log_dir`` instead
  (``fleetrun status --log_dir``, ``fleetrun dashboard``), and the defaults here say so;
* :attr:`Scheduler.prints_manifests` and :attr:`Scheduler.log_dir_here` tell the CLI what
  ``--dry_run`` and ``--dashboard`` mean for it.
"""

from __future__ import annotations

import abc
from typing import ClassVar

from collective.errors import ConfigError
from launcher.spec import JobSpec, SchedulerKind


class Scheduler(abc.ABC):
    """Where a job runs: one of the peers under ``launcher/schedulers/``."""

    kind: ClassVar[SchedulerKind]
    """The ``--scheduler`` value that selects it."""
    prints_manifests: ClassVar[bool] = False
    """Whether ``--dry_run`` prints the job's manifests instead of running it."""
    log_dir_here: ClassVar[bool] = True
    """Whether the job's ``log_dir`` (job state, metrics targets) is written on this machine, so
    ``--dashboard`` can serve it while the job runs."""

    def check_dry_run(self, dry_run: bool) -> None:
        """ConfigError when ``--dry_run`` is asked of a scheduler that has nothing to print."""
        if dry_run and not self.prints_manifests:
            raise ConfigError(
                f"--dry_run prints Kubernetes manifests; scheduler '{self.kind}' has none "
                "(use --scheduler k8s, or drop --dry_run)",
                key="scheduler",
            )

    @abc.abstractmethod
    def launch(self, spec: JobSpec, *, dry_run: bool = False) -> int:
        """Run ``spec`` to the end (or with ``dry_run`` print its manifests); the exit code."""

    def status(self, job: str, namespace: str) -> str:
        """A short report on the running job ``job``."""
        raise self._not_by_name("status")

    def logs(
        self, job: str, namespace: str, *, rank: int | None = None, server: int | None = None
    ) -> str:
        """The logs of job ``job``'s processes (of trainer ``rank`` / server ``server`` only)."""
        raise self._not_by_name("logs")

    def delete(self, job: str, namespace: str) -> list[str]:
        """Delete what job ``job`` consists of; the names of what was deleted."""
        raise self._not_by_name("delete")

    def scale(self, job: str, namespace: str, replicas: int) -> str:
        """Set elastic job ``job`` to ``replicas`` nodes; what changed."""
        raise self._not_by_name("scale")

    def _not_by_name(self, verb: str) -> ConfigError:
        return ConfigError(
            f"the {self.kind} scheduler has no `fleetrun {verb} JOB`: a {self.kind} job is read "
            "from its log directory (fleetrun status --log_dir DIR, fleetrun dashboard --log_dir "
            "DIR)",
            key="scheduler",
        )
