"""Every call fleetrun makes to a Kubernetes API server, in one place (the official client).

``kubernetes`` is imported lazily (the CLI must start without it). Configuration: in-cluster
(a pod with a service account) first, then the kubeconfig (``KUBECONFIG`` or ~/.kube/config).
The verbs used here are exactly those ``deploy/k8s/rbac.yaml`` grants.

Apply order: the trainers' Job is created first, suspended, so every other object can carry an
ownerReference to it (deleting the Job — by hand, ``fleetrun delete`` or its
ttlSecondsAfterFinished — garbage-collects the rest); then the others; then the Job is resumed.

Not exercised against a live API server (none can run on the development machines):
tests/test_k8s_client.py drives it through the official client against an in-memory stand-in
of the REST paths (tests/scripts/k8s_fake_api.py).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from collective.errors import LaunchError
from launcher.schedulers.k8s.elastic import check_scale
from launcher.schedulers.k8s.render import (
    INDEX_ANNOTATION,
    JOB_LABEL,
    NPROC_LABEL,
    PODGROUP_API,
    ROLE_LABEL,
    TRAINER,
)

logger = logging.getLogger(__name__)

POLL_S = 2.0
"""Seconds between two status polls while streaming."""


def _client() -> Any:
    """The configured ``kubernetes.client`` module, or LaunchError saying what is missing."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise LaunchError(
            "the Kubernetes scheduler needs the kubernetes package: pip install 'fleetrun[k8s]'"
        ) from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            # KUBECONFIG read now (the client's default was fixed when it was imported)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        except (config.ConfigException, OSError, TypeError) as err:
            raise LaunchError(
                f"no Kubernetes cluster configured ({err}); point KUBECONFIG at a kubeconfig, "
                "or run "
                "fleetrun in a pod whose service account has deploy/k8s/rbac.yaml's Role"
            ) from None
    return client


def _api_exceptions() -> tuple[type[Exception], ...]:
    """What a client call raises: an API error answer, or no answer at all (urllib3)."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    return (ApiException, urllib3.exceptions.HTTPError)


def _api_error(err: Any, what: str) -> LaunchError:
    status = getattr(err, "status", None)
    reason = getattr(err, "reason", "") or str(err)
    if status is None:
        return LaunchError(
            f"{what}: cannot reach the Kubernetes API server ({reason}); check the "
            "kubeconfig's server address and the network"
        )
    if status == 403:
        return LaunchError(
            f"{what}: forbidden ({reason}); bind the launcher's account to the Role in "
            "deploy/k8s/rbac.yaml (kubectl apply -k deploy/k8s)"
        )
    if status == 409:
        return LaunchError(
            f"{what}: already exists; delete the old job first (fleetrun delete NAME) "
            "or give this one another name"
        )
    return LaunchError(f"{what}: Kubernetes API error {status} {reason}")


def _creators(client: Any, ns: str) -> dict[str, Callable[[dict[str, Any]], Any]]:
    core, apps, batch = client.CoreV1Api(), client.AppsV1Api(), client.BatchV1Api()
    custom = client.CustomObjectsApi()
    group, version, plural = PODGROUP_API
    return {
        "ConfigMap": lambda body: core.create_namespaced_config_map(ns, body),
        # the PS job's token: created (owned by the Job, so garbage-collected with it), never
        # read, listed or deleted by fleetrun (rbac.yaml grants create only)
        "Secret": lambda body: core.create_namespaced_secret(ns, body),
        "Service": lambda body: core.create_namespaced_service(ns, body),
        "StatefulSet": lambda body: apps.create_namespaced_stateful_set(ns, body),
        "Job": lambda body: batch.create_namespaced_job(ns, body),
        "PodGroup": lambda body: custom.create_namespaced_custom_object(
            group, version, ns, plural, body
        ),
    }


def apply(objs: list[dict[str, Any]], namespace: str) -> None:
    """Create the job's objects (rendered by render.render_job) in ``namespace``."""
    client = _client()
    ApiException = _api_exceptions()

    create = _creators(client, namespace)
    job = next(o for o in objs if o["kind"] == "Job")
    body = copy.deepcopy(job)
    body["spec"]["suspend"] = True
    name = job["metadata"]["name"]
    try:
        created = create["Job"](body)
    except ApiException as err:
        raise _api_error(err, f"creating Job {name}") from None
    owner = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": name,
        "uid": created.metadata.uid,
        "controller": False,
        "blockOwnerDeletion": False,
    }
    try:
        for obj in objs:
            if obj is not job:
                _create_owned(create, obj, owner)
    except LaunchError:
        # Deleting the suspended Job garbage-collects what was created (ownerReferences).
        try:
            client.BatchV1Api().delete_namespaced_job(
                name, namespace, body=client.V1DeleteOptions(propagation_policy="Background")
            )
        except ApiException as err:
            logger.error(
                "could not delete the half-created Job %s (%s); fleetrun delete %s",
                name,
                err.reason,
                job["metadata"]["labels"][JOB_LABEL],
            )
        raise
    try:
        client.BatchV1Api().patch_namespaced_job(name, namespace, {"spec": {"suspend": False}})
    except ApiException as err:
        raise _api_error(err, f"resuming Job {name}") from None
    logger.info("created Job %s (%d objects in namespace %s)", name, len(objs), namespace)


def _create_owned(
    create: dict[str, Callable[[dict[str, Any]], Any]], obj: dict[str, Any], owner: dict[str, Any]
) -> None:
    ApiException = _api_exceptions()

    body = copy.deepcopy(obj)
    body["metadata"]["ownerReferences"] = [owner]
    what = f"creating {obj['kind']} {obj['metadata']['name']}"
    try:
        create[obj["kind"]](body)
    except ApiException as err:
        if obj["kind"] == "PodGroup" and getattr(err, "status", None) == 404:
            raise LaunchError(
                f"{what}: the PodGroup kind is unknown to this cluster; install "
                "Volcano or set k8s.gang: false"
            ) from None
        raise _api_error(err, what) from None
    logger.info("created %s %s", obj["kind"], obj["metadata"]["name"])


def _phase(pod: Any) -> str:
    return str(pod.status.phase) if pod.status and pod.status.phase else "Unknown"


def _containers(pod: Any) -> list[Any]:
    return list((pod.status.container_statuses if pod.status else None) or [])


def _job_state(job: Any) -> str | None:
    """``Complete`` / ``Failed`` once the Job has ended, else None."""
    for cond in (job.status.conditions if job.status else None) or []:
        if cond.status == "True" and cond.type in ("Complete", "Failed"):
            return str(cond.type)
    return None


def _pods(client: Any, job: str, ns: str) -> list[Any]:
    pods = client.CoreV1Api().list_namespaced_pod(ns, label_selector=f"{JOB_LABEL}={job}").items
    return sorted(pods, key=lambda p: p.metadata.name)


def _pod_line(pod: Any) -> str:
    role = (pod.metadata.labels or {}).get(ROLE_LABEL, "?")
    restarts = sum(c.restart_count for c in _containers(pod))
    line = (
        f"{pod.metadata.name:<40} {role:<11} {_phase(pod):<10} restarts {restarts}"  # coordinator
    )
    for c in _containers(pod):
        term = c.state.terminated if c.state else None
        if term is not None and term.exit_code:
            line += f"  exit {term.exit_code} {term.reason or ''}"
    return line


def _failed_server(pods: list[Any]) -> str | None:
    """A parameter server that exited non-zero (its StatefulSet would restart it with empty tables,
    which the trainers cannot recover from): a description, else None."""
    for pod in pods:
        if (pod.metadata.labels or {}).get(ROLE_LABEL) != "server":
            continue
        for c in _containers(pod):
            for state in (c.state, c.last_state):
                term = state.terminated if state else None
                if term is not None and term.exit_code:
                    name, code = pod.metadata.name, term.exit_code
                    return f"server pod {name} exited with code {code}\n{term.message or ''}"
    return None


def stream_status(
    job_name: str, trainer_job: str, namespace: str, timeout_s: float | None = None
) -> int:
    """Log pod phase changes until the trainers' Job ends; 0 = Complete, 1 = Failed. A failed job's
    pods' termination messages (fleetrun pod's root-cause summary) are printed."""
    client = _client()
    ApiException = _api_exceptions()

    batch = client.BatchV1Api()
    seen: dict[str, str] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while deadline is None or time.monotonic() < deadline:
        try:
            job = batch.read_namespaced_job(trainer_job, namespace)
            pods = _pods(client, job_name, namespace)
        except ApiException as err:
            raise _api_error(err, f"reading Job {trainer_job}") from None
        for pod in pods:
            phase = _phase(pod)
            if seen.get(pod.metadata.name) != phase:
                seen[pod.metadata.name] = phase
                logger.info("pod %s: %s", pod.metadata.name, phase)
        broken = _failed_server(pods)
        if broken:
            logger.error(
                "job '%s' FAILED: %s; fleetrun logs %s --server N -n %s",
                job_name,
                broken,
                job_name,
                namespace,
            )
            return 1
        state = _job_state(job)
        if state == "Complete":
            logger.info("job '%s' succeeded", job_name)
            return 0
        if state == "Failed":
            for pod in pods:
                for c in _containers(pod):
                    term = c.state.terminated if c.state else None
                    if term is not None and term.exit_code and term.message:
                        logger.error("pod %s:\n%s", pod.metadata.name, term.message)
            logger.error("job '%s' FAILED; fleetrun logs %s -n %s", job_name, job_name, namespace)
            return 1
        time.sleep(POLL_S)
    raise LaunchError(
        f"job '{job_name}' still running after {timeout_s} s; fleetrun status {job_name}"
    )


def job_status(job_name: str, namespace: str) -> str:
    """A short text report: the trainers' Job counts and conditions, then one line per pod."""
    client = _client()
    ApiException = _api_exceptions()

    try:
        jobs = (
            client.BatchV1Api()
            .list_namespaced_job(namespace, label_selector=f"{JOB_LABEL}={job_name}")
            .items
        )
        pods = _pods(client, job_name, namespace)
    except ApiException as err:
        raise _api_error(err, f"reading job '{job_name}'") from None
    if not jobs and not pods:
        raise LaunchError(
            f"no job '{job_name}' in namespace {namespace} (kubectl get jobs -n {namespace})"
        )
    lines = []
    for job in jobs:
        s = job.status
        counts = [(getattr(s, k, None) or 0) for k in ("active", "succeeded", "failed")]
        state = _job_state(job) or ("Suspended" if job.spec and job.spec.suspend else "Running")
        lines.append(
            f"Job {job.metadata.name}: active {counts[0]}, succeeded {counts[1]}, "
            f"failed {counts[2]}, state {state}"
        )
    lines += [_pod_line(p) for p in pods]
    return "\n".join(lines)


def _select(pods: list[Any], rank: int | None, server: int | None) -> list[Any]:
    if rank is None and server is None:
        return pods
    out = []
    for pod in pods:
        labels, ann = pod.metadata.labels or {}, pod.metadata.annotations or {}
        if server is not None and labels.get(ROLE_LABEL) == "server":
            if pod.metadata.name.rpartition("-")[2] == str(server):
                out.append(pod)
        elif rank is not None and labels.get(ROLE_LABEL) == "trainer":
            nproc = int(labels.get(NPROC_LABEL, "1") or 1)
            if ann.get(INDEX_ANNOTATION) == str(rank // nproc):
                out.append(pod)
    return out


def job_logs(
    job_name: str, namespace: str, rank: int | None = None, server: int | None = None
) -> str:
    """Logs of the job's pods (of trainer ``rank``'s pod / server ``server`` only when given)."""
    client = _client()
    ApiException = _api_exceptions()

    core = client.CoreV1Api()
    try:
        every = _pods(client, job_name, namespace)
        trainers = [p for p in every if (p.metadata.labels or {}).get(ROLE_LABEL) == "trainer"]
        if (
            rank is not None
            and trainers
            and not any(INDEX_ANNOTATION in (p.metadata.annotations or {}) for p in trainers)
        ):
            raise LaunchError(
                f"job '{job_name}' is elastic: its pods take new ranks in every round, so no pod "
                f"is rank {rank}'s. Read every pod's log (fleetrun logs {job_name} -n {namespace}, "
                "without --rank) or one pod's (kubectl logs POD)"
            )
        pods = _select(every, rank, server)
        if not pods:
            which = (
                f" rank {rank}"
                if rank is not None
                else f" server {server}"
                if server is not None
                else ""
            )
            raise LaunchError(f"job '{job_name}' has no{which} pod in namespace {namespace}")
        parts = [
            f"==== {p.metadata.name} ====\n"
            + core.read_namespaced_pod_log(p.metadata.name, namespace)
            for p in pods
        ]
    except ApiException as err:
        raise _api_error(err, f"reading logs of job '{job_name}'") from None
    return "".join(part if part.endswith("\n") else part + "\n" for part in parts)


def delete_job(job_name: str, namespace: str) -> list[str]:
    """Delete every object labelled with the job (pods go with their Job / StatefulSet); returns
    ``Kind/name`` of what was deleted."""
    client = _client()
    ApiException = _api_exceptions()

    core, apps, batch = client.CoreV1Api(), client.AppsV1Api(), client.BatchV1Api()
    custom = client.CustomObjectsApi()
    group, version, plural = PODGROUP_API
    sel = f"{JOB_LABEL}={job_name}"
    body = client.V1DeleteOptions(propagation_policy="Background")
    kinds: list[tuple[str, Callable[[], list[str]], Callable[[str], Any]]] = [
        (
            "Job",
            lambda: [
                o.metadata.name
                for o in batch.list_namespaced_job(namespace, label_selector=sel).items
            ],
            lambda n: batch.delete_namespaced_job(n, namespace, body=body),
        ),
        (
            "StatefulSet",
            lambda: [
                o.metadata.name
                for o in apps.list_namespaced_stateful_set(namespace, label_selector=sel).items
            ],
            lambda n: apps.delete_namespaced_stateful_set(n, namespace, body=body),
        ),
        (
            "Service",
            lambda: [
                o.metadata.name
                for o in core.list_namespaced_service(namespace, label_selector=sel).items
            ],
            lambda n: core.delete_namespaced_service(n, namespace),
        ),
        (
            "ConfigMap",
            lambda: [
                o.metadata.name
                for o in core.list_namespaced_config_map(namespace, label_selector=sel).items
            ],
            lambda n: core.delete_namespaced_config_map(n, namespace),
        ),
        (
            "PodGroup",
            lambda: [
                o["metadata"]["name"]
                for o in custom.list_namespaced_custom_object(
                    group, version, namespace, plural, label_selector=sel
                )["items"]
            ],
            lambda n: custom.delete_namespaced_custom_object(group, version, namespace, plural, n),
        ),
    ]
    deleted = []
    for kind, list_fn, delete_fn in kinds:
        try:
            names = list_fn()
        except ApiException as err:
            if (
                kind == "PodGroup" and getattr(err, "status", None) == 404
            ):  # Volcano not installed: nothing to delete
                continue
            raise _api_error(err, f"listing {kind}s of job '{job_name}'") from None
        for name in names:
            try:
                delete_fn(name)
                deleted.append(f"{kind}/{name}")
            except ApiException as err:
                if getattr(err, "status", None) != 404:
                    raise _api_error(err, f"deleting {kind} {name}") from None
    return deleted


def scale_job(job_name: str, namespace: str, replicas: int) -> str:
    """``fleetrun k8s scale``: set the elastic job's trainer pods to ``replicas`` (the Job's
    ``parallelism``), within the node range its annotations give; returns what changed."""
    client = _client()
    ApiException = _api_exceptions()

    batch = client.BatchV1Api()
    name = f"{job_name}-{TRAINER}"
    try:
        job = batch.read_namespaced_job(name, namespace)
    except ApiException as err:
        if getattr(err, "status", None) == 404:
            raise LaunchError(
                f"no job '{job_name}' in namespace {namespace} (no Job {name}); "
                f"kubectl get jobs -n {namespace}"
            ) from None
        raise _api_error(err, f"reading Job {name}") from None
    low, high = check_scale(job_name, job.metadata.annotations, replicas)
    before = job.spec.parallelism
    try:
        batch.patch_namespaced_job(name, namespace, {"spec": {"parallelism": replicas}})
    except ApiException as err:
        raise _api_error(err, f"scaling Job {name}") from None
    logger.info(
        "scaled job '%s' from %s to %d pod(s) (nodes %d..%d)", job_name, before, replicas, low, high
    )
    return (
        f"job '{job_name}': {before} -> {replicas} trainer pod(s) (node range {low}..{high}); "
        "the agents re-form at the next rendezvous round"
    )


__all__ = ["apply", "delete_job", "job_logs", "job_status", "scale_job", "stream_status"]
