"""Kubernetes scheduler: render the job (:mod:`~launcher.schedulers.k8s.render`), print it
(``--dry_run``) or apply it and stream its status (:mod:`~launcher.schedulers.k8s.client`), then
clean up as ``k8s.cleanup`` says."""

from __future__ import annotations

import logging
import sys

from launcher.scheduler_spec import CleanupPolicy
from launcher.schedulers.k8s.render import TRAINER, object_names, render_job, to_yaml
from launcher.spec import JobSpec

logger = logging.getLogger(__name__)


def run_k8s(spec: JobSpec, *, dry_run: bool = False) -> int:
    """Render (and unless ``dry_run``, apply) the job's Kubernetes objects; return the exit code."""
    objs = render_job(spec)
    if dry_run:
        sys.stdout.write(
            f"# fleetrun job '{spec.name}': {len(objs)} objects "
            f"(kubectl apply -f - to create them)\n"
        )
        sys.stdout.write(to_yaml(objs))
        sys.stdout.flush()
        return 0
    from launcher.schedulers.k8s import client  # lazy: the kubernetes client; --dry_run needs none

    ns = spec.k8s.namespace
    client.apply(objs, ns)
    code = 1
    try:
        code = client.stream_status(spec.name, object_names(spec)[TRAINER], ns)
    except KeyboardInterrupt:
        logger.warning(
            "stopped following job '%s'; it keeps running (fleetrun status %s -n %s, "
            "fleetrun delete %s -n %s)",
            spec.name,
            spec.name,
            ns,
            spec.name,
            ns,
        )
        return 130
    policy = spec.k8s.cleanup
    if policy is CleanupPolicy.ALWAYS or (policy is CleanupPolicy.ON_SUCCESS and code == 0):
        deleted = client.delete_job(spec.name, ns)
        logger.info("cleanup (%s): deleted %s", policy, ", ".join(deleted) or "nothing")
    else:
        logger.info(
            "cleanup (%s): kept the job's objects; fleetrun delete %s -n %s", policy, spec.name, ns
        )
    return code
