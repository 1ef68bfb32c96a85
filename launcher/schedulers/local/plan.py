"""This node's processes for one attempt of a local job: the plans the agent runs.

:class:`CollectivePlan` (trainers; on several nodes the agents meet in a
:class:`~launcher.rendezvous.NodeRendezvous`) and :class:`PSPlan` (servers and trainers on free
ports, or this node's entries of static ``ps.servers`` / ``ps.workers`` lists) turn the spec and
the node's :class:`Placement` into one :class:`~launcher.attempt.ProcSpec` per process, with the
env contract (:mod:`collective.env`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Protocol

from collective.env import (
    FLEET_PS_TABLE_THREADS,
    NodeLayout,
    PSLayout,
    find_free_port,
    make_ps_heter_env,
    make_ps_server_env,
    make_ps_trainer_env,
    make_worker_env,
    usable_cpus,
)
from collective.errors import ConfigError
from launcher.attempt import SERVER, TRAINER, ProcSpec, base_env, console_prefix, write_endpoints
from launcher.heter_spec import HETER, heter_devices
from launcher.ps_env import (
    FLEET_PS_CHECKPOINT_ROOT,
    FLEET_PS_TOKEN,
    check_ps_ssd_dir,
    job_ps_token,
    ps_checkpoint_root_env,
    ps_cpu_share_env,
    ps_ssd_root_env,
    user_ps_token,
)
from launcher.recovery.ps_policy import make_recovery
from launcher.rendezvous import NodeInfo, NodeRendezvous
from launcher.spec import JobSpec
from launcher.telemetry import node_file


@dataclass(frozen=True)
class Placement:
    """Where this node sits in the job, resolved once from the spec."""

    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    node_ip: str
    run_id: str


def _table_threads_env(env: dict[str, str], nproc_here: int) -> dict[str, str]:
    """FLEET_PS_TABLE_THREADS for the servers of a node running ``nproc_here`` processes: the
    node's CPUs split between them, unless the user set it."""
    if FLEET_PS_TABLE_THREADS in env:
        return {}
    return {FLEET_PS_TABLE_THREADS: str(max(1, usable_cpus() // max(1, nproc_here)))}


class Plan(Protocol):
    """Builds this node's process specs for one attempt."""

    max_restarts: int

    def specs(self, attempt: int) -> list[ProcSpec]: ...

    def remote_failure(self, attempt: int) -> str | None: ...

    def report_failure(
        self, attempt: int, text: str, when: float | None = None, lost_peer: bool = False
    ) -> None: ...

    def earlier_failure(
        self, attempt: int, when: float, wait_s: float = 0.0, lost_peer: bool = False
    ) -> str | None: ...

    def saw_failure(self, attempt: int) -> None: ...

    def wait_seen(self, attempt: int, timeout_s: float) -> None: ...

    def finish(self, attempt: int) -> str | None: ...


class CollectivePlan:
    """Trainers only; on several nodes the agents meet in a :class:`NodeRendezvous`."""

    def __init__(self, spec: JobSpec, place: Placement, strategy_file: str | None) -> None:
        self.spec, self.place, self.strategy_file = spec, place, strategy_file
        self.host = socket.gethostname()
        self.rdzv: NodeRendezvous | None = None
        if place.num_nodes > 1:
            assert place.master_port is not None
            self.rdzv = NodeRendezvous(
                place.master_addr,
                place.master_port,
                place.num_nodes,
                place.node_rank,
                spec.rendezvous.timeout_s,
                spec.max_restarts,
                place.run_id,
            )
        self.max_restarts = self.rdzv.max_restarts if self.rdzv else spec.max_restarts

    def layout(self, attempt: int) -> NodeLayout:
        p, nproc = self.place, self.spec.sizes.nproc_per_node
        ports = tuple(find_free_port(p.node_ip) for _ in range(nproc))
        if self.rdzv is None:
            nodes = [NodeInfo(0, p.node_ip, self.host, ports)]
            master_port, run_id = p.master_port or find_free_port(p.master_addr), p.run_id
        else:
            nodes, master_port = self.rdzv.join(
                attempt, NodeInfo(p.node_rank, p.node_ip, self.host, ports)
            )
            run_id = self.rdzv.run_id
        log_dir = self.spec.log_dir
        return NodeLayout(
            run_id=run_id,
            num_nodes=p.num_nodes,
            nproc_per_node=nproc,
            node_rank=p.node_rank,
            master_addr=p.master_addr,
            master_port=master_port,
            trainer_endpoints=tuple(f"{n.ip}:{port}" for n in nodes for port in n.ports),
            node_ip=p.node_ip,
            restart_count=attempt,
            max_restarts=self.max_restarts,
            backend=self.spec.backend,
            log_dir=log_dir,
            error_dir=os.path.join(log_dir, "errors", f"attempt{attempt}"),
            job_name=self.spec.name,
            strategy_file=self.strategy_file,
        )

    def specs(self, attempt: int) -> list[ProcSpec]:
        layout = self.layout(attempt)
        write_endpoints(
            self.spec.log_dir,
            attempt,
            f"run_id {layout.run_id} master {layout.master_addr}:{layout.master_port}",
            [],
            layout.trainer_endpoints,
            node_file("endpoints.log", self.place.node_rank, self.place.num_nodes),
        )
        base = base_env(self.spec, layout.nproc_per_node)
        out = []
        for local_rank in range(layout.nproc_per_node):
            rank = layout.global_rank(local_rank)
            show, prefix = console_prefix(self.spec, TRAINER, rank)
            out.append(
                ProcSpec(
                    TRAINER,
                    rank,
                    local_rank,
                    layout.node_rank,
                    {**base, **make_worker_env(layout, local_rank)},
                    os.path.join(layout.log_dir, f"workerlog.{rank}"),
                    layout.error_file(local_rank),
                    show,
                    prefix,
                )
            )
        return out

    def remote_failure(self, attempt: int) -> str | None:
        return self.rdzv.remote_failure(attempt) if self.rdzv else None

    def report_failure(
        self, attempt: int, text: str, when: float | None = None, lost_peer: bool = False
    ) -> None:
        if self.rdzv:
            self.rdzv.report_failure(attempt, text, when, lost_peer)

    def earlier_failure(
        self, attempt: int, when: float, wait_s: float = 0.0, lost_peer: bool = False
    ) -> str | None:
        if not self.rdzv:
            return None
        return self.rdzv.earlier_failure(attempt, when, wait_s, lost_peer)

    def saw_failure(self, attempt: int) -> None:
        if self.rdzv:
            self.rdzv.saw_failure(attempt)

    def wait_seen(self, attempt: int, timeout_s: float) -> None:
        if self.rdzv:
            self.rdzv.wait_seen(attempt, timeout_s)

    def finish(self, attempt: int) -> str | None:
        return self.rdzv.finish(attempt) if self.rdzv else None


def _is_local(ip: str) -> bool:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


class PSPlan:
    """Servers + trainers (+ heter workers): ``server_num``/``worker_num``/``heter_worker_num``
    on this machine (free ports per attempt), or static ``ps.servers``/``ps.workers``/
    ``ps.heter_workers`` lists of which this node runs the entries with its IP. Nodes do not coordinate: a multi-node PS job cannot restart (ConfigError), and its nodes
    must share a FLEET_PS_TOKEN given by the user; on one node fleetrun makes the job's token
    (:func:`~launcher.ps_env.job_ps_token`). Servers also get their checkpoint roots
    (:func:`~launcher.ps_env.ps_checkpoint_root_env`) and, with ``--ps_ssd_dir``, their SSD
    directories (:func:`~launcher.ps_env.ps_ssd_root_env`)."""

    def __init__(self, spec: JobSpec, place: Placement, strategy_file: str | None) -> None:
        self.spec, self.place, self.strategy_file = spec, place, strategy_file
        self.max_restarts = spec.max_restarts
        ps = spec.ps
        self.static = bool(ps.servers)
        if self.static:
            ips = {e.rpartition(":")[0] for e in (*ps.servers, *ps.workers, *ps.heter_workers)}
            if ps.pod_ip:
                self.pod_ip = ps.pod_ip
            else:
                mine = sorted(ip for ip in ips if _is_local(ip))
                if len(mine) != 1:
                    raise ConfigError(
                        f"cannot tell which of the ps endpoint IPs ({', '.join(sorted(ips))}) is this "
                        f"node (local ones: {', '.join(mine) or 'none'}); pass --pod_ip",
                        key="ps.pod_ip",
                    )
                self.pod_ip = mine[0]
            if len(ips) > 1 and spec.max_restarts:
                raise ConfigError(
                    "max_restarts > 0 needs a single-node PS job: nodes of a static PS layout do not "
                    "coordinate restarts; set max_restarts: 0",
                    key="max_restarts",
                )
            if len(ips) > 1 and user_ps_token(spec) is None:
                raise ConfigError(
                    "a PS job over several nodes needs one token shared by every node (the nodes' "
                    "fleetruns do not talk to each other): export the same secret on each, e.g. "
                    "FLEET_PS_TOKEN=$(python -c "
                    "'import secrets; print(secrets.token_urlsafe(32))')",
                    key=FLEET_PS_TOKEN,
                )
        check_ps_ssd_dir(spec)
        self.token = job_ps_token(spec)
        self.recovery = make_recovery(spec)  # automatic checkpoints: recover from them
        if self.recovery is not None and not self.static:  # a_sync trainers meet through it
            self.recovery.start_coordinator(self.token)  # and one can be restarted alone
        self._servers: tuple[str, ...] = ()
        self._heters: tuple[str, ...] = ()

    def layout(self, attempt: int) -> PSLayout:
        ps, sizes = self.spec.ps, self.spec.sizes
        if self.static:
            servers, workers, heters = ps.servers, ps.workers, ps.heter_workers
        else:
            ip = self.place.node_ip
            servers = tuple(f"{ip}:{find_free_port(ip)}" for _ in range(sizes.server_num))
            heters = tuple(f"{ip}:{find_free_port(ip)}" for _ in range(sizes.heter_worker_num))
            if self.recovery is not None:  # a recovered server / heter worker comes back on
                servers = self._servers = self._servers or servers  # its endpoint
                heters = self._heters = self._heters or heters
            workers = tuple(f"{ip}:{find_free_port(ip)}" for _ in range(sizes.worker_num))
        log_dir = self.spec.log_dir
        return PSLayout(
            run_id=self.place.run_id,
            server_endpoints=servers,
            trainer_endpoints=workers,
            restart_count=attempt,
            max_restarts=self.max_restarts,
            backend=self.spec.backend,
            log_dir=log_dir,
            error_dir=os.path.join(log_dir, "errors", f"attempt{attempt}"),
            job_name=self.spec.name,
            strategy_file=self.strategy_file,
            heter_endpoints=heters,
            heter_devices=heter_devices(self.spec),
        )

    def _here(self, endpoint: str) -> bool:
        return not self.static or endpoint.rpartition(":")[0] == self.pod_ip

    def specs(self, attempt: int) -> list[ProcSpec]:
        layout = self.layout(attempt)
        write_endpoints(
            self.spec.log_dir,
            attempt,
            f"run_id {layout.run_id}",
            layout.server_endpoints,
            layout.trainer_endpoints,
            heters=layout.heter_endpoints,
        )
        servers = [i for i, e in enumerate(layout.server_endpoints) if self._here(e)]
        trainers = [i for i, e in enumerate(layout.trainer_endpoints) if self._here(e)]
        heters = [i for i, e in enumerate(layout.heter_endpoints) if self._here(e)]
        if not servers and not trainers and not heters:
            raise ConfigError(
                f"no server, worker or heter worker endpoint has this node's IP {self.pod_ip}",
                key="ps.pod_ip",
            )
        nproc_here = len(servers) + len(trainers) + len(heters)
        base = {**base_env(self.spec, nproc_here), FLEET_PS_TOKEN: self.token}
        heter_base = dict(base)
        server_base = {
            **base,
            **_table_threads_env(base, nproc_here),
            **ps_checkpoint_root_env(base, self.spec.log_dir, os.getcwd()),
        }
        if self.recovery is not None:
            self.recovery.begin_attempt(attempt)
            server_base[FLEET_PS_CHECKPOINT_ROOT] = self.recovery.server_roots(
                server_base.get(FLEET_PS_CHECKPOINT_ROOT, "")
            )
            base = {**base, **self.recovery.trainer_env()}
            heter_base.update(self.recovery.heter_env())
        out = []
        for share, i in enumerate(servers):
            show, prefix = console_prefix(self.spec, SERVER, i)
            out.append(
                ProcSpec(
                    SERVER,
                    i,
                    i,
                    0,
                    {
                        **server_base,
                        **ps_ssd_root_env(self.spec, i),
                        **ps_cpu_share_env(self.spec, share, len(servers)),
                        **make_ps_server_env(layout, i),
                    },
                    os.path.join(layout.log_dir, f"serverlog.{i}"),
                    layout.server_error_file(i),
                    show,
                    prefix,
                )
            )
        for i in heters:
            show, prefix = console_prefix(self.spec, HETER, i)
            out.append(
                ProcSpec(
                    HETER,
                    i,
                    i,
                    0,
                    {**heter_base, **make_ps_heter_env(layout, i)},
                    os.path.join(layout.log_dir, f"heterlog.{i}"),
                    layout.heter_error_file(i),
                    show,
                    prefix,
                )
            )
        for local_rank, t in enumerate(trainers):
            show, prefix = console_prefix(self.spec, TRAINER, t)
            out.append(
                ProcSpec(
                    TRAINER,
                    t,
                    local_rank,
                    0,
                    {**base, **make_ps_trainer_env(layout, t, local_rank, len(trainers))},
                    os.path.join(layout.log_dir, f"workerlog.{t}"),
                    layout.trainer_error_file(t),
                    show,
                    prefix,
                )
            )
        return out

    def remote_failure(self, attempt: int) -> str | None:
        return None

    def report_failure(
        self, attempt: int, text: str, when: float | None = None, lost_peer: bool = False
    ) -> None:
        return None

    def earlier_failure(
        self, attempt: int, when: float, wait_s: float = 0.0, lost_peer: bool = False
    ) -> str | None:
        return None

    def saw_failure(self, attempt: int) -> None:
        return None

    def wait_seen(self, attempt: int, timeout_s: float) -> None:
        return None

    def finish(self, attempt: int) -> str | None:
        return None
