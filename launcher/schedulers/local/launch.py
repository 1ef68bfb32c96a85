"""A local job's start on this node: where the node sits (:func:`resolve_placement`), the
configuration table, the job files, then the agent (or the elastic agent for ``--nnodes
MIN:MAX``)."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid

from collective.errors import ConfigError, LaunchError
from launcher.attempt import Interrupted, install_signal_handlers
from launcher.heter_spec import heter_devices
from launcher.job_files import write_job_file, write_strategy
from launcher.schedulers.local.agent import Agent
from launcher.schedulers.local.plan import CollectivePlan, Placement, PSPlan
from launcher.spec import DEFAULT_MULTINODE_PORT, JobSpec, Mode
from launcher.telemetry import node_file

logger = logging.getLogger(__name__)


def check_port_free(host: str, port: int, what: str) -> None:
    """LaunchError naming ``port`` when something already listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise LaunchError(
                f"{what} port {port} on {host} is busy ({err.strerror}); pick another "
                "--master_port, or leave it out and fleetrun picks a free one"
            ) from None


def own_index(ips: tuple[str, ...]) -> int:
    """This host's position in ``ips`` (an address it can bind), or ConfigError."""
    mine = []
    for i, ip in enumerate(ips):
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.bind((ip, 0))
                mine.append(i)
            except OSError:
                continue
    if len(mine) == 1:
        return mine[0]
    if not mine:
        raise ConfigError(
            f"none of {','.join(ips)} is an address of this host; pass --node_rank",
            key="rendezvous.ips",
        )
    raise ConfigError(
        f"this host is listed more than once (positions {', '.join(map(str, mine))}); "
        "pass --node_rank to say which node this is",
        key="rendezvous.ips",
    )


def route_ip(master_addr: str) -> str:
    """The local address this host uses to reach ``master_addr``."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def resolve_placement(spec: JobSpec) -> Placement:
    """Node count, node rank, master and this node's IP from the spec."""
    r = spec.rendezvous
    num_nodes = spec.num_nodes
    if r.ips:
        node_rank = r.node_rank if r.node_rank is not None else own_index(r.ips)
        master_addr = r.master_addr or r.ips[0]
        node_ip = r.ips[node_rank]
    else:
        node_rank = r.node_rank or 0
        master_addr = r.master_addr or "127.0.0.1"
        node_ip = master_addr if num_nodes == 1 else route_ip(master_addr)
        if num_nodes == 1 and master_addr not in ("127.0.0.1", "localhost", "::1"):
            node_ip = route_ip(master_addr)
    port = r.master_port
    if num_nodes > 1 and port is None:
        port = DEFAULT_MULTINODE_PORT
    if port is not None and node_rank == 0:
        check_port_free(master_addr, port, "master")
    return Placement(
        num_nodes=num_nodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=port,
        node_ip=node_ip,
        run_id=spec.run_id or uuid.uuid4().hex[:12],
    )


def _layout_rows(spec: JobSpec, place: Placement) -> list[tuple[str, str]]:
    if spec.mode is Mode.PS:
        ps = spec.ps
        if ps.servers:
            heter = [("heter workers", ",".join(ps.heter_workers))] if ps.heter_workers else []
            return [
                ("servers", ",".join(ps.servers)),
                ("trainers", ",".join(ps.workers)),
                *heter,
                ("this node", ps.pod_ip or "detected from the lists"),
            ]
        heters = spec.sizes.heter_worker_num
        what = (
            f"{spec.sizes.server_num} server(s) + {spec.sizes.worker_num} trainer(s) "
            + (f"+ {heters} heter worker(s) ({','.join(heter_devices(spec))}) " if heters else "")
            + f"on {place.node_ip}, free ports"
        )
        return [("processes", what)]
    return [
        (
            "nodes",
            f"{place.num_nodes} x {spec.sizes.nproc_per_node} trainers = world {spec.world_size}",
        ),
        ("this node", f"rank {place.node_rank}, ip {place.node_ip}"),
        ("master", f"{place.master_addr}:{place.master_port or 'auto'}"),
    ]


def format_config_table(spec: JobSpec, place: Placement) -> str:
    """The resolved configuration, one short table."""
    entry = spec.entrypoint
    what = f"-m {entry.module}" if entry.module else str(entry.script)
    rows = [
        ("job", f"{spec.name} (run_id {place.run_id})"),
        ("entrypoint", " ".join([what, *entry.args])),
        ("mode", f"{spec.mode} on {spec.scheduler}"),
        *_layout_rows(spec, place),
        ("backend", str(spec.backend)),
        ("log_dir", os.path.abspath(spec.log_dir)),
        ("restarts", f"max {spec.max_restarts}"),
        *(
            [
                (
                    "ps checkpoints",
                    f"{spec.ps_checkpoint.dir} every {spec.ps_checkpoint.interval_s:g} s, "
                    f"keep {spec.ps_checkpoint.keep or 'all'}",
                )
            ]
            if spec.ps_checkpoint.dir
            else []
        ),
        ("console", str(spec.tee)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}} : {v}" for k, v in rows)


def launch_local(spec: JobSpec) -> int:
    """Run a validated spec on this machine (the local scheduler)."""
    entry = spec.entrypoint
    if entry.script and not os.path.exists(entry.script):
        raise ConfigError(
            f"script {entry.script!r} not found (working directory {os.getcwd()})",
            key="entrypoint.script",
        )
    if spec.elastic.enabled:
        from launcher.schedulers.local.elastic_launch import (
            launch_elastic,  # lazy: elastic jobs only (torch)
        )

        return launch_elastic(spec)
    place = resolve_placement(spec)
    write_job_file(spec, node_file("job.yaml", place.node_rank, place.num_nodes))  # per node
    logger.info("resolved configuration:\n%s", format_config_table(spec, place))
    strategy_file = write_strategy(spec)
    install_signal_handlers()
    try:
        plan = (PSPlan if spec.mode is Mode.PS else CollectivePlan)(spec, place, strategy_file)
        return Agent(spec, plan, place.node_rank).run()
    except Interrupted as sig:
        sys.stderr.write(f"fleetrun: got {sig}; stopped every process of job '{spec.name}'\n")
        return 128 + sig.signum
