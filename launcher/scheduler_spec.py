"""The job spec's scheduler sections: ``ray:`` (:class:`RayConfig`) and ``k8s:``
(:class:`K8sConfig`), with their enums. Standard library only; :mod:`launcher.spec` holds them
in :class:`~launcher.spec.JobSpec` and re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from collective.env_base import StrEnum
from collective.typed_config import require


class PlacementStrategy(StrEnum):
    """How Ray places a job's actors on nodes (Ray placement-group strategies)."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


@dataclass(frozen=True)
class RayConfig:
    """The ``ray:`` section: where the Ray scheduler runs the job."""

    address: str | None = None
    """Cluster to join: ``auto``, ``ray://host:port`` or ``host:port``; none = start a local
    cluster bound to 127.0.0.1 (usage stats off) for this job."""
    runtime_env: dict[str, Any] = field(default_factory=dict)
    """Ray runtime_env for every actor (working_dir, pip, env_vars...)."""
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    """Placement-group strategy for the job's bundles."""
    num_cpus: int | None = None
    """CPUs of the local cluster started when ``address`` is none (default: this machine's, or
    more when the job's bundles ask for more: logical CPUs, as Ray's ``num_cpus``)."""
    placement_timeout_s: float = 120.0
    """How long to wait for the placement group (all bundles) before failing, in seconds."""

    def __post_init__(self) -> None:
        if self.num_cpus is not None:
            require(self.num_cpus >= 1, "num_cpus", f"must be >= 1, got {self.num_cpus}")
        require(
            self.placement_timeout_s > 0,
            "placement_timeout_s",
            f"must be > 0, got {self.placement_timeout_s}",
        )


class PullPolicy(StrEnum):
    """Kubernetes imagePullPolicy."""

    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class CleanupPolicy(StrEnum):
    """Which of a Kubernetes job's objects the launcher deletes when its trainers finish."""

    ON_SUCCESS = "on_success"
    ALWAYS = "always"
    NEVER = "never"


@dataclass(frozen=True)
class K8sConfig:
    """The ``k8s:`` section: how the Kubernetes scheduler renders the job's objects."""

    namespace: str = "default"
    """Namespace of every object."""
    image: str = "fleetrun:latest"
    """Container image (see Dockerfile); it must hold fleetrun and the entrypoint."""
    image_pull_policy: PullPolicy = PullPolicy.IF_NOT_PRESENT
    """imagePullPolicy of every container."""
    service_account: str | None = None
    """serviceAccountName of the pods."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """nodeSelector of the pods."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Pod tolerations, as in the Kubernetes API."""
    volumes: list[dict[str, Any]] = field(default_factory=list)
    """Pod volumes, as in the Kubernetes API."""
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    """Container volumeMounts, as in the Kubernetes API."""
    scheduler_name: str | None = None
    """schedulerName of the pods (e.g. ``volcano``)."""
    gang: bool = False
    """Gang scheduling: a Volcano PodGroup whose minMember is every pod of the job (all or none
    start); the pods get ``schedulerName: volcano`` unless ``scheduler_name`` says otherwise."""
    cleanup: CleanupPolicy = CleanupPolicy.ON_SUCCESS
    """What the launcher deletes when the trainers' Job ends: on_success (keep a failed job's
    objects for ``kubectl``/``fleetrun logs``), always, or never."""
    ttl_seconds_after_finished: int | None = None
    """Job ttlSecondsAfterFinished: Kubernetes deletes the finished Job, and with it (owner
    references) the job's other objects, this many seconds after it ends; none = keep."""
    master_port: int = 29500
    """Container port of the trainers' rendezvous (rank 0's store) and endpoints."""
    server_port: int = 8500
    """Container port every parameter server serves on (PS mode)."""
    heter_port: int = 8600
    """Container port every heter worker serves the CPU trainers on (heterogeneous PS)."""
    metrics_port: int = 9400
    """Container port of the Prometheus ``/metrics`` endpoint (FLEET_METRICS_PORT; local rank r
    of a pod uses metrics_port + r); the pods carry prometheus.io scrape annotations for it."""

    def __post_init__(self) -> None:
        names = ("master_port", "server_port", "heter_port", "metrics_port")
        ports = [getattr(self, name) for name in names]
        for name, port in zip(names, ports):
            require(0 < port < 65536, name, f"must be a port 1..65535, got {port}")
        require(
            len(set(ports)) == 4,
            "metrics_port",
            f"master_port, server_port, heter_port and metrics_port must differ (got {ports})",
        )
        if self.ttl_seconds_after_finished is not None:
            require(
                self.ttl_seconds_after_finished >= 0,
                "ttl_seconds_after_finished",
                f"must be >= 0 seconds, got {self.ttl_seconds_after_finished}",
            )


__all__ = ["CleanupPolicy", "K8sConfig", "PlacementStrategy", "PullPolicy", "RayConfig"]
