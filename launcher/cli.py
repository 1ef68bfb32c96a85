"""The ``fleetrun`` command line: flags (or FLEETRUN_* env vars) + job file → JobSpec → launch.

Parsing stays here; nothing below sees click. Precedence: job file < environment < flag.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import click
from click.core import ParameterSource

from collective.errors import ConfigError, FleetError
from launcher.attempt import close_warm_early, start_warm_early
from launcher.schedulers import get_scheduler
from launcher.spec import (
    JobSpec,
    build_spec,
    load_yaml,
    set_path,
    split_modules,
)

SUBCOMMANDS = ("status", "logs", "delete", "dashboard", "pod", "k8s", "plan")
"""First words that select a tool subcommand (launcher/commands.py; ``plan`` is
launcher/plan_command.py, registered there) instead of a launch."""

# click parameter name -> job-spec key path
FLAG_TO_KEY = {
    "nproc_per_node": "sizes.nproc_per_node",
    "nnodes": "sizes.nnodes",
    "node_rank": "rendezvous.node_rank",
    "master_addr": "rendezvous.master_addr",
    "master_port": "rendezvous.master_port",
    "ips": "rendezvous.ips",
    "rdzv_timeout": "rendezvous.timeout_s",
    "backend": "backend",
    "log_dir": "log_dir",
    "max_restarts": "max_restarts",
    "run_id": "run_id",
    "tee": "tee",
    "job_name": "name",
    "run_mode": "mode",
    "scheduler": "scheduler",
    "server_num": "sizes.server_num",
    "worker_num": "sizes.worker_num",
    "grace_period": "grace_period_s",
    "strategy": "strategy",
    "servers": "ps.servers",
    "workers": "ps.workers",
    "pod_ip": "ps.pod_ip",
    "metrics": "metrics",
    "warm_start": "warm_start",
    "warm_imports": "warm_imports",
    # elastic jobs (launcher/elastic/config.py folds the spellings): torchrun's, then Paddle's
    "rdzv_backend": "elastic.rdzv_backend",
    "rdzv_endpoint": "elastic.rdzv_endpoint",
    "rdzv_id": "run_id",
    "rdzv_conf": "elastic.rdzv_conf",
    "standalone": "elastic.standalone",
    "monitor_interval": "elastic.monitor_interval_s",
    "elastic_server": "elastic.rdzv_endpoint",
    "job_id": "run_id",
    "np": "sizes.nnodes",
    "ps_checkpoint_dir": "ps_checkpoint.dir",
    "ps_checkpoint_interval": "ps_checkpoint.interval_s",
    "ps_checkpoint_keep": "ps_checkpoint.keep",
    "ps_ssd_dir": "ps.ssd_dir",
    "ps_bind_cpus": "ps.bind_cpus",
    "heter_worker_num": "sizes.heter_worker_num",
    "heter_workers": "ps.heter_workers",
    "heter_devices": "ps.heter_devices",
}

EPILOG = """\b
Examples:
  fleetrun --nproc_per_node 2 examples/dp/train.py --steps 60
  fleetrun --nproc_per_node 4 -m mypkg.train --lr 0.1
  fleetrun -c configs/dp_local.yaml --max_restarts 2
  # two nodes (run on each, with its rank):
  fleetrun --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 train.py
  fleetrun --ips 10.0.0.1,10.0.0.2 --nproc_per_node 8 train.py   # Paddle style
  # elastic, 1 to 4 nodes (run on each; the agent on 10.0.0.1 hosts the store):
  fleetrun --nnodes 1:4 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29400 --rdzv_id job1 \
    --max_restarts 3 train.py
  fleetrun --elastic_server etcd://10.0.0.9:2379 --job_id job1 --np 1:4 train.py  # Paddle
  # heterogeneous PS: CPU trainers + a device worker for the dense half:
  fleetrun --server_num 2 --worker_num 4 --heter_worker_num 1 --heter_devices cuda train.py

Every option can also be set in the environment as FLEETRUN_<OPTION>
(e.g. FLEETRUN_NPROC_PER_NODE=2). Precedence: job file < environment < flag.
"""


def _modules(value: str | None) -> list[str] | None:
    """``--warm_imports``' comma-separated modules; click's usage error naming a bad one."""
    try:
        return None if value is None else split_modules(value)
    except ConfigError as err:
        raise click.BadParameter(str(err)) from None


def _opt(*names: str, **kw: Any) -> Any:
    """An option accepting both ``_`` and ``-`` spellings of its long name."""
    longs = [n for n in names if n.startswith("--")]
    extra = [n.replace("_", "-") for n in longs if "_" in n]
    return click.option(*names, *extra, **kw)


@click.command(
    name="fleetrun",
    epilog=EPILOG,
    context_settings={
        "help_option_names": ["-h", "--help"],
        "allow_interspersed_args": False,
        "max_content_width": 100,
    },
)
@_opt(
    "-c",
    "--config",
    "config",
    type=click.Path(dir_okay=False),
    help="Job file (YAML); see configs/.",
)
@_opt(
    "--nproc_per_node",
    "nproc_per_node",
    metavar="N|auto",
    help="Trainers per node (default 1; auto = one per GPU, or 1 without GPUs).",
)
@_opt(
    "--nnodes",
    "nnodes",
    metavar="N|MIN:MAX",
    help="Number of nodes (default 1); MIN:MAX = an elastic job (needs --rdzv_backend).",
)
@_opt(
    "--node_rank",
    "node_rank",
    type=int,
    help="Rank of this node (default 0, or own index in --ips).",
)
@_opt("--master_addr", "master_addr", metavar="HOST", help="Address of node 0 (default 127.0.0.1).")
@_opt(
    "--master_port",
    "master_port",
    type=int,
    metavar="PORT",
    help="Rendezvous port on node 0 (default: a free port on one node, 29500 on several).",
)
@_opt(
    "--ips",
    "ips",
    metavar="IP,IP,...",
    help="Paddle-style node list; nnodes = its length, master = the first, node rank = own index.",
)
@_opt(
    "--backend",
    "backend",
    type=click.Choice(["auto", "gloo", "nccl"]),
    help="Process-group backend (default auto: nccl with GPUs, else gloo).",
)
@_opt(
    "--log_dir",
    "log_dir",
    metavar="DIR",
    help="Where workerlog.N and endpoints.log go (default log).",
)
@_opt(
    "--max_restarts",
    "max_restarts",
    type=int,
    help="Restart the whole job up to K times after a failure (default 0).",
)
@_opt("--run_id", "run_id", help="Job id given to workers as TORCHELASTIC_RUN_ID (default random).")
@_opt(
    "--tee",
    "tee",
    type=click.Choice(["rank0", "all", "none"]),
    help="Console output: rank0 (default), all ranks prefixed [rank N], or none.",
)
@_opt("--job_name", "job_name", help="Job name (default fleetrun).")
@_opt(
    "--strategy",
    "strategy",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="DistributedStrategy YAML given to every trainer (fleet.init() loads it).",
)
@_opt(
    "--run_mode",
    "run_mode",
    type=click.Choice(["collective", "ps"]),
    help="Job mode (default collective).",
)
@_opt(
    "--scheduler",
    "scheduler",
    type=click.Choice(["local", "ray", "k8s"]),
    help="Where to run (default local).",
)
@_opt("--server_num", "server_num", type=int, help="Parameter servers (PS mode).")
@_opt("--worker_num", "worker_num", type=int, help="Trainers (PS mode).")
@_opt(
    "--servers",
    "servers",
    metavar="IP:PORT,...",
    help="PS mode on several nodes: every server's endpoint (each node runs those with its IP).",
)
@_opt(
    "--workers",
    "workers",
    metavar="IP:PORT,...",
    help="PS mode on several nodes: every trainer's endpoint.",
)
@_opt(
    "--heter_worker_num",
    "heter_worker_num",
    type=int,
    help="Heterogeneous PS: heter workers running the dense half of the model for the CPU "
    "trainers (TRAINING_ROLE=HETER_TRAINER).",
)
@_opt(
    "--heter_workers",
    "heter_workers",
    metavar="IP:PORT,...",
    help="Heterogeneous PS on several nodes: every heter worker's endpoint (with --servers).",
)
@_opt(
    "--heter_devices",
    "heter_devices",
    metavar="DEVICE[,...]",
    help="Heter workers' devices: cpu, cuda, cuda:N (gpu, gpu:N as in Paddle); one for all or "
    "one per heter worker (default cpu).",
)
@_opt(
    "--pod_ip",
    "pod_ip",
    metavar="IP",
    help="This node's IP in --servers/--workers (default: detected).",
)
@_opt(
    "--ps_checkpoint_dir",
    "ps_checkpoint_dir",
    metavar="DIR",
    help="PS mode: checkpoint the job here automatically, resume from it at start, and recover "
    "a dead server or trainer from it (each recovery uses one --max_restarts).",
)
@_opt(
    "--ps_checkpoint_interval",
    "ps_checkpoint_interval",
    type=float,
    metavar="SECONDS",
    help="PS mode: seconds between automatic checkpoints (default 600).",
)
@_opt(
    "--ps_checkpoint_keep",
    "ps_checkpoint_keep",
    type=int,
    metavar="K",
    help="PS mode: newest automatic checkpoints kept (default 3; 0 = all).",
)
@_opt(
    "--ps_ssd_dir",
    "ps_ssd_dir",
    metavar="DIR",
    help="PS mode: absolute local directory for the cold rows of storage='ssd' tables (server "
    "i uses DIR/server-i; scratch, rebuilt from the checkpoint on restart).",
)
@_opt(
    "--ps_bind_cpus",
    "ps_bind_cpus",
    is_flag=True,
    default=None,
    help="PS mode: bind each server to its own share of its host's CPUs (for hosts that run "
    "several servers).",
)
@_opt(
    "--rdzv_timeout",
    "rdzv_timeout",
    type=float,
    metavar="SECONDS",
    help="How long nodes wait for each other at start (default 300).",
)
@_opt(
    "--rdzv_backend",
    "rdzv_backend",
    type=click.Choice(["static", "c10d", "etcd", "etcd-v2"]),
    help="Elastic jobs: torch's rendezvous (c10d, etcd, etcd-v2); static (default) = fixed nodes.",
)
@_opt(
    "--rdzv_endpoint",
    "rdzv_endpoint",
    metavar="HOST:PORT",
    help="Elastic jobs: the c10d store (hosted by the agent on HOST) or the etcd server.",
)
@_opt(
    "--rdzv_id", "rdzv_id", metavar="ID", help="Elastic jobs: the job's rendezvous id (= --run_id)."
)
@_opt(
    "--rdzv_conf",
    "rdzv_conf",
    metavar="K=V,...",
    help="Elastic jobs: options of torch's handler (e.g. last_call_timeout=1,join_timeout=60).",
)
@_opt(
    "--standalone",
    "standalone",
    is_flag=True,
    help="Elastic job on this machine only: c10d on 127.0.0.1 with a free port.",
)
@_opt(
    "--monitor_interval",
    "monitor_interval",
    type=float,
    metavar="SECONDS",
    help="Elastic jobs: seconds between checks for nodes waiting to join (default 0.1).",
)
@_opt(
    "--elastic_server",
    "elastic_server",
    metavar="etcd://HOST:PORT",
    help="Paddle spelling of --rdzv_backend etcd --rdzv_endpoint HOST:PORT.",
)
@_opt("--job_id", "job_id", metavar="ID", help="Paddle spelling of --rdzv_id.")
@_opt("--np", "np", metavar="N|MIN:MAX", help="Paddle spelling of --nnodes (elastic node range).")
@_opt(
    "--grace_period",
    "grace_period",
    type=float,
    metavar="SECONDS",
    help="Seconds between SIGTERM and SIGKILL at teardown (default 5).",
)
@_opt(
    "--dry_run",
    "dry_run",
    is_flag=True,
    help="k8s: print the manifests instead of applying them; other schedulers: print the plan.",
)
@_opt(
    "--warm_start",
    "warm_start",
    type=click.Choice(["on", "off"]),
    help="on: fork Python workers and their restarts from a per-node process that imported "
    "torch and fleet once (job file warm_start:, warm_imports:); off: start each afresh "
    "(default on where the platform can fork).",
)
@_opt(
    "--warm_imports",
    "warm_imports",
    callback=lambda _ctx, _param, value: _modules(value),
    help="Modules the warm process also imports, comma-separated (job file warm_imports:).",
)
@click.option(
    "--metrics/--no-metrics",
    " /--no_metrics",
    "metrics",
    default=None,
    help="Prometheus /metrics on every process, listed in LOG_DIR/metrics_targets.json "
    "(default on).",
)
@_opt(
    "--dashboard",
    "dashboard",
    is_flag=True,
    help="Also serve the live dashboard (fleetrun dashboard) on 127.0.0.1 while the job runs.",
)
@click.option("-m", "--module", "module", is_flag=True, help="Run SCRIPT as a module (python -m).")
@_opt("--no_python", "no_python", is_flag=True, help="Run SCRIPT directly, not through Python.")
@click.argument("script", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_command(ctx: click.Context, **params: Any) -> None:
    """Launch a distributed training job: fleetrun [OPTIONS] SCRIPT [SCRIPT_ARGS]..."""
    try:
        spec = spec_from_params(ctx, params)
        code = launch(spec, dry_run=params["dry_run"], dashboard=params["dashboard"])
    except ConfigError as err:
        click.echo(f"fleetrun: error: {err}", err=True)
        ctx.exit(2)
    except FleetError as err:
        click.echo(f"fleetrun: error: {err}", err=True)
        ctx.exit(1)
    ctx.exit(code)


def spec_from_params(ctx: click.Context, params: dict[str, Any]) -> JobSpec:
    """Merge job file, environment and flags into a validated JobSpec."""
    data: dict[str, Any] = load_yaml(params["config"]) if params.get("config") else {}
    from_cli: dict[str, str] = {}
    for name, key in FLAG_TO_KEY.items():
        source = ctx.get_parameter_source(name)
        if (
            source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
            and params[name] is not None
        ):
            set_path(data, key, params[name])
            from_cli[key] = "--" + name
    if params.get("script"):
        entry: dict[str, Any] = {"args": list(params["script_args"])}
        entry["module" if params["module"] else "script"] = params["script"]
        if params["no_python"]:
            entry["no_python"] = True
        data["entrypoint"] = entry
    try:
        spec = build_spec(data)
    except ConfigError as err:
        flag = from_cli.get(err.key or "")
        if flag:
            raise ConfigError(f"{err.message} (set by {flag})", key=err.key) from None
        raise
    entry_spec = spec.entrypoint
    if not entry_spec.script and not entry_spec.module:
        raise ConfigError(
            "nothing to run: give SCRIPT (fleetrun [OPTIONS] train.py) or entrypoint.script / "
            "entrypoint.module in the job file (-c)",
            key="entrypoint",
        )
    return spec


def launch(spec: JobSpec, *, dry_run: bool = False, dashboard: bool = False) -> int:
    """Run a validated spec on its scheduler (:func:`launcher.schedulers.get_scheduler`); return
    the process exit code."""
    if not dry_run:
        start_warm_early(spec)  # its imports overlap the scheduler's
    try:
        scheduler = get_scheduler(spec.scheduler)
        scheduler.check_dry_run(dry_run)
        if dashboard and scheduler.log_dir_here:
            from launcher.dashboard import start_dashboard_thread  # lazy: HTTP server code

            start_dashboard_thread(spec.log_dir)
        return scheduler.launch(spec, dry_run=dry_run)
    finally:
        close_warm_early()


def init_logging() -> None:
    """fleetrun's own log lines: ``[fleetrun] message`` on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[fleetrun] %(message)s"))
    root = logging.getLogger("launcher")
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("FLEETRUN_LOG_LEVEL", "INFO").upper())
    root.propagate = False


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``fleetrun``): a tool subcommand (status, logs, delete,
    dashboard, plan) or a job launch."""
    init_logging()
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in SUBCOMMANDS:
        from launcher.commands import tools  # lazy: subcommands only; keeps a launch's start short

        tools.main(args=args, prog_name="fleetrun", auto_envvar_prefix="FLEETRUN")
        return
    run_command.main(args=args, prog_name="fleetrun", auto_envvar_prefix="FLEETRUN")
