"""The job spec: one YAML schema for every scheduler and both modes, as frozen dataclasses.

Example (``configs/dp_local.yaml``)::

    name: dp-demo
    entrypoint: {script: examples/dp/train.py, args: ["--steps", "60"]}
    mode: collective
    sizes: {nnodes: 1, nproc_per_node: 2}
    log_dir: log
    max_restarts: 0

Precedence when the CLI builds a spec: YAML < environment (``FLEETRUN_*``) < CLI flag. Every
field has a docstring; ``__post_init__`` checks raise ConfigError naming the key path.
Standard library + PyYAML only (the CLI imports this at start).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from collective.env import Backend, StrEnum
from collective.errors import ConfigError
from collective.typed_config import from_dict, require, to_dict
from launcher.elastic.config import ElasticConfig, check_elastic_spec, normalize_elastic
from launcher.heter_spec import check_heter_spec, parse_heter_devices
from launcher.scheduler_spec import K8sConfig, RayConfig

DEFAULT_MULTINODE_PORT = 29500
"""Rendezvous port used when nodes > 1 and none is given (torchrun's default)."""


class Mode(StrEnum):
    """Job mode."""

    COLLECTIVE = "collective"
    PS = "ps"


class SchedulerKind(StrEnum):
    """Where the job runs."""

    LOCAL = "local"
    RAY = "ray"
    K8S = "k8s"


class Tee(StrEnum):
    """Which workers' output the console shows (all of it always goes to ``log_dir``)."""

    RANK0 = "rank0"
    """Rank 0's lines, unprefixed (default)."""
    ALL = "all"
    """Every rank's lines, prefixed ``[rank N]``."""
    NONE = "none"
    """Nothing; read ``log_dir/workerlog.N``."""


class WarmStart(StrEnum):
    """Whether workers are forked from the job's warm process (``launcher.warm``)."""

    ON = "on"
    """Python workers (and their restarts) are forked from a per-node process that imported
    torch, fleet and ``warm_imports`` once; anything else starts afresh (default)."""
    OFF = "off"
    """Every worker starts afresh."""


def split_modules(text: str) -> list[str]:
    """``--warm_imports a,b.c`` as the job file's list; ConfigError naming a bad module name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(
                f"{name!r} is not a module name (like numpy or pkg.mod)", key="warm_imports"
            )
    return names


def detect_gpu_count() -> int:
    """Number of visible NVIDIA GPUs without importing torch (CUDA_VISIBLE_DEVICES, /dev, nvidia-smi)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if not os.path.exists("/dev/nvidiactl"):
        return 0
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def parse_nproc(value: Any, path: str) -> int:
    """``nproc_per_node``: a positive integer, or ``auto`` (= number of GPUs, or 1 without)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return max(detect_gpu_count(), 1)
    if isinstance(value, str) and value.strip().lower() == "gpu":
        n = detect_gpu_count()
        if n == 0:
            raise ConfigError("'gpu' asks for one process per GPU but no GPU is visible", key=path)
        return n
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"expected a positive integer or 'auto', got {value!r}", key=path)
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(
            f"expected a positive integer or 'auto', got {value!r}", key=path
        ) from None
    return n


@dataclass(frozen=True)
class Entrypoint:
    """What every trainer runs."""

    script: str | None = None
    """Path of the training script (``python -u SCRIPT ARGS``), or an executable with no_python."""
    module: str | None = None
    """Module to run instead of a script (``python -u -m MODULE ARGS``)."""
    args: tuple[str, ...] = ()
    """Arguments passed to the script or module."""
    no_python: bool = False
    """Run ``script`` directly as an executable instead of through Python."""

    def __post_init__(self) -> None:
        require(
            not (self.script and self.module),
            "script",
            f"give either a script or a module, not both (script={self.script!r}, "
            f"module={self.module!r})",
        )
        require(
            not (self.module and self.no_python),
            "no_python",
            "no_python needs a script, not a module",
        )


@dataclass(frozen=True)
class Sizes:
    """How many processes of each role."""

    nnodes: int = 1
    """Number of nodes (machines) of a collective job."""
    nproc_per_node: int = field(default=1, metadata={"parse": parse_nproc})
    """Trainers per node: an integer, or ``auto`` (one per GPU, 1 without GPUs)."""
    server_num: int = 0
    """Parameter servers (PS mode)."""
    worker_num: int = 0
    """Trainers (PS mode)."""
    heter_worker_num: int = 0
    """Heter workers (heterogeneous PS: device workers for the dense half; ``launcher.heter_spec``)."""

    def __post_init__(self) -> None:
        require(self.nnodes >= 1, "nnodes", f"must be >= 1, got {self.nnodes}")
        require(
            self.nproc_per_node >= 1, "nproc_per_node", f"must be >= 1, got {self.nproc_per_node}"
        )
        require(self.server_num >= 0, "server_num", f"must be >= 0, got {self.server_num}")
        require(self.worker_num >= 0, "worker_num", f"must be >= 0, got {self.worker_num}")
        require(
            self.heter_worker_num >= 0,
            "heter_worker_num",
            f"must be >= 0, got {self.heter_worker_num}",
        )


@dataclass(frozen=True)
class RoleResources:
    """Resources of one process of a role (used by the Ray and Kubernetes schedulers)."""

    cpu: float = 1.0
    """CPU cores."""
    memory: str = "2Gi"
    """Memory, Kubernetes quantity syntax (``512Mi``, ``4Gi``)."""
    gpu: int = 0
    """GPUs."""

    def __post_init__(self) -> None:
        require(self.cpu > 0, "cpu", f"must be > 0, got {self.cpu}")
        require(self.gpu >= 0, "gpu", f"must be >= 0, got {self.gpu}")


@dataclass(frozen=True)
class Resources:
    """Resources per role."""

    trainer: RoleResources = RoleResources()
    """Per trainer process."""
    server: RoleResources = RoleResources()
    """Per parameter-server process."""
    heter: RoleResources = RoleResources()
    """Per heter worker (a cuda device adds one GPU when ``gpu`` is 0)."""


@dataclass(frozen=True)
class Rendezvous:
    """How nodes (and the processes of a node) find each other."""

    master_addr: str | None = None
    """Address of node 0; default 127.0.0.1 for one node, the first of ``ips`` with ips."""
    master_port: int | None = None
    """Port on node 0; default: a free port for one node, 29500 for several."""
    node_rank: int | None = None
    """Rank of this node; default 0, or this host's index in ``ips``."""
    ips: tuple[str, ...] = ()
    """Paddle-style node list ``a,b,c``: nnodes = len(ips), master = ips[0]."""
    timeout_s: float = 300.0
    """How long a node waits for the others at start, in seconds."""

    def __post_init__(self) -> None:
        if self.master_port is not None:
            require(
                0 < self.master_port < 65536,
                "master_port",
                f"must be 1..65535, got {self.master_port}",
            )
        if self.node_rank is not None:
            require(self.node_rank >= 0, "node_rank", f"must be >= 0, got {self.node_rank}")
        require(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")


def _endpoint_list(value: Any, path: str) -> tuple[str, ...]:
    """``ip:port,ip:port`` (string or list) → tuple; each entry checked."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value or [])
    out = []
    for i, item in enumerate(items):
        if not item:
            continue
        host, sep, port = str(item).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{item!r} is not of the form ip:port", key=f"{path}[{i}]")
        out.append(str(item))
    return tuple(out)


@dataclass(frozen=True)
class PSEndpoints:
    """Static parameter-server layout across nodes (each node runs the entries with its IP)."""

    servers: tuple[str, ...] = field(default=(), metadata={"parse": _endpoint_list})
    """``ip:port`` of every server (``--servers``); empty = ``server_num`` on this machine."""
    workers: tuple[str, ...] = field(default=(), metadata={"parse": _endpoint_list})
    """``ip:port`` of every trainer (``--workers``); empty = ``worker_num`` on this machine."""
    heter_workers: tuple[str, ...] = field(default=(), metadata={"parse": _endpoint_list})
    """``ip:port`` of every heter worker (``--heter_workers``; static layout, with ``servers``)."""
    heter_devices: tuple[str, ...] = field(default=(), metadata={"parse": parse_heter_devices})
    """Heter workers' devices (``--heter_devices``): one for all or one each; default cpu."""
    pod_ip: str | None = None
    """This node's IP: which entries of servers/workers run here (default: this host's)."""
    server_grace_s: float = 10.0
    """After the trainers finished, how long servers may take to stop before SIGTERM."""
    ssd_dir: str | None = None
    """Local directory for the cold rows of ``storage="ssd"`` tables (``--ps_ssd_dir``; an
    absolute path): server ``i`` keeps its tier in ``<ssd_dir>/server-<i>`` (scratch, emptied
    per table at creation). None: SSD tables are refused."""
    bind_cpus: bool = False
    """Bind each server to its own share of its host's CPUs (``--ps_bind_cpus``): server ``i``
    of the ``n`` on a host gets the ``i``-th of ``n`` blocks (FLEET_PS_CPU_SHARE). For hosts
    that run several servers; a Kubernetes server pod has its host's share already."""

    def __post_init__(self) -> None:
        if self.ssd_dir is not None:
            require(
                os.path.isabs(str(self.ssd_dir)),
                "ps.ssd_dir",
                f"--ps_ssd_dir / ps.ssd_dir must be an absolute directory path (every server "
                f"resolves it on its own node), got {self.ssd_dir!r}",
            )
        require(
            bool(self.servers) == bool(self.workers),
            "servers",
            "give both servers and workers lists, or neither",
        )
        require(
            self.server_grace_s >= 0, "server_grace_s", f"must be >= 0, got {self.server_grace_s}"
        )


@dataclass(frozen=True)
class PSCheckpointConfig:
    """Automatic checkpoints and recovery of a PS job (``ps_checkpoint:``; the
    ``--ps_checkpoint_*`` flags). With ``dir`` set, the trainers checkpoint the job (servers'
    tables + each trainer's data position) every ``interval_s``, resume from the newest good
    checkpoint at start, and a process that dies is recovered from it (one unit of
    ``max_restarts`` each)."""

    dir: str | None = None
    """Directory of the job's checkpoints (``ckpt-<step>`` inside); relative = under the
    directory fleetrun runs in. None: no automatic checkpoints."""
    interval_s: float = 600.0
    """Seconds between checkpoints (cut at a step boundary all trainers agree on)."""
    keep: int = 3
    """Newest checkpoints kept (0 = all)."""

    def __post_init__(self) -> None:
        require(
            self.dir is None or bool(str(self.dir).strip()),
            "ps_checkpoint.dir",
            "must be a directory path (or leave it out for no automatic checkpoints)",
        )
        require(
            self.interval_s > 0,
            "ps_checkpoint.interval_s",
            f"must be a number of seconds > 0, got {self.interval_s}",
        )
        require(
            self.keep >= 0, "ps_checkpoint.keep", f"must be >= 0 (0 = keep all), got {self.keep}"
        )


@dataclass(frozen=True)
class JobSpec:
    """A whole job: what to run, how many, where, and how failures are handled."""

    name: str = "fleetrun"
    """Job name (log headers, Kubernetes object names)."""
    entrypoint: Entrypoint = Entrypoint()
    """The training program."""
    mode: Mode = Mode.COLLECTIVE
    """``collective`` (all trainers in one process group) or ``ps`` (servers + trainers)."""
    scheduler: SchedulerKind = SchedulerKind.LOCAL
    """``local`` (this machine), ``ray`` or ``k8s``."""
    sizes: Sizes = Sizes()
    """Process counts."""
    resources: Resources = Resources()
    """Resources per role (Ray/Kubernetes)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every process."""
    strategy: dict[str, Any] | str | None = None
    """DistributedStrategy, inline mapping or a YAML file path; given to workers as FLEET_STRATEGY."""
    rendezvous: Rendezvous = Rendezvous()
    """Multi-node rendezvous."""
    ps: PSEndpoints = PSEndpoints()
    """Parameter-server layout (PS mode)."""
    ps_checkpoint: PSCheckpointConfig = PSCheckpointConfig()
    """Automatic PS checkpoints and recovery (PS mode)."""
    backend: Backend = Backend.AUTO
    """Process-group backend: auto (nccl with GPUs, else gloo), gloo, nccl."""
    log_dir: str = "log"
    """Directory for workerlog.N, endpoints.log and error files."""
    max_restarts: int = 0
    """How many times the whole job may be restarted after a failure."""
    run_id: str | None = None
    """Job id (TORCHELASTIC_RUN_ID); default: a fresh random id."""
    tee: Tee = Tee.RANK0
    """Which ranks' output the console shows: rank0, all (prefixed) or none."""
    metrics: bool = True
    """Prometheus ``/metrics`` on every process (and the launcher), listed in
    ``log_dir/metrics_targets.json``; false = no endpoints (job_state.json is still written)."""
    grace_period_s: float = 5.0
    """After SIGTERM, seconds before remaining processes get SIGKILL."""
    warm_start: WarmStart = WarmStart.ON
    """``on``: fork Python workers and their restarts from a per-node warm process that
    imported torch, fleet and ``warm_imports`` once (local and elastic agents, the agent in each
    Kubernetes pod); ``off``: start every worker afresh."""
    warm_imports: list[str] = field(default_factory=list)
    """Extra modules the warm process imports (the job's own heavy imports)."""
    elastic: ElasticConfig = ElasticConfig()
    """Elastic collective job (``--nnodes MIN:MAX --rdzv_backend c10d|etcd|etcd-v2``); the
    default ``static`` backend is a fixed job."""
    ray: RayConfig = RayConfig()
    """Ray scheduler settings."""
    k8s: K8sConfig = K8sConfig()
    """Kubernetes scheduler settings."""

    def __post_init__(self) -> None:
        require(bool(self.name), "name", "must not be empty")
        require(self.max_restarts >= 0, "max_restarts", f"must be >= 0, got {self.max_restarts}")
        require(
            self.grace_period_s >= 0, "grace_period_s", f"must be >= 0, got {self.grace_period_s}"
        )
        if self.rendezvous.ips:
            require(
                self.sizes.nnodes in (1, len(self.rendezvous.ips)),
                "sizes.nnodes",
                f"is {self.sizes.nnodes} but rendezvous.ips lists {len(self.rendezvous.ips)} "
                "nodes; drop one of them",
            )
        check_heter_spec(self)
        if self.mode is Mode.PS:
            if self.ps.servers:
                for name, lst in (("server_num", self.ps.servers), ("worker_num", self.ps.workers)):
                    n = getattr(self.sizes, name)
                    require(
                        n in (0, len(lst)),
                        f"sizes.{name}",
                        f"is {n} but ps lists {len(lst)}; drop one of them",
                    )
            else:
                require(
                    self.sizes.server_num >= 1 and self.sizes.worker_num >= 1,
                    "sizes.server_num",
                    f"PS mode needs server_num >= 1 and worker_num >= 1 (got "
                    f"{self.sizes.server_num} and {self.sizes.worker_num}), or ps.servers/ps.workers",
                )
        elif self.ps.ssd_dir:
            raise ConfigError(
                "ps.ssd_dir (--ps_ssd_dir) is for PS jobs (mode: ps); drop it or use mode: ps",
                key="ps.ssd_dir",
            )
        elif self.ps.bind_cpus:
            raise ConfigError(
                "ps.bind_cpus (--ps_bind_cpus) is for PS jobs (mode: ps); drop it or use mode: ps",
                key="ps.bind_cpus",
            )
        elif self.ps_checkpoint.dir:
            raise ConfigError(
                "ps_checkpoint.dir is for PS jobs (mode: ps); drop it or use mode: ps",
                key="ps_checkpoint.dir",
            )
        elif self.sizes.server_num or self.ps.servers:
            raise ConfigError(
                "parameter servers are given but mode is 'collective'; "
                "use mode: ps (--run_mode ps) or drop them",
                key="mode",
            )
        check_elastic_spec(self)
        if self.rendezvous.node_rank is not None:
            require(
                self.rendezvous.node_rank < self.num_nodes,
                "rendezvous.node_rank",
                f"is {self.rendezvous.node_rank} but there are only {self.num_nodes} node(s) "
                "(node ranks are 0..nnodes-1)",
            )

    @property
    def num_nodes(self) -> int:
        """Nodes of the job (``len(ips)`` when ips are given)."""
        return len(self.rendezvous.ips) or self.sizes.nnodes

    @property
    def world_size(self) -> int:
        """Trainers in the job."""
        return self.num_nodes * self.sizes.nproc_per_node


def load_yaml(path: str) -> dict[str, Any]:
    """Read a job file into a plain mapping (ConfigError for a missing file or bad YAML)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"job file {path!r} does not exist") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"job file {path!r} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"job file {path!r} must hold a mapping at the top, got {type(data).__name__}"
        )
    return dict(data)


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data["a"]["b"] = value`` for ``dotted = "a.b"``, creating sections."""
    *parents, leaf = dotted.split(".")
    node = data
    for p in parents:
        child = node.get(p)
        if child is None:
            child = {}
        elif not isinstance(child, Mapping):
            raise ConfigError(f"expected a mapping, got {child!r}", key=p)
        node[p] = child = dict(child)
        node = child
    node[leaf] = value


def build_spec(data: Mapping[str, Any]) -> JobSpec:
    """Validate a plain mapping into a :class:`JobSpec`.

    Without an explicit ``mode``, giving servers (``sizes.server_num`` or ``ps.servers``) means
    ``ps``: ``fleetrun --server_num 2 --worker_num 2 train.py`` needs no ``--run_mode``.
    """
    data = normalize_elastic(data)
    sizes, ps = data.get("sizes") or {}, data.get("ps") or {}
    if (
        "mode" not in data
        and isinstance(sizes, Mapping)
        and isinstance(ps, Mapping)
        and (sizes.get("server_num") or ps.get("servers"))
    ):
        data["mode"] = Mode.PS.value
    return from_dict(JobSpec, data)


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    """Plain-data form of a spec (for YAML dumps and the resolved-config log)."""
    return to_dict(spec)
