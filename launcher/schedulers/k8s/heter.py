"""Heter workers of a heterogeneous PS job on Kubernetes (pure functions, as
:mod:`launcher.schedulers.k8s.render`, which calls them).

A PS job with ``sizes.heter_worker_num: H`` also gets::

    Service     N-heter   headless; heter worker i is N-heter-i.N-heter.NS.svc
    StatefulSet N-heter   H replicas (ordinal = heter index), restartPolicy Always

Each heter pod serves the CPU trainers on ``k8s.heter_port``, runs ``fleetrun pod --role heter`` with the env of
``collective.env.make_ps_heter_env`` (TRAINING_ROLE=HETER_TRAINER, POD_IP:PADDLE_PORT = its DNS
name and port, PADDLE_HETER_TRAINER_DEVICE), and every pod of the job gets
PADDLE_HETER_TRAINER_IP_PORT_LIST from the ``--heter_*`` arguments of ``fleetrun pod``.

Devices: a cuda heter worker's pod asks for ``nvidia.com/gpu`` (1 for ``cuda`` / ``cuda:0``,
N+1 for ``cuda:N``: the pod sees only its own GPUs, numbered from 0; or ``resources.heter.gpu``
when larger). The pods share one template, so the heter workers of a job must use one device
kind (all cpu or all cuda). A heter pod that dies is restarted by its StatefulSet, alone, on its
DNS name.
"""

from __future__ import annotations

from typing import Any

from collective.errors import ConfigError
from launcher.heter_spec import HETER, device_gpus, heter_count, heter_devices, is_gpu_device
from launcher.schedulers.k8s.formats import GPU_RESOURCE
from launcher.spec import JobSpec, Mode


def wanted(spec: JobSpec) -> bool:
    """Whether the job has heter workers (a PS job with ``heter_worker_num`` > 0)."""
    return spec.mode is Mode.PS and heter_count(spec) > 0


def check_heter_renderable(spec: JobSpec) -> None:
    """ConfigError for heter settings Kubernetes cannot run: static endpoint lists, device kinds
    mixed in one StatefulSet."""
    if not wanted(spec):
        return
    if spec.ps.heter_workers:
        raise ConfigError(
            "static ps.heter_workers lists are for the local scheduler; on Kubernetes give "
            "sizes.heter_worker_num (--heter_worker_num)",
            key="ps.heter_workers",
        )
    kinds = {is_gpu_device(d) for d in heter_devices(spec)}
    if len(kinds) > 1:
        raise ConfigError(
            "on Kubernetes the heter workers share one pod template: give them one device kind "
            f"(all cpu or all cuda), got {','.join(heter_devices(spec))}",
            key="ps.heter_devices",
        )


def heter_gpus(spec: JobSpec) -> int:
    """GPUs a heter pod asks for: what its device index needs (``cuda:N`` → N+1), or
    ``resources.heter.gpu`` when larger; 0 for cpu heter workers."""
    need = max(device_gpus(d) for d in heter_devices(spec))
    return max(need, spec.resources.heter.gpu) if need else spec.resources.heter.gpu


def add_gpu_limit(spec: JobSpec, template: dict[str, Any]) -> dict[str, Any]:
    """The heter pod template with its GPU request and limit (:func:`heter_gpus`)."""
    gpus = heter_gpus(spec)
    if gpus:
        res = template["spec"]["containers"][0]["resources"]
        res["limits"][GPU_RESOURCE] = res["requests"][GPU_RESOURCE] = str(gpus)
    return template


def pod_args(spec: JobSpec, host_pattern: str) -> list[str]:
    """The ``fleetrun pod`` arguments every pod of a heter job gets (none without heter
    workers): the heter pods' DNS pattern, their count and devices."""
    if not wanted(spec):
        return []
    return [
        "--heter_host",
        host_pattern,
        "--heter_port",
        str(spec.k8s.heter_port),
        "--heters",
        str(heter_count(spec)),
        "--heter_devices",
        ",".join(heter_devices(spec)),
    ]


def render_statefulset(
    spec: JobSpec, name: str, meta: dict[str, Any], selector: dict[str, str], template: Any
) -> dict[str, Any]:
    """The heter workers: a StatefulSet (stable names; ordinal = heter index), as the servers'."""
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "serviceName": name,
            "replicas": heter_count(spec),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": add_gpu_limit(spec, template),
        },
    }


__all__ = [
    "HETER",
    "add_gpu_limit",
    "check_heter_renderable",
    "heter_gpus",
    "pod_args",
    "render_statefulset",
    "wanted",
]
