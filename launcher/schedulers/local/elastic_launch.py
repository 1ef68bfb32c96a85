"""Entry of an elastic job on this node: resolve the rendezvous, open torch's handler, run the agent.

Called by ``launcher.cli.launch_local`` for a spec whose ``elastic.rdzv_backend`` is not static
(the static path never imports this module, nor torch).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import uuid

from collective.env import find_free_port
from collective.errors import ConfigError
from launcher.attempt import Interrupted, install_signal_handlers
from launcher.elastic.config import RdzvBackend, describe_job, job_fingerprint
from launcher.elastic.rdzv import (
    claim_run_id,
    hosts_port,
    is_local_host,
    job_store,
    make_handler,
    probe_endpoint,
    route_ip,
)
from launcher.job_files import write_job_file, write_strategy
from launcher.schedulers.local.elastic_agent import ElasticAgent
from launcher.spec import JobSpec

logger = logging.getLogger(__name__)


def launch_elastic(spec: JobSpec) -> int:
    """Run this node's agent of an elastic job; return fleetrun's exit code."""
    e = spec.elastic
    entry = spec.entrypoint
    if entry.script and not os.path.exists(entry.script):
        raise ConfigError(
            f"script {entry.script!r} not found (working directory {os.getcwd()})",
            key="entrypoint.script",
        )
    host, port = e.endpoint()
    run_id = spec.run_id or (uuid.uuid4().hex[:12] if e.standalone else spec.name)
    if e.standalone or port == 0:
        port = find_free_port("127.0.0.1")
    where = f"{host}:{port}"
    loopback = host in ("127.0.0.1", "localhost", "::1")
    node_ip = "127.0.0.1" if loopback else route_ip(host)
    timeout_s = spec.rendezvous.timeout_s
    # torch >= 2.4 shares one TCPStore server per agent for the workers' bootstrap; when the
    # agent that was rank 0 is rank 0 again in a later round it does not republish the address
    # in the new round's store, and a node joining then blocks in RendezvousStoreInfo.build
    # (seen with torch 2.13: the join never completes). Our workers get MASTER_ADDR/PORT from
    # our own records (launcher.elastic.membership), so we turn the sharing off.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    install_signal_handlers()
    try:
        may_host = e.rdzv_backend is RdzvBackend.C10D and is_local_host(host)
        if not may_host:
            what = (
                "c10d store"
                if e.rdzv_backend is RdzvBackend.C10D
                else f"etcd for rdzv_backend {e.rdzv_backend}"
            )
            probe_endpoint(host, port, timeout_s, what)
        conf = dict(e.handler_conf())
        conf.setdefault(
            "timeout" if e.rdzv_backend is RdzvBackend.ETCD else "join_timeout",
            str(max(1, math.ceil(timeout_s))),
        )
        assert e.min_nodes is not None and e.max_nodes is not None
        handler = make_handler(
            e.rdzv_backend, where, run_id, e.min_nodes, e.max_nodes, node_ip, conf
        )
        hosts_store = may_host and hosts_port(port)
        claim_run_id(
            job_store(handler, e.rdzv_backend, run_id),
            run_id,
            job_fingerprint(spec),
            describe_job(spec),
        )
        write_job_file(spec, "job.yaml")
        strategy_file = write_strategy(spec)
        logger.info(
            "elastic job '%s': rendezvous %s at %s (run id %s%s), nodes %d..%d x %d "
            "trainer(s), max_restarts %d, log_dir %s",
            spec.name,
            e.rdzv_backend,
            where,
            run_id,
            ", this agent hosts the store" if hosts_store else "",
            e.min_nodes,
            e.max_nodes,
            spec.sizes.nproc_per_node,
            spec.max_restarts,
            os.path.abspath(spec.log_dir),
        )
        agent = ElasticAgent(
            spec,
            handler,
            run_id=run_id,
            node_ip=node_ip,
            where=where,
            hosts_store=hosts_store,
            strategy_file=strategy_file,
        )
        return agent.run()
    except Interrupted as sig:
        sys.stderr.write(
            f"fleetrun: got {sig}; stopped this node's processes of job '{spec.name}' "
            "(the other nodes of the elastic job carry on)\n"
        )
        return 128 + sig.signum
