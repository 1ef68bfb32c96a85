"""Connect the Ray scheduler to a cluster: join one (``ray.address``) or start a local one on loopback.

Which settings keep a local cluster on 127.0.0.1 (Ray 2.60, checked with ``ss -ltnp`` and
psutil: every listener of the gcs_server, raylet, runtime-env agent, core workers and actors was
on 127.0.0.1 / ``::ffff:127.0.0.1``, none on ``*`` or the host's routable address):

* ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment **before** ``import ray``: without
  it Ray 2.60 silently replaces ``_node_ip_address="127.0.0.1"`` by the host's routable address
  and its servers bind to that / to all interfaces;
* ``ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)``: the node address every
  server binds to, and no dashboard (its HTTP server would be one more listener);
* ``RAY_USAGE_STATS_ENABLED=0``: no usage-stats reporting (no outbound traffic either);
* ``ray.init(address="local")``: always a new cluster; a plain ``ray.init()`` would join the
  cluster a ``ray start`` left in ``/tmp/ray/ray_current_cluster``.

Without ``ray.address`` the ``RAY_ADDRESS`` environment variable is used, as Ray does.

Ray's token authentication stays as Ray sets it (on by default for a new local cluster). When
joining a cluster by address, ``RAY_AUTH_MODE=token`` is set (unless the user set the mode) when a
token is available (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``): Ray's
driver does not pick the mode up by itself and a ``ray start --head`` cluster rejects it otherwise.

``ray`` is imported only inside these functions: the CLI must not import ray at start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from collective.errors import ConfigError, LaunchError
from launcher.scheduler_spec import RayConfig

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

LOOPBACK_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
"""Set in ``os.environ`` before ``import ray`` (see the module docstring)."""


@dataclass(frozen=True)
class ClusterHandle:
    """The cluster this fleetrun run is attached to."""

    address: str
    """What the driver connected to (``local`` for a cluster it started)."""
    started_here: bool
    """True when fleetrun started the cluster (and must shut it down)."""


def _token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(
        os.path.expanduser("~"), ".ray", "auth_token"
    )
    return os.path.isfile(path)


def prepare_ray_env(joining: bool) -> None:
    """Environment Ray reads at import/init (must run before ``import ray``)."""
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    if joining and "RAY_AUTH_MODE" not in os.environ and _token_available():
        os.environ["RAY_AUTH_MODE"] = "token"


def local_num_cpus(cfg: RayConfig, requested: float) -> int:
    """CPUs of a local cluster: ``num_cpus`` if given, else enough logical CPUs for the job's
    bundles and at least this machine's count."""
    if cfg.num_cpus is not None:
        return cfg.num_cpus
    need = int(requested) + (0 if float(requested).is_integer() else 1)
    return max(os.cpu_count() or 1, need)


def connect(
    cfg: RayConfig, requested_cpus: float, runtime_env: dict[str, Any] | None
) -> ClusterHandle:
    """``ray.init`` for this job: join ``cfg.address`` or start a local cluster on 127.0.0.1."""
    address = cfg.address or os.environ.get("RAY_ADDRESS") or None  # Ray's own convention
    prepare_ray_env(joining=address is not None)
    try:
        import ray
    except ImportError as err:
        raise LaunchError(
            f"--scheduler ray needs the ray package ({err}); install it: "
            "`pip install -c constraints.txt 'ray[train]'`"
        ) from None
    if ray.is_initialized():  # a caller (tests, notebooks) already connected this process
        return ClusterHandle(address="existing", started_here=False)
    common: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
    if runtime_env:
        common["runtime_env"] = runtime_env
    if address is None:
        num_cpus = local_num_cpus(cfg, requested_cpus)
        logger.info(
            "starting a local Ray cluster on %s (%d CPUs, no dashboard, usage stats off)",
            LOOPBACK,
            num_cpus,
        )
        try:
            # "local": always a new cluster (plain ray.init() would join one `ray start` left behind)
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                _node_ip_address=LOOPBACK,
                **common,
            )
        except (RuntimeError, ConnectionError, ValueError) as err:
            raise LaunchError(f"could not start a local Ray cluster: {err}") from None
        return ClusterHandle(address="local", started_here=True)
    logger.info("joining the Ray cluster at %s", address)
    try:
        ray.init(address=address, **common)
    except (RuntimeError, ConnectionError, ValueError) as err:
        raise ConfigError(
            f"could not connect to the Ray cluster at {address!r}: {str(err).splitlines()[0]}; "
            "check that it is running (`ray status`), or leave ray.address out to start a local one",
            key="ray.address",
        ) from None
    return ClusterHandle(address=address, started_here=False)


def disconnect(handle: ClusterHandle | None) -> None:
    """``ray.shutdown()``: disconnects the driver and stops a cluster this process started."""
    if handle is None or handle.address == "existing":
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()


def non_loopback_listeners(pids: Iterable[int]) -> list[str]:
    """``ip:port (process)`` of every TCP listener of ``pids`` not on a loopback address."""
    import psutil

    wanted = set(pids)
    out = []
    for conn in psutil.net_connections("tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in wanted or not conn.laddr:
            continue
        ip = conn.laddr.ip
        if ip.startswith(("127.", "::ffff:127.")) or ip == "::1":
            continue
        try:
            name = psutil.Process(conn.pid).name()
        except psutil.Error:
            name = "?"
        out.append(f"{ip}:{conn.laddr.port} ({name}, pid {conn.pid})")
    return out
