"""The Kubernetes scheduler behind :class:`~launcher.schedulers.base.Scheduler`."""

from __future__ import annotations

from launcher.schedulers.base import Scheduler
from launcher.schedulers.k8s import client
from launcher.schedulers.k8s.job import run_k8s
from launcher.spec import JobSpec, SchedulerKind


class K8sScheduler(Scheduler):
    """The job as Kubernetes objects; its pods run ``fleetrun pod``. Jobs are addressed by name
    in a namespace (``kubernetes`` is imported on the first call that talks to the cluster)."""

    kind = SchedulerKind.K8S
    prints_manifests = True
    log_dir_here = False

    def launch(self, spec: JobSpec, *, dry_run: bool = False) -> int:
        """Apply the job and follow it, or print its manifests
        (:func:`~launcher.schedulers.k8s.job.run_k8s`)."""
        return run_k8s(spec, dry_run=dry_run)

    def status(self, job: str, namespace: str) -> str:
        """The trainers' Job counts and conditions, then one line per pod."""
        return client.job_status(job, namespace)

    def logs(
        self, job: str, namespace: str, *, rank: int | None = None, server: int | None = None
    ) -> str:
        """Logs of the job's pods, each headed by the pod name."""
        return client.job_logs(job, namespace, rank=rank, server=server)

    def delete(self, job: str, namespace: str) -> list[str]:
        """Delete every object of the job (its pods go with them); ``Kind/name`` of each."""
        return client.delete_job(job, namespace)

    def scale(self, job: str, namespace: str, replicas: int) -> str:
        """Set an elastic job's trainer pods to ``replicas`` (within its node range)."""
        return client.scale_job(job, namespace, replicas)
