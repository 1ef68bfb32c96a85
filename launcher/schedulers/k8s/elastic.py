"""An elastic collective job on Kubernetes (``--nnodes MIN:MAX`` with ``--scheduler k8s``):
what differs from a fixed job's manifests, as pure functions (render.py calls them).

Objects (apply order)::

    ConfigMap   N-config        as for every job
    Service     N-etcd          ClusterIP, port 2379: the job's stable rendezvous endpoint  (*)
    StatefulSet N-etcd          one etcd member (v2 API on, data in an emptyDir)             (*)
    PodGroup    N               (gang only) minMember = MIN agents (+ the etcd pod)
    Job         N-trainer       NonIndexed, parallelism = MAX, no completions: one pod per node

(*) only when the rendezvous endpoint is the job's own etcd Service (``--rdzv_endpoint
N-etcd[:2379]``, or Paddle's ``--elastic_server etcd://N-etcd:2379``); any other endpoint (an
etcd of yours, a c10d store the pods can reach) is used as given and nothing is rendered for it.

Every trainer pod runs fleetrun's elastic agent — the plain ``fleetrun --nnodes MIN:MAX
--rdzv_backend B --rdzv_endpoint E --rdzv_id ID ... SCRIPT ARGS`` command line, which the
manifest shows whole — so pods need no stable names: the rendezvous gives each round its node
ranks and the workers their MASTER_ADDR (the rank-0 pod's IP).

Restarts: the Job keeps ``parallelism`` pods running until one succeeds (no ``completions``), so
a pod that is lost is replaced by a new one that joins the next rendezvous round. A pod lost to
a disruption (node drained or gone, preemption, eviction: condition ``DisruptionTarget``) is
replaced without counting (``podFailurePolicy`` Ignore); a pod whose agent failed (its workers
used up ``--max_restarts``) counts against ``backoffLimit = max_restarts``; exit code 2 (a
configuration error: the same command would fail again) fails the Job at once.
``fleetrun k8s scale JOB N`` sets ``parallelism`` (MIN <= N <= MAX, read from the Job's
annotations): the Job controller adds pods, which join, or deletes some, whose agents stop and
the others re-form without them.
"""

from __future__ import annotations

from typing import Any

from collective.errors import ConfigError
from launcher.elastic.config import DEFAULT_ETCD_PORT, RdzvBackend
from launcher.schedulers.k8s.formats import warm_args
from launcher.spec import JobSpec

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
"""etcd for the job's rendezvous: 3.5 still serves the v2 API (``--enable-v2``) that torch's
etcd handlers (python-etcd) speak; 3.6 removed it."""
ETCD = "etcd"
MIN_NODES_ANNOTATION = "fleetrun.io/min-nodes"
MAX_NODES_ANNOTATION = "fleetrun.io/max-nodes"
"""On the trainers' Job: the node range ``fleetrun k8s scale`` checks N against."""
CONFIG_ERROR_EXIT = 2
"""fleetrun's exit code for a configuration error (ConfigError): the Job fails at once."""


def etcd_name(spec: JobSpec) -> str:
    """Name of the job's etcd Service and StatefulSet."""
    return f"{spec.name}-{ETCD}"


def renders_etcd(spec: JobSpec) -> bool:
    """Whether the rendezvous endpoint is the job's own etcd Service (``N-etcd``, optionally
    ``N-etcd.NAMESPACE[.svc[.cluster.local]]``), which is then rendered with the job."""
    host, _ = spec.elastic.endpoint()
    name, ns = etcd_name(spec), spec.k8s.namespace
    return host in (name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local")


def rdzv_endpoint(spec: JobSpec) -> str:
    """The endpoint the agents dial: the etcd Service's DNS name, or the one given."""
    host, port = spec.elastic.endpoint()
    if renders_etcd(spec):
        return f"{etcd_name(spec)}.{spec.k8s.namespace}.svc:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_elastic_renderable(spec: JobSpec) -> None:
    """ConfigError for an elastic job the cluster could not run as rendered."""
    e = spec.elastic
    if e.standalone or spec.elastic.endpoint()[0] in ("127.0.0.1", "localhost", "::1"):
        what = "--standalone means" if e.standalone else f"{e.rdzv_endpoint!r} is"
        raise ConfigError(
            f"{what} this machine, not a place the pods can reach; on "
            f"Kubernetes give --rdzv_endpoint {etcd_name(spec)} (the etcd fleetrun renders with "
            "the job) or an etcd / c10d store the pods can reach",
            key="elastic.rdzv_endpoint",
        )
    if renders_etcd(spec) and e.rdzv_backend not in (RdzvBackend.ETCD, RdzvBackend.ETCD_V2):
        raise ConfigError(
            f"{e.rdzv_endpoint!r} is the job's etcd, which serves rdzv_backend etcd and etcd-v2, "
            f"not {e.rdzv_backend}; use --rdzv_backend etcd-v2 (or point --rdzv_endpoint at your "
            "c10d store)",
            key="elastic.rdzv_backend",
        )


def agent_args(spec: JobSpec, strategy_path: str | None) -> list[str]:
    """``fleetrun`` arguments of a trainer pod: the elastic agent of one node."""
    e = spec.elastic
    args = [
        "--nnodes",
        f"{e.min_nodes}:{e.max_nodes}",
        "--nproc_per_node",
        str(spec.sizes.nproc_per_node),
        "--rdzv_backend",
        str(e.rdzv_backend),
        "--rdzv_endpoint",
        rdzv_endpoint(spec),
        "--rdzv_id",
        spec.run_id or spec.name,
        "--rdzv_timeout",
        f"{spec.rendezvous.timeout_s:g}",
        "--monitor_interval",
        f"{e.monitor_interval_s:g}",
        "--max_restarts",
        str(spec.max_restarts),
        "--job_name",
        spec.name,
        "--backend",
        str(spec.backend),
        "--log_dir",
        spec.log_dir,
        "--grace_period",
        f"{spec.grace_period_s:g}",
    ]
    if e.rdzv_conf:
        args += ["--rdzv_conf", ",".join(f"{k}={v}" for k, v in sorted(e.rdzv_conf.items()))]
    if strategy_path:
        args += ["--strategy", strategy_path]
    if not bool(getattr(spec, "metrics", True)):
        args.append("--no_metrics")
    args += warm_args(spec)
    entry = spec.entrypoint
    if entry.module:
        args.append("--module")
    if entry.no_python:
        args.append("--no_python")
    return [*args, "--", str(entry.module or entry.script), *entry.args]


def elastic_job_spec(spec: JobSpec, template: dict[str, Any]) -> dict[str, Any]:
    """``spec`` of the trainers' Job: one pod per node, up to MAX, replaced when lost."""
    return {
        "completionMode": "NonIndexed",
        "parallelism": spec.elastic.max_nodes,
        "backoffLimit": spec.max_restarts,
        "podFailurePolicy": {
            "rules": [
                # (an empty onPodConditions: the 1.28 schema requires the field; the API server
                # takes an empty list as "not set")
                {
                    "action": "FailJob",
                    "onPodConditions": [],
                    "onExitCodes": {
                        "containerName": "trainer",
                        "operator": "In",
                        "values": [CONFIG_ERROR_EXIT],
                    },
                },
                {
                    "action": "Ignore",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
            ]
        },
        "template": template,
    }


def node_range_annotations(spec: JobSpec) -> dict[str, str]:
    """The Job's annotations naming its node range."""
    return {
        MIN_NODES_ANNOTATION: str(spec.elastic.min_nodes),
        MAX_NODES_ANNOTATION: str(spec.elastic.max_nodes),
    }


def render_etcd(spec: JobSpec, role: dict[str, str]) -> list[dict[str, Any]]:
    """The job's etcd: a ClusterIP Service and a one-member StatefulSet behind it; ``role``: the
    labels of its objects and pod (the job's, with role etcd)."""
    name, ns = etcd_name(spec), spec.k8s.namespace
    _, port = spec.elastic.endpoint()

    def meta() -> dict[str, Any]:
        return {"name": name, "namespace": ns, "labels": dict(role)}

    url = f"http://{name}.{ns}.svc:{port}"
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(),
        "spec": {
            "selector": dict(role),
            "ports": [
                {"name": "client", "port": port, "targetPort": DEFAULT_ETCD_PORT, "protocol": "TCP"}
            ],
        },
    }
    container = {
        "name": ETCD,
        "image": ETCD_IMAGE,
        "command": [
            # one member under etcd's default name, so its default --initial-cluster fits
            "etcd",
            "--data-dir",
            "/var/lib/etcd",
            "--listen-client-urls",
            f"http://0.0.0.0:{DEFAULT_ETCD_PORT}",
            "--advertise-client-urls",
            url,
            "--enable-v2=true",  # torch's etcd handlers speak the v2 API (python-etcd)
        ],
        "ports": [{"name": "client", "containerPort": DEFAULT_ETCD_PORT}],
        "readinessProbe": {"tcpSocket": {"port": DEFAULT_ETCD_PORT}, "periodSeconds": 2},
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        },
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(),
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": dict(role)},
            "template": {
                "metadata": {"labels": dict(role)},
                "spec": {"containers": [container], "volumes": [{"name": "data", "emptyDir": {}}]},
            },
        },
    }
    return [service, statefulset]


def check_scale(job: str, annotations: dict[str, str] | None, replicas: int) -> tuple[int, int]:
    """``(MIN, MAX)`` of the elastic Job ``job`` when ``replicas`` is in it; ConfigError naming
    N and the range otherwise, or when the Job is not an elastic one."""
    ann = annotations or {}
    if MIN_NODES_ANNOTATION not in ann or MAX_NODES_ANNOTATION not in ann:
        raise ConfigError(
            f"job '{job}' is not an elastic job (its Job has no {MIN_NODES_ANNOTATION} / "
            f"{MAX_NODES_ANNOTATION} annotations): only a job launched with --nnodes MIN:MAX "
            "can be scaled",
            key="JOB",
        )
    low, high = int(ann[MIN_NODES_ANNOTATION]), int(ann[MAX_NODES_ANNOTATION])
    if not low <= replicas <= high:
        raise ConfigError(
            f"{replicas} is outside job '{job}''s node range {low}..{high} (--nnodes "
            f"{low}:{high}); give N between {low} and {high}",
            key="N",
        )
    return low, high


__all__ = [
    "ETCD_IMAGE",
    "agent_args",
    "check_elastic_renderable",
    "check_scale",
    "elastic_job_spec",
    "etcd_name",
    "node_range_annotations",
    "rdzv_endpoint",
    "render_etcd",
    "renders_etcd",
]
