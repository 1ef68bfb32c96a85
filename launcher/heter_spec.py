"""Heterogeneous PS jobs in the job spec: heter workers' count, endpoints and devices.

A heterogeneous parameter-server job adds device workers (``TRAINING_ROLE=HETER_TRAINER``,
:mod:`fleet.heter`) to its servers and CPU trainers::

    fleetrun --server_num 2 --worker_num 4 --heter_worker_num 2 --heter_devices cuda train.py

    sizes: {server_num: 2, worker_num: 4, heter_worker_num: 2}
    ps:
      heter_devices: [cuda:0, cuda:1]     # one for all, or one per heter worker; default cpu
      # heter_workers: [10.0.0.5:8600, 10.0.0.6:8600]   static layout, as ps.servers

Devices are ``cpu``, ``cuda`` or ``cuda:N``; Paddle's ``gpu`` / ``gpu:N`` are read as
``cuda`` / ``cuda:N``. Only the spelling and the count are checked here (the launcher imports
no torch): a heter worker checks at start that its device exists. :func:`check_heter_spec`
checks what needs the whole spec. Standard library only: the CLI imports this at start.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from collective.errors import ConfigError

if TYPE_CHECKING:  # the spec imports this module; no runtime cycle
    from launcher.spec import JobSpec

HETER = "heter"
"""The heter workers' role name in the launcher (logs ``heterlog.N``, ``job_state.json``,
metrics labels, the dashboard)."""

_DEVICE = re.compile(r"^(cpu|cuda|gpu)(?::(\d+))?$")


def parse_heter_device(value: Any, path: str) -> str:
    """One heter worker's device in canonical form: ``cpu``, ``cuda`` or ``cuda:N`` (``gpu`` and
    ``gpu:N`` read as cuda); ConfigError naming ``path`` otherwise."""
    text = str(value).strip().lower()
    m = _DEVICE.match(text)
    if not m or (m.group(1) == "cpu" and m.group(2) is not None):
        raise ConfigError(
            f"{value!r} is not a heter worker device; use cpu, cuda, cuda:N (or Paddle's gpu, "
            "gpu:N)",
            key=path,
        )
    kind = "cpu" if m.group(1) == "cpu" else "cuda"
    return kind if m.group(2) is None else f"{kind}:{int(m.group(2))}"


def parse_heter_devices(value: Any, path: str) -> tuple[str, ...]:
    """``ps.heter_devices`` / ``--heter_devices``: one device, a comma list or a YAML list."""
    if value is None:
        return ()
    if isinstance(value, str):
        items: list[Any] = [v for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(
            f"expected a device or a list of devices (cpu, cuda, cuda:N), got {value!r}", key=path
        )
    return tuple(parse_heter_device(v, f"{path}[{i}]") for i, v in enumerate(items))


def is_gpu_device(device: str) -> bool:
    """Whether a (canonical) heter device needs a GPU of its node."""
    return device.startswith("cuda")


def device_gpus(device: str) -> int:
    """GPUs a heter worker's process must see for its device: 0 for cpu, 1 for ``cuda``,
    N+1 for ``cuda:N`` (a Ray actor or a Kubernetes pod sees only its own GPUs, from 0)."""
    if not is_gpu_device(device):
        return 0
    _, _, index = device.partition(":")
    return int(index or 0) + 1


def heter_count(spec: JobSpec) -> int:
    """Heter workers of the job (``ps.heter_workers`` when listed, else ``sizes.heter_worker_num``)."""
    return len(spec.ps.heter_workers) or spec.sizes.heter_worker_num


def heter_devices(spec: JobSpec) -> tuple[str, ...]:
    """Each heter worker's device, by index (``cpu`` when none is given)."""
    n, given = heter_count(spec), spec.ps.heter_devices
    if not given:
        return ("cpu",) * n
    return given if len(given) == n else (given[0],) * n


def check_heter_spec(spec: JobSpec) -> None:
    """ConfigError for heter settings the job cannot run: heter workers in a collective job or
    without servers, a ``heter_workers`` list that disagrees with ``heter_worker_num``, a static
    list mixed with placed servers, a device list of the wrong length."""
    ps, sizes = spec.ps, spec.sizes
    n_list, n_num = len(ps.heter_workers), sizes.heter_worker_num
    if not (n_list or n_num or ps.heter_devices):
        return
    key = "ps.heter_workers" if n_list else "sizes.heter_worker_num"
    if not (n_list or n_num):
        raise ConfigError(
            "heter devices are given but the job has no heter workers; add --heter_worker_num N "
            "(sizes.heter_worker_num) or drop --heter_devices",
            key="ps.heter_devices",
        )
    if not (sizes.server_num or ps.servers):
        raise ConfigError(
            "heter workers serve the CPU trainers of a parameter-server job, which has no "
            "servers here; add --server_num N (sizes.server_num) or ps.servers, or drop the heter "
            "workers",
            key=key,
        )
    if str(spec.mode) != "ps":
        raise ConfigError(
            "heter workers are for PS jobs but mode is 'collective'; use mode: ps (--run_mode ps) "
            "or drop the heter workers",
            key="mode",
        )
    if n_list and n_num not in (0, n_list):
        raise ConfigError(
            f"is {n_num} but ps.heter_workers (--heter_workers) lists {n_list}; drop one of them",
            key="sizes.heter_worker_num",
        )
    if n_list and not ps.servers:
        raise ConfigError(
            "a static heter worker list (--heter_workers) goes with static ps.servers/ps.workers "
            "lists (--servers/--workers); give those too, or use --heter_worker_num N",
            key="ps.heter_workers",
        )
    if ps.servers and n_num and not n_list:
        raise ConfigError(
            "with static ps.servers/ps.workers lists, list the heter workers' endpoints too: "
            "--heter_workers ip:port,... (ps.heter_workers)",
            key="sizes.heter_worker_num",
        )
    n = n_list or n_num
    if len(ps.heter_devices) not in (0, 1, n):
        raise ConfigError(
            f"lists {len(ps.heter_devices)} devices for {n} heter workers; give one device for "
            f"all of them or exactly {n}",
            key="ps.heter_devices",
        )


__all__ = [
    "HETER",
    "check_heter_spec",
    "device_gpus",
    "heter_count",
    "heter_devices",
    "is_gpu_device",
    "parse_heter_device",
    "parse_heter_devices",
]
