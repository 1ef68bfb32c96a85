"""Render a JobSpec into Kubernetes objects (plain dicts): pure functions, no cluster, no client.

Collective job ``N`` (one pod per node, ``nproc_per_node`` trainers in each)::

    ConfigMap N-config         strategy.yaml (if any), mounted at /etc/fleetrun
    Service   N-trainer        headless, publishNotReadyAddresses (peers resolve before Ready)
    Job       N-trainer        completionMode Indexed, completions = parallelism = nnodes,
                               subdomain N-trainer -> pod i is N-trainer-i.N-trainer.NS.svc
    PodGroup  N                (gang only) Volcano, minMember = every pod of the job

Elastic collective job (``--nnodes MIN:MAX``): one elastic agent per pod, up to MAX pods, a
rendezvous endpoint instead of the trainer Service (see :mod:`launcher.schedulers.k8s.elastic`).

PS job: the same, plus ``Service N-server`` + ``StatefulSet N-server`` (server i is
``N-server-i.N-server.NS.svc``; heter workers likewise ``N-heter``:
:mod:`launcher.schedulers.k8s.heter`) and ``Secret N-ps-token`` (the job's token, key ``token``; every
pod reads it as FLEET_PS_TOKEN through ``valueFrom.secretKeyRef``, so it is in no pod spec);
the trainers' Job has one pod per trainer. The token is FLEET_PS_TOKEN of the job's env or
fleetrun's, else a new random one per render: ``--dry_run`` prints it inside the Secret (that
output is what you apply), nothing else does.

PS job with ``ps_checkpoint``: every pod gets FLEET_PS_CHECKPOINT_* and FLEET_PS_MAX_RESTARTS
(the directory must be on a mounted ReadWriteMany PersistentVolumeClaim), the trainers
FLEET_PS_RECONNECT_S, the trainers' Job a ``podFailurePolicy`` (exit 3, the job cannot recover:
FailJob); a dead server or trainer pod is restarted by Kubernetes and either restarts alone (an
async/GEO server restoring its own shards) or restarts every pod from the newest checkpoint
(:mod:`launcher.schedulers.k8s.ps_recovery`). Such a job also gets the trainers' coordinator
(``Service N-coord`` + a 1-replica ``StatefulSet N-coord``, FLEET_PS_COORDINATOR in every pod:
:mod:`launcher.schedulers.k8s.coordinator`), through which async/half-async/GEO trainers meet,
so a dead trainer pod restarts alone from its data position.

Every container runs ``fleetrun pod ...`` (:mod:`launcher.schedulers.k8s.pod`), which derives its
rank / role / endpoints from the pod index and these DNS names and starts the user's entrypoint with the env
contract. The pod-level settings are command-line arguments, so ``kubectl get -o yaml`` shows
everything a pod does. Objects come out in apply order.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from collective.env import FLEET_PS_COORDINATOR
from collective.errors import ConfigError
from launcher.heter_spec import heter_count
from launcher.ps_env import (
    FLEET_PS_CHECKPOINT_ROOT,
    FLEET_PS_SSD_ROOT,
    FLEET_PS_TOKEN,
    job_ps_token,
)
from launcher.schedulers.k8s import coordinator, elastic, heter, ps_recovery
from launcher.schedulers.k8s.formats import (
    GPU_RESOURCE,
    cpu_quantity,
    scale_quantity,
    to_yaml,
    warm_args,
)
from launcher.spec import JobSpec, Mode, RoleResources

CONFIG_MOUNT = "/etc/fleetrun"
"""Where the job's ConfigMap is mounted in every container."""
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
"""Annotation the Job controller puts on each pod of an Indexed Job."""
JOB_LABEL = "fleetrun.io/job"
ROLE_LABEL = "fleetrun.io/role"
NPROC_LABEL = "fleetrun.io/nproc-per-node"
GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
"""Pod annotation naming its Volcano PodGroup."""
PODGROUP_API = ("scheduling.volcano.sh", "v1beta1", "podgroups")
MAX_NAME_LEN = 47
"""Longest job name: ``NAME-trainer-INDEX`` must stay a 63-character DNS label."""
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

TRAINER, SERVER, COORDINATOR, HETER = "trainer", "server", coordinator.ROLE, heter.HETER


TOKEN_KEY = "token"
"""Key of the token in the job's Secret."""


def object_names(spec: JobSpec) -> dict[str, str]:
    """Names of the job's objects: config, trainer (Service + Job), server (Service +
    StatefulSet), group (PodGroup), token (the PS job's Secret), coordinator (Service +
    StatefulSet)."""
    n = spec.name
    return {
        "config": f"{n}-config",
        TRAINER: f"{n}-{TRAINER}",
        SERVER: f"{n}-{SERVER}",
        HETER: f"{n}-{HETER}",
        "group": n,
        "token": f"{n}-ps-token",
        COORDINATOR: f"{n}-coord",
    }


def pod_host_pattern(spec: JobSpec, role: str) -> str:
    """DNS name of pod ``{index}`` of a role (a ``str.format`` pattern), resolvable in the
    namespace."""
    svc = object_names(spec)[role]
    return f"{svc}-{{index}}.{svc}.{spec.k8s.namespace}.svc"


def num_pods(spec: JobSpec, role: str) -> int:
    """Pods of a role: collective = one per node; PS = one per trainer / server / heter worker."""
    if spec.mode is Mode.PS:
        sizes = {TRAINER: spec.sizes.worker_num, SERVER: spec.sizes.server_num}
        return sizes.get(role, heter_count(spec) if role == HETER else 0)
    return spec.num_nodes if role == TRAINER else 0


def check_renderable(spec: JobSpec) -> None:
    """ConfigError for what Kubernetes would reject or the pods could not run."""
    if not _DNS_LABEL.match(spec.name) or len(spec.name) > MAX_NAME_LEN:
        raise ConfigError(
            f"{spec.name!r} cannot name Kubernetes objects: use lower-case letters, digits "
            "and '-', "
            f"starting and ending with a letter or digit, at most {MAX_NAME_LEN} characters "
            "(e.g. 'dp-demo')",
            key="name",
        )
    if not _DNS_LABEL.match(spec.k8s.namespace) or len(spec.k8s.namespace) > 63:
        raise ConfigError(
            f"{spec.k8s.namespace!r} is not a valid namespace name (a DNS label)",
            key="k8s.namespace",
        )
    if spec.mode is Mode.PS and spec.ps.servers:
        raise ConfigError(
            "static ps.servers/ps.workers lists are for the local scheduler; on "
            "Kubernetes give sizes.server_num and sizes.worker_num",
            key="ps.servers",
        )
    if spec.rendezvous.ips or spec.rendezvous.master_addr:
        raise ConfigError(
            "rendezvous.ips / master_addr are for the local scheduler; on Kubernetes "
            "the pods find each other through the job's Services",
            key="rendezvous",
        )
    volumes = {v.get("name") for v in spec.k8s.volumes}
    for i, mount in enumerate(spec.k8s.volume_mounts):
        if mount.get("name") not in volumes:
            raise ConfigError(
                f"mounts volume {mount.get('name')!r} but k8s.volumes has "
                f"{sorted(str(v) for v in volumes) or 'none'}; add it there",
                key=f"k8s.volume_mounts[{i}].name",
            )
        if str(mount.get("mountPath", "")).rstrip("/") == CONFIG_MOUNT:
            raise ConfigError(
                f"{CONFIG_MOUNT} is where fleetrun mounts the job's ConfigMap; pick "
                "another mountPath",
                key=f"k8s.volume_mounts[{i}].mountPath",
            )
    for role in (TRAINER, SERVER, HETER):
        scale_quantity(getattr(spec.resources, role).memory, 1, f"resources.{role}.memory")
    heter.check_heter_renderable(spec)
    if spec.elastic.enabled:
        elastic.check_elastic_renderable(spec)
    ps_recovery.check_checkpoint_volume(spec)
    if isinstance(spec.strategy, str):
        _read_text(spec.strategy)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise ConfigError(
            f"strategy file {path!r} cannot be read ({err.strerror}); it goes into the "
            "job's ConfigMap",
            key="strategy",
        ) from None


def labels(spec: JobSpec, role: str | None = None) -> dict[str, str]:
    """Labels every object (and pod) of the job carries; ``role`` adds fleetrun.io/role."""
    out = {
        "app.kubernetes.io/name": "fleetrun",
        "app.kubernetes.io/managed-by": "fleetrun",
        JOB_LABEL: spec.name,
    }
    if role:
        out[ROLE_LABEL] = role
    return out


def _meta(spec: JobSpec, name: str, role: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": spec.k8s.namespace, "labels": labels(spec, role)}


def render_configmap(spec: JobSpec) -> dict[str, Any]:
    """The DistributedStrategy the pods read as FLEET_STRATEGY (empty without one)."""
    data: dict[str, str] = {}
    if isinstance(spec.strategy, dict):
        data["strategy.yaml"] = yaml.safe_dump(spec.strategy, sort_keys=False)
    elif isinstance(spec.strategy, str):
        data["strategy.yaml"] = _read_text(spec.strategy)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(spec, object_names(spec)["config"]),
        "data": data,
    }


def render_token_secret(spec: JobSpec, token: str) -> dict[str, Any]:
    """The PS job's token (immutable; the pods read it through ``secretKeyRef``)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(spec, object_names(spec)["token"]),
        "type": "Opaque",
        "immutable": True,
        "stringData": {TOKEN_KEY: token},
    }


def render_service(spec: JobSpec, role: str) -> dict[str, Any]:
    """Headless Service giving each pod of ``role`` a stable DNS name (ready or not)."""
    port = {
        TRAINER: spec.k8s.master_port,
        SERVER: spec.k8s.server_port,
        HETER: spec.k8s.heter_port,
        COORDINATOR: coordinator.PORT,
    }[role]
    port_name = {TRAINER: "rendezvous", SERVER: "ps", HETER: HETER, COORDINATOR: COORDINATOR}[role]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, object_names(spec)[role], role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(spec, role),
            "ports": [
                {
                    "name": port_name,
                    "port": port,
                    "targetPort": port,
                    "protocol": "TCP",
                }
            ],
        },
    }


def pod_args(spec: JobSpec, role: str) -> list[str]:
    """Arguments of ``fleetrun pod`` for a role (see launcher.schedulers.k8s.pod)."""
    k = spec.k8s
    args = [
        "pod",
        "--role",
        role,
        "--job",
        spec.name,
        "--mode",
        str(spec.mode),
        "--trainer_host",
        pod_host_pattern(spec, TRAINER),
        "--master_port",
        str(k.master_port),
        "--trainers",
        str(num_pods(spec, TRAINER)),
        "--nproc_per_node",
        str(spec.sizes.nproc_per_node if spec.mode is Mode.COLLECTIVE else 1),
        "--backend",
        str(spec.backend),
        "--log_dir",
        spec.log_dir,
        "--run_id",
        spec.run_id or spec.name,
        "--grace_period",
        f"{spec.grace_period_s:g}",
        "--rdzv_timeout",
        f"{spec.rendezvous.timeout_s:g}",
    ]
    if spec.mode is Mode.PS:
        args += [
            "--server_host",
            pod_host_pattern(spec, SERVER),
            "--server_port",
            str(k.server_port),
            "--servers",
            str(num_pods(spec, SERVER)),
            *heter.pod_args(spec, pod_host_pattern(spec, HETER)),
        ]
    if spec.strategy is not None:
        args += ["--strategy", f"{CONFIG_MOUNT}/strategy.yaml"]
    args += warm_args(spec)
    entry = spec.entrypoint
    if entry.module:
        args += ["--module"]
    if entry.no_python:
        args += ["--no_python"]
    return [*args, "--", str(entry.module or entry.script), *entry.args]


def _resources(res: RoleResources, nproc: int, role: str) -> dict[str, Any]:
    cpu = cpu_quantity(res.cpu * nproc)
    memory = scale_quantity(res.memory, nproc, f"resources.{role}.memory")
    out: dict[str, Any] = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    if res.gpu:
        out["limits"][GPU_RESOURCE] = out["requests"][GPU_RESOURCE] = str(res.gpu * nproc)
    return out


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


SSD_VOLUME = "ps-ssd"
"""The server pods' volume at ``--ps_ssd_dir`` when no k8s.volume_mounts entry covers it."""


def _ssd_volume(
    spec: JobSpec, role: str, env: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A server pod's SSD directory (``--ps_ssd_dir``): FLEET_PS_SSD_ROOT is
    ``<dir>/<pod name>`` (appended to ``env`` after FLEET_POD_NAME, which the kubelet expands);
    the directory is the pod's own ``emptyDir`` (node-local scratch, as the tier files are)
    unless a k8s.volume_mounts entry already covers it (e.g. a hostPath on a node's NVMe).
    Returns (volumes, mounts) to add."""
    ssd_dir = spec.ps.ssd_dir if spec.mode is Mode.PS and role == SERVER else None
    if not ssd_dir:
        return [], []
    ssd_dir = ssd_dir.rstrip("/") or "/"
    env.append({"name": FLEET_PS_SSD_ROOT, "value": f"{ssd_dir}/$(FLEET_POD_NAME)"})
    for mount in spec.k8s.volume_mounts:
        path = str(mount.get("mountPath", "")).rstrip("/")
        if not mount.get("readOnly") and (ssd_dir == path or ssd_dir.startswith(path + "/")):
            return [], []
    return [{"name": SSD_VOLUME, "emptyDir": {}}], [{"name": SSD_VOLUME, "mountPath": ssd_dir}]


def render_pod_template(spec: JobSpec, role: str) -> dict[str, Any]:
    """Pod template of a role: container, resources, env, scheduling, volumes, scrape
    annotations."""
    k, names = spec.k8s, object_names(spec)
    nproc = spec.sizes.nproc_per_node if spec.mode is Mode.COLLECTIVE and role == TRAINER else 1
    env: list[dict[str, Any]] = [  # the token comes from the Secret, never as a plain value
        {"name": key, "value": str(value)}
        for key, value in spec.env.items()
        if key != FLEET_PS_TOKEN
    ]
    elastic_pod = spec.elastic.enabled and role == TRAINER  # node ranks come from the rendezvous
    if (
        role == TRAINER and not elastic_pod
    ):  # the StatefulSet's servers: ordinal from FLEET_POD_NAME
        env.append(_field_env("FLEET_POD_INDEX", f"metadata.annotations['{INDEX_ANNOTATION}']"))
    if spec.mode is Mode.PS:
        secret = {"name": names["token"], "key": TOKEN_KEY}
        env.append({"name": FLEET_PS_TOKEN, "valueFrom": {"secretKeyRef": secret}})
        if role == SERVER and FLEET_PS_CHECKPOINT_ROOT not in spec.env:
            # where Save requests may write: the working directory, the log dir, the volumes
            writable = [m["mountPath"] for m in k.volume_mounts if not m.get("readOnly")]
            roots = dict.fromkeys([".", spec.log_dir, *writable])
            env.append({"name": FLEET_PS_CHECKPOINT_ROOT, "value": ":".join(roots)})
        env += ps_recovery.checkpoint_env(spec, role)  # the volume is a writable mount: a root
        if coordinator.wanted(spec):  # trainers meet there; every pod waits for it to join
            env.append({"name": FLEET_PS_COORDINATOR, "value": coordinator_endpoint(spec)})
    env += [
        _field_env("FLEET_POD_NAME", "metadata.name"),
        _field_env("FLEET_POD_NAMESPACE", "metadata.namespace"),
        _field_env("FLEET_POD_IP", "status.podIP"),
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    ssd_volumes, ssd_mounts = _ssd_volume(spec, role, env)
    metrics = bool(getattr(spec, "metrics", True))
    if metrics:  # Prometheus scrapes the pod IP: the endpoint binds that address, not 0.0.0.0
        env += [  # $(FLEET_POD_IP) is expanded by the kubelet (defined above, downward API)
            {"name": "FLEET_METRICS_PORT", "value": str(k.metrics_port)},
            {"name": "FLEET_METRICS_HOST", "value": "$(FLEET_POD_IP)"},
        ]
    own_port = {TRAINER: k.master_port, HETER: k.heter_port}.get(role, k.server_port)
    ports = (
        []
        if elastic_pod
        else [
            {
                "name": {TRAINER: "rendezvous", HETER: HETER}.get(role, "ps"),
                "containerPort": own_port,
            }
        ]
    )
    ports += [
        {"name": f"metrics-{r}" if r else "metrics", "containerPort": k.metrics_port + r}
        for r in range(nproc if metrics else 0)
    ]
    container: dict[str, Any] = {
        "name": role,
        "image": k.image,
        "imagePullPolicy": str(k.image_pull_policy),
        "command": ["fleetrun"],
        "args": (
            elastic.agent_args(
                spec, f"{CONFIG_MOUNT}/strategy.yaml" if spec.strategy is not None else None
            )
            if elastic_pod
            else pod_args(spec, role)
        ),
        "env": env,
        "ports": ports,
        "resources": _resources(getattr(spec.resources, role), nproc, role),
        "volumeMounts": [
            {"name": "fleetrun-config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            *k.volume_mounts,
            *ssd_mounts,
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    annotations = (
        {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(k.metrics_port),
            "prometheus.io/path": "/metrics",
        }
        if metrics
        else {}
    )
    if k.gang:
        annotations[GROUP_ANNOTATION] = names["group"]
    pod: dict[str, Any] = {
        "restartPolicy": "Never" if role == TRAINER else "Always",
        "containers": [container],
        "volumes": [
            {"name": "fleetrun-config", "configMap": {"name": names["config"]}},
            *k.volumes,
            *ssd_volumes,
        ],
        "terminationGracePeriodSeconds": int(spec.grace_period_s) + 25,
    }
    if role == TRAINER and not elastic_pod:
        pod["subdomain"] = names[TRAINER]
    _schedule(spec, pod)
    pod_labels = labels(spec, role)
    pod_labels[NPROC_LABEL] = str(nproc)
    return {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod}


def _schedule(spec: JobSpec, pod: dict[str, Any]) -> None:
    """The job's scheduling settings on a pod spec (service account, node selector,
    tolerations, scheduler)."""
    k = spec.k8s
    if k.service_account:
        pod["serviceAccountName"] = k.service_account
    if k.node_selector:
        pod["nodeSelector"] = dict(k.node_selector)
    if k.tolerations:
        pod["tolerations"] = list(k.tolerations)
    scheduler = k.scheduler_name or ("volcano" if k.gang else None)
    if scheduler:
        pod["schedulerName"] = scheduler


def coordinator_endpoint(spec: JobSpec) -> str:
    """FLEET_PS_COORDINATOR of the job's pods: the coordinator pod's DNS name and port."""
    return f"{pod_host_pattern(spec, COORDINATOR).format(index=0)}:{coordinator.PORT}"


def render_coordinator_statefulset(spec: JobSpec) -> dict[str, Any]:
    """The PS trainers' coordinator: a 1-replica StatefulSet (at most one pod; stable DNS name
    through the headless Service ``N-coord``; see :mod:`launcher.schedulers.k8s.coordinator`)."""
    names = object_names(spec)
    token_ref = {"name": names["token"], "key": TOKEN_KEY}
    container = coordinator.coordinator_container(
        spec, num_pods(spec, TRAINER), num_pods(spec, SERVER), token_ref
    )
    pod: dict[str, Any] = {
        "restartPolicy": "Always",
        "containers": [container],
        "volumes": list(spec.k8s.volumes),
        "terminationGracePeriodSeconds": 10,
    }
    _schedule(spec, pod)
    annotations = {GROUP_ANNOTATION: names["group"]} if spec.k8s.gang else {}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(spec, names[COORDINATOR], COORDINATOR),
        "spec": {
            "serviceName": names[COORDINATOR],
            "replicas": 1,
            "selector": {"matchLabels": labels(spec, COORDINATOR)},
            "template": {
                "metadata": {"labels": labels(spec, COORDINATOR), "annotations": annotations},
                "spec": pod,
            },
        },
    }


def render_trainer_job(spec: JobSpec) -> dict[str, Any]:
    """The trainers: an Indexed Job; pod index = node rank (collective) or trainer id (PS)."""
    pods = num_pods(spec, TRAINER)
    meta = _meta(spec, object_names(spec)[TRAINER], TRAINER)
    if spec.elastic.enabled:  # one elastic agent per pod, MIN..MAX pods
        job_spec = elastic.elastic_job_spec(spec, render_pod_template(spec, TRAINER))
        meta["annotations"] = elastic.node_range_annotations(spec)
    else:
        job_spec = {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            # A failed pod is re-created while the budget lasts; every pod of a group may fail
            # once per restart of the group (its peers lose it), hence max_restarts x pods.
            "backoffLimit": spec.max_restarts * pods,
            "template": render_pod_template(spec, TRAINER),
        }
        policy = ps_recovery.pod_failure_policy(spec) if spec.mode is Mode.PS else None
        if policy is not None:  # a pod finding that the job cannot recover fails it at once
            job_spec["podFailurePolicy"] = policy
    if spec.k8s.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = spec.k8s.ttl_seconds_after_finished
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}


def render_server_statefulset(spec: JobSpec) -> dict[str, Any]:
    """The parameter servers: a StatefulSet (stable names; ordinal = server index)."""
    name = object_names(spec)[SERVER]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(spec, name, SERVER),
        "spec": {
            "serviceName": name,
            "replicas": num_pods(spec, SERVER),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels(spec, SERVER)},
            "template": render_pod_template(spec, SERVER),
        },
    }


def render_podgroup(spec: JobSpec) -> dict[str, Any]:
    """Volcano PodGroup: schedule every pod of the job at once or none (minMember = all pods)."""
    group, version, _ = PODGROUP_API
    total = sum(num_pods(spec, r) for r in (TRAINER, SERVER, HETER)) + int(coordinator.wanted(spec))
    if spec.elastic.enabled:  # the job may run with MIN nodes (its etcd is not in the group)
        total = int(spec.elastic.min_nodes or 1)
    return {
        "apiVersion": f"{group}/{version}",
        "kind": "PodGroup",
        "metadata": _meta(spec, object_names(spec)["group"]),
        "spec": {"minMember": total},
    }


def render_job(spec: JobSpec, ps_token: str | None = None) -> list[dict[str, Any]]:
    """Every object of the job, in apply order (ConfigMap, Secret, Services, PodGroup,
    StatefulSets — the coordinator's first —, Job); ``ps_token``: the PS job's token (None:
    :func:`~launcher.ps_env.job_ps_token`)."""
    check_renderable(spec)
    objs = [render_configmap(spec)]
    if spec.mode is Mode.PS:
        objs.append(render_token_secret(spec, ps_token or job_ps_token(spec)))
    if spec.elastic.enabled:  # the agents meet at the rendezvous endpoint, not through DNS
        if elastic.renders_etcd(spec):
            objs += elastic.render_etcd(spec, labels(spec, elastic.ETCD))
    else:
        objs.append(render_service(spec, TRAINER))
    has_coordinator = coordinator.wanted(spec)
    if has_coordinator:
        objs.append(render_service(spec, COORDINATOR))
    if spec.mode is Mode.PS:
        objs.append(render_service(spec, SERVER))
    if heter.wanted(spec):
        objs.append(render_service(spec, HETER))
    if spec.k8s.gang:
        objs.append(render_podgroup(spec))
    if has_coordinator:
        objs.append(render_coordinator_statefulset(spec))
    if spec.mode is Mode.PS:
        objs.append(render_server_statefulset(spec))
    if heter.wanted(spec):
        name = object_names(spec)[HETER]
        meta, pods = _meta(spec, name, HETER), render_pod_template(spec, HETER)
        objs.append(heter.render_statefulset(spec, name, meta, labels(spec, HETER), pods))
    objs.append(render_trainer_job(spec))
    return objs


__all__ = [
    "CONFIG_MOUNT",
    "check_renderable",
    "object_names",
    "pod_args",
    "pod_host_pattern",
    "render_job",
    "to_yaml",
]
