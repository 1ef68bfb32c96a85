"""The three schedulers as peers behind one interface, and the registry that picks one.

``local/`` (fleetrun runs this node's processes itself), ``ray/`` (actors on a Ray cluster) and
``k8s/`` (Kubernetes objects, and the command their pods run) each implement
:class:`~launcher.schedulers.base.Scheduler`; :func:`get_scheduler` imports the one asked for
when it is asked for, so ``fleetrun --help`` loads none of them (nor torch, ray or kubernetes).
The three import none of each other (an import-linter contract in pyproject.toml): what they
share lives below them in ``launcher/`` (process and attempt, summary, telemetry, console, job
files, the PS environment, ``recovery/``, ``elastic/``). Every scheduler gives its processes the
same env contract (:mod:`collective.env`) and ends a failed job with the same root-cause-first
summary (:mod:`launcher.summary`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collective.errors import ConfigError

if TYPE_CHECKING:
    from launcher.schedulers.base import Scheduler

SCHEDULERS = ("local", "ray", "k8s")
"""The ``--scheduler`` values, one per peer package."""


def get_scheduler(kind: str) -> Scheduler:
    """The scheduler ``kind`` names (a :class:`~launcher.spec.SchedulerKind` or its value)."""
    name = str(kind)
    if name == "local":
        from launcher.schedulers.local.scheduler import LocalScheduler  # lazy: launches only

        return LocalScheduler()
    if name == "ray":
        from launcher.schedulers.ray.scheduler import RayScheduler  # lazy: Ray jobs only

        return RayScheduler()
    if name == "k8s":
        from launcher.schedulers.k8s.scheduler import K8sScheduler  # lazy: Kubernetes jobs only

        return K8sScheduler()
    raise ConfigError(
        f"unknown scheduler {name!r}: use one of {', '.join(SCHEDULERS)}", key="scheduler"
    )
