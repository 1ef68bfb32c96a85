"""The env contract: what the launcher gives every process, and the one parser of it.

The launcher builds the variables with :func:`make_worker_env` (a PS job's with
:mod:`collective.env_ps`); a worker reads them back with :func:`read_worker_env` into a frozen
:class:`WorkerEnv`. No module outside the contract's three (this one, :mod:`collective.env_base`:
the variable names and enums, and :mod:`collective.env_ps`) reads ``os.environ`` for these names.
Both variable families are set so torchrun scripts and Paddle-Fleet scripts run unchanged (see the
table in docs/launching/env-contract.md). Every public name of the other two is re-exported here.

This module imports only the standard library: the launcher imports it at CLI start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from collective.env_base import (
    FLEET_BACKEND,
    FLEET_ERROR_FILE,
    FLEET_JOB_NAME,
    FLEET_LOG_DIR,
    FLEET_METRICS_HOST,
    FLEET_METRICS_PORT,
    FLEET_NNODES,
    FLEET_PS_CHECKPOINT_DIR,
    FLEET_PS_CHECKPOINT_INTERVAL,
    FLEET_PS_CHECKPOINT_KEEP,
    FLEET_PS_COORDINATOR,
    FLEET_PS_CPU_SHARE,
    FLEET_PS_RESUME_POSITION,
    FLEET_PS_SSD_ROOT,
    FLEET_PS_TABLE_THREADS,
    FLEET_STRATEGY,
    PADDLE_HETER_TRAINER_DEVICE,
    PADDLE_HETER_TRAINER_IP_PORT_LIST,
    Backend,
    StrEnum,
    TrainingRole,
    metrics_env,
    read_int,
    read_metrics_endpoint,
)
from collective.env_ps import (
    PSCheckpointEnv,
    PSLayout,
    make_ps_heter_env,
    make_ps_server_env,
    make_ps_trainer_env,
    ps_checkpoint_env,
    read_ps_checkpoint_env,
)
from collective.errors import EnvContractError
from collective.ports import find_free_port


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota (a
    container's ``cpu.max``; a Kubernetes CPU limit) when one is set."""
    cpus = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


@dataclass(frozen=True)
class WorkerEnv:
    """Everything a worker process knows about its place in the job."""

    rank: int = 0
    """Global trainer rank (RANK / PADDLE_TRAINER_ID)."""
    world_size: int = 1
    """Number of trainers (WORLD_SIZE / PADDLE_TRAINERS_NUM)."""
    local_rank: int = 0
    """Rank on this node (LOCAL_RANK / PADDLE_RANK_IN_NODE)."""
    local_world_size: int = 1
    """Trainers on this node (LOCAL_WORLD_SIZE)."""
    node_rank: int = 0
    """Rank of this node (GROUP_RANK)."""
    num_nodes: int = 1
    """Number of nodes (GROUP_WORLD_SIZE / FLEET_NNODES)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host of the process group (MASTER_ADDR)."""
    master_port: int = 0
    """Rendezvous port of the process group (MASTER_PORT); 0 = none (standalone)."""
    trainer_endpoints: tuple[str, ...] = ()
    """``ip:port`` of every trainer, by rank (PADDLE_TRAINER_ENDPOINTS)."""
    current_endpoint: str = ""
    """This trainer's ``ip:port`` (PADDLE_CURRENT_ENDPOINT)."""
    pod_ip: str = "127.0.0.1"
    """This node's address (POD_IP)."""
    training_role: TrainingRole = TrainingRole.TRAINER
    """TRAINER or PSERVER (TRAINING_ROLE)."""
    pserver_endpoints: tuple[str, ...] = ()
    """Parameter servers, ``ip:port`` (PADDLE_PSERVERS_IP_PORT_LIST); PS mode only."""
    run_id: str = "none"
    """Job id (TORCHELASTIC_RUN_ID)."""
    restart_count: int = 0
    """How many times the job was restarted so far (TORCHELASTIC_RESTART_COUNT)."""
    max_restarts: int = 0
    """Restart budget of the job (TORCHELASTIC_MAX_RESTARTS)."""
    backend: Backend = Backend.AUTO
    """Backend the launcher asked for (FLEET_BACKEND)."""
    error_file: str | None = None
    """Where this process writes its traceback on failure (FLEET_ERROR_FILE)."""
    log_dir: str | None = None
    """The job's log directory (FLEET_LOG_DIR)."""
    strategy_file: str | None = None
    """YAML file of the job's DistributedStrategy (FLEET_STRATEGY), if the job spec has one."""
    server_index: int = -1
    """This parameter server's index in ``pserver_endpoints`` (PSERVER role only, else -1)."""
    heter_endpoints: tuple[str, ...] = ()
    """Heter workers, ``ip:port`` (PADDLE_HETER_TRAINER_IP_PORT_LIST); heterogeneous PS only."""
    heter_index: int = -1
    """This heter worker's index in ``heter_endpoints`` (HETER_TRAINER role only, else -1)."""
    heter_device: str = ""
    """This heter worker's device (PADDLE_HETER_TRAINER_DEVICE; HETER_TRAINER role only)."""
    metrics_port: int = 0
    """Port of this process's Prometheus ``/metrics`` endpoint (FLEET_METRICS_PORT); 0 = none."""
    metrics_host: str = "127.0.0.1"
    """Address the ``/metrics`` endpoint binds (FLEET_METRICS_HOST; the pod IP on clusters)."""
    launched: bool = field(default=False)
    """True when a launcher set the contract; False for a plain ``python script.py``."""


def _split_endpoints(raw: str | None) -> tuple[str, ...]:
    return tuple(e.strip() for e in (raw or "").split(",") if e.strip())


def _split_hostport(endpoint: str, name: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise EnvContractError(f"{name} entry {endpoint!r} is not of the form ip:port")
    return host, int(port)


def read_worker_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """Parse the env contract into a :class:`WorkerEnv`.

    The torchrun family wins; the Paddle family alone also works (rendezvous at the first trainer
    endpoint). With neither, the process is a standalone single trainer (``launched=False``).
    Inconsistent values raise :class:`EnvContractError` naming the variables.
    """
    env = os.environ if environ is None else environ
    if env.get("TRAINING_ROLE", "").upper() == TrainingRole.PSERVER.value:
        return _read_server_env(env)
    if env.get("TRAINING_ROLE", "").upper() == TrainingRole.HETER_TRAINER.value:
        return _read_heter_env(env)
    t_rank, t_world = read_int(env, "RANK"), read_int(env, "WORLD_SIZE")
    p_rank, p_world = read_int(env, "PADDLE_TRAINER_ID"), read_int(env, "PADDLE_TRAINERS_NUM")
    endpoints = _split_endpoints(env.get("PADDLE_TRAINER_ENDPOINTS"))
    role_raw = env.get("TRAINING_ROLE", TrainingRole.TRAINER.value).upper()
    try:
        role = TrainingRole(role_raw)
    except ValueError:
        raise EnvContractError(
            f"TRAINING_ROLE={role_raw!r} is not one of TRAINER, PSERVER, HETER_TRAINER"
        ) from None
    pservers = _split_endpoints(env.get("PADDLE_PSERVERS_IP_PORT_LIST"))

    if (t_rank is None) != (t_world is None):
        raise EnvContractError(
            "RANK and WORLD_SIZE must be set together "
            f"(RANK={env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r})"
        )
    if (p_rank is None) != (p_world is None):
        raise EnvContractError(
            "PADDLE_TRAINER_ID and PADDLE_TRAINERS_NUM must be set together "
            f"(PADDLE_TRAINER_ID={env.get('PADDLE_TRAINER_ID')!r}, "
            f"PADDLE_TRAINERS_NUM={env.get('PADDLE_TRAINERS_NUM')!r})"
        )
    if t_rank is not None and p_rank is not None and (t_rank, t_world) != (p_rank, p_world):
        raise EnvContractError(
            f"torchrun and Paddle variables disagree: RANK={t_rank} WORLD_SIZE={t_world} but "
            f"PADDLE_TRAINER_ID={p_rank} PADDLE_TRAINERS_NUM={p_world}; unset one family"
        )
    rank = t_rank if t_rank is not None else p_rank
    world_size = t_world if t_world is not None else p_world
    launched = rank is not None
    if rank is None or world_size is None:
        rank, world_size = 0, 1
    if world_size < 1 or not 0 <= rank < world_size:
        raise EnvContractError(
            f"rank {rank} is outside 0..WORLD_SIZE-1 for WORLD_SIZE={world_size}"
        )

    local_rank = read_int(env, "LOCAL_RANK")
    if local_rank is None:
        local_rank = read_int(env, "PADDLE_RANK_IN_NODE")
    local_rank = 0 if local_rank is None else local_rank
    local_world = read_int(env, "LOCAL_WORLD_SIZE") or (world_size if not launched else 1)
    if local_rank >= local_world and read_int(env, "LOCAL_WORLD_SIZE") is not None:
        raise EnvContractError(
            f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world}"
        )
    local_world = max(local_world, local_rank + 1)

    master_addr = env.get("MASTER_ADDR") or ""
    master_port = read_int(env, "MASTER_PORT") or 0
    if endpoints and len(endpoints) != world_size and role is TrainingRole.TRAINER:
        raise EnvContractError(
            f"PADDLE_TRAINER_ENDPOINTS has {len(endpoints)} entries but there are "
            f"{world_size} trainers"
        )
    if launched and not master_addr and endpoints:
        master_addr, master_port = _split_hostport(endpoints[0], "PADDLE_TRAINER_ENDPOINTS")
    if launched and world_size > 1 and (not master_addr or not master_port):
        raise EnvContractError(
            f"rank {rank} of {world_size} has no rendezvous address: set MASTER_ADDR and "
            "MASTER_PORT (or PADDLE_TRAINER_ENDPOINTS), or start the job with fleetrun"
        )
    current = env.get("PADDLE_CURRENT_ENDPOINT") or (endpoints[rank] if endpoints else "")
    backend_raw = env.get(FLEET_BACKEND, Backend.AUTO.value).lower()
    try:
        backend = Backend(backend_raw)
    except ValueError:
        raise EnvContractError(
            f"{FLEET_BACKEND}={backend_raw!r} is not auto, gloo or nccl"
        ) from None
    num_nodes = read_int(env, "GROUP_WORLD_SIZE") or read_int(env, FLEET_NNODES) or 1

    return WorkerEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=read_int(env, "GROUP_RANK") or 0,
        num_nodes=num_nodes,
        master_addr=master_addr or "127.0.0.1",
        master_port=master_port,
        trainer_endpoints=endpoints,
        current_endpoint=current,
        pod_ip=env.get("POD_IP") or (master_addr or "127.0.0.1"),
        training_role=role,
        pserver_endpoints=pservers,
        heter_endpoints=_split_endpoints(env.get(PADDLE_HETER_TRAINER_IP_PORT_LIST)),
        run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
        restart_count=read_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
        max_restarts=read_int(env, "TORCHELASTIC_MAX_RESTARTS") or 0,
        backend=backend,
        error_file=env.get(FLEET_ERROR_FILE) or env.get("TORCHELASTIC_ERROR_FILE") or None,
        log_dir=env.get(FLEET_LOG_DIR) or None,
        strategy_file=env.get(FLEET_STRATEGY) or None,
        **read_metrics_endpoint(env),
        launched=launched,
    )


def _read_server_env(env: Mapping[str, str]) -> WorkerEnv:
    """The PSERVER side of the contract: POD_IP:PADDLE_PORT must be one of the server list."""
    pservers = _split_endpoints(env.get("PADDLE_PSERVERS_IP_PORT_LIST"))
    pod_ip, port = env.get("POD_IP", ""), read_int(env, "PADDLE_PORT")
    if not pservers or not pod_ip or port is None:
        raise EnvContractError(
            "TRAINING_ROLE=PSERVER needs PADDLE_PSERVERS_IP_PORT_LIST, POD_IP and PADDLE_PORT "
            f"(got {env.get('PADDLE_PSERVERS_IP_PORT_LIST')!r}, {pod_ip!r}, {env.get('PADDLE_PORT')!r}); "
            "start the job with fleetrun --server_num/--servers"
        )
    me = f"{pod_ip}:{port}"
    if me not in pservers:
        raise EnvContractError(
            f"this server's POD_IP:PADDLE_PORT {me} is not in PADDLE_PSERVERS_IP_PORT_LIST "
            f"({','.join(pservers)})"
        )
    trainers = _split_endpoints(env.get("PADDLE_TRAINER_ENDPOINTS"))
    num_trainers = read_int(env, "PADDLE_TRAINERS_NUM") or len(trainers) or 1
    backend_raw = env.get(FLEET_BACKEND, Backend.AUTO.value).lower()
    return WorkerEnv(
        rank=0,
        world_size=num_trainers,
        master_addr=pod_ip,
        trainer_endpoints=trainers,
        current_endpoint=me,
        pod_ip=pod_ip,
        training_role=TrainingRole.PSERVER,
        pserver_endpoints=pservers,
        run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
        restart_count=read_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
        max_restarts=read_int(env, "TORCHELASTIC_MAX_RESTARTS") or 0,
        backend=Backend(backend_raw) if backend_raw in {b.value for b in Backend} else Backend.AUTO,
        error_file=env.get(FLEET_ERROR_FILE) or env.get("TORCHELASTIC_ERROR_FILE") or None,
        log_dir=env.get(FLEET_LOG_DIR) or None,
        strategy_file=env.get(FLEET_STRATEGY) or None,
        server_index=pservers.index(me),
        heter_endpoints=_split_endpoints(env.get(PADDLE_HETER_TRAINER_IP_PORT_LIST)),
        **read_metrics_endpoint(env),
        launched=True,
    )


def _read_heter_env(env: Mapping[str, str]) -> WorkerEnv:
    """The HETER_TRAINER side: POD_IP:PADDLE_PORT must be one of the heter worker list."""
    heters = _split_endpoints(env.get(PADDLE_HETER_TRAINER_IP_PORT_LIST))
    pod_ip, port = env.get("POD_IP", ""), read_int(env, "PADDLE_PORT")
    if not heters or not pod_ip or port is None:
        raise EnvContractError(
            f"TRAINING_ROLE=HETER_TRAINER needs {PADDLE_HETER_TRAINER_IP_PORT_LIST}, POD_IP and "
            f"PADDLE_PORT (got {env.get(PADDLE_HETER_TRAINER_IP_PORT_LIST)!r}, {pod_ip!r}, "
            f"{env.get('PADDLE_PORT')!r}); start the job with fleetrun --heter_worker_num/"
            "--heter_workers"
        )
    me = f"{pod_ip}:{port}"
    if me not in heters:
        raise EnvContractError(
            f"this heter worker's POD_IP:PADDLE_PORT {me} is not in "
            f"{PADDLE_HETER_TRAINER_IP_PORT_LIST} ({','.join(heters)})"
        )
    server = _read_server_env(
        {**env, "TRAINING_ROLE": TrainingRole.PSERVER.value, **_as_server(env)}
    )
    return WorkerEnv(
        **{
            **server.__dict__,
            "current_endpoint": me,
            "pod_ip": pod_ip,
            "master_addr": pod_ip,
            "training_role": TrainingRole.HETER_TRAINER,
            "server_index": -1,
            "heter_endpoints": heters,
            "heter_index": heters.index(me),
            "heter_device": env.get(PADDLE_HETER_TRAINER_DEVICE) or "cpu",
        }
    )


def _as_server(env: Mapping[str, str]) -> dict[str, str]:
    """POD_IP/PADDLE_PORT of the first server, so the server-side parser checks the rest of a
    heter worker's contract (the server list, trainers, error file) the same way."""
    first = _split_endpoints(env.get("PADDLE_PSERVERS_IP_PORT_LIST"))
    if not first:
        raise EnvContractError(
            "TRAINING_ROLE=HETER_TRAINER needs PADDLE_PSERVERS_IP_PORT_LIST (the job's parameter "
            "servers); start the job with fleetrun --server_num and --heter_worker_num"
        )
    ip, port = _split_hostport(first[0], "PADDLE_PSERVERS_IP_PORT_LIST")
    return {"POD_IP": ip, "PADDLE_PORT": str(port)}


@dataclass(frozen=True)
class NodeLayout:
    """What the launcher on one node knows when it starts its workers (one restart round)."""

    run_id: str
    num_nodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    trainer_endpoints: tuple[str, ...]
    """``ip:port`` per global rank, all nodes."""
    node_ip: str
    restart_count: int
    max_restarts: int
    backend: Backend
    log_dir: str
    error_dir: str
    job_name: str = "fleetrun"
    strategy_file: str | None = None

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def error_file(self, local_rank: int) -> str:
        return os.path.join(self.error_dir, f"error.{self.global_rank(local_rank)}.json")


def make_worker_env(layout: NodeLayout, local_rank: int, metrics_port: int = 0) -> dict[str, str]:
    """The env-contract variables for trainer ``local_rank`` of this node (both families);
    ``metrics_port`` > 0 adds FLEET_METRICS_PORT (its ``/metrics`` endpoint)."""
    rank = layout.global_rank(local_rank)
    err = layout.error_file(local_rank)
    return {
        # torchrun family
        "RANK": str(rank),
        "WORLD_SIZE": str(layout.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(layout.nproc_per_node),
        "GROUP_RANK": str(layout.node_rank),
        "GROUP_WORLD_SIZE": str(layout.num_nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(layout.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": layout.master_addr,
        "MASTER_PORT": str(layout.master_port),
        "TORCHELASTIC_RUN_ID": layout.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(layout.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(layout.max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_ERROR_FILE": err,
        # Paddle family
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(layout.world_size),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(layout.trainer_endpoints),
        "PADDLE_CURRENT_ENDPOINT": layout.trainer_endpoints[rank],
        "PADDLE_RANK_IN_NODE": str(local_rank),
        "PADDLE_LOCAL_SIZE": str(layout.nproc_per_node),
        "TRAINING_ROLE": TrainingRole.TRAINER.value,
        "POD_IP": layout.node_ip,
        # fleetrun's own
        FLEET_ERROR_FILE: err,
        FLEET_LOG_DIR: layout.log_dir,
        FLEET_BACKEND: layout.backend.value,
        FLEET_JOB_NAME: layout.job_name,
        FLEET_NNODES: str(layout.num_nodes),
        **({FLEET_STRATEGY: layout.strategy_file} if layout.strategy_file else {}),
        **metrics_env(metrics_port),
    }


__all__ = [
    "Backend",
    "EnvContractError",
    "FLEET_BACKEND",
    "FLEET_ERROR_FILE",
    "FLEET_JOB_NAME",
    "FLEET_LOG_DIR",
    "FLEET_METRICS_HOST",
    "FLEET_METRICS_PORT",
    "FLEET_NNODES",
    "FLEET_PS_CHECKPOINT_DIR",
    "FLEET_PS_CHECKPOINT_INTERVAL",
    "FLEET_PS_CHECKPOINT_KEEP",
    "FLEET_PS_COORDINATOR",
    "FLEET_PS_CPU_SHARE",
    "FLEET_PS_RESUME_POSITION",
    "FLEET_PS_SSD_ROOT",
    "FLEET_PS_TABLE_THREADS",
    "FLEET_STRATEGY",
    "NodeLayout",
    "PADDLE_HETER_TRAINER_DEVICE",
    "PADDLE_HETER_TRAINER_IP_PORT_LIST",
    "PSCheckpointEnv",
    "PSLayout",
    "StrEnum",
    "TrainingRole",
    "WorkerEnv",
    "find_free_port",
    "make_ps_heter_env",
    "make_ps_server_env",
    "make_ps_trainer_env",
    "make_worker_env",
    "metrics_env",
    "ps_checkpoint_env",
    "read_int",
    "read_metrics_endpoint",
    "read_ps_checkpoint_env",
    "read_worker_env",
    "usable_cpus",
]
