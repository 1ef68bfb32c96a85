"""``fleetrun status|logs|delete|dashboard|pod|k8s|plan``: tool subcommands next to the launch command.

``launcher.cli.main`` routes here when the first argument is one of ``cli.SUBCOMMANDS``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import click

from collective.errors import ConfigError, FleetError, LaunchError
from launcher.plan_command import plan_cmd
from launcher.schedulers import get_scheduler


@click.group(name="fleetrun", context_settings={"help_option_names": ["-h", "--help"]})
def tools() -> None:
    """fleetrun tool subcommands."""


def _fail(err: FleetError) -> None:
    click.echo(f"fleetrun: error: {err}", err=True)
    raise SystemExit(2 if isinstance(err, ConfigError) else 1)


JOBS_BY_NAME = "k8s"
"""The scheduler whose jobs ``status JOB``, ``logs``, ``delete`` and ``k8s scale`` address by
name (it imports the kubernetes client on first use); a local or Ray job is read from its
log_dir instead (``status --log_dir``, ``dashboard``)."""

_NAMESPACE = click.option(
    "-n",
    "--namespace",
    default="default",
    show_default=True,
    help="Kubernetes namespace of the job.",
)


def format_job_state(state: dict[str, Any], log_dir: str) -> str:
    """``fleetrun status --log_dir``: the job line, one row per process (every node's), and the
    failure summary when there is one."""
    when = time.strftime("%H:%M:%S", time.localtime(float(state.get("updated_at") or 0)))
    head = (
        f"job '{state.get('name')}' {str(state.get('state')).upper()} (attempt "
        f"{state.get('attempt')}, restarts {state.get('restarts')}/{state.get('max_restarts')}, "
        f"updated {when}) — {os.path.abspath(log_dir)}"
    )
    lines = [head]
    rows = [("ROLE", "RANK", "HOST", "STATE", "EXIT", "PID", "METRICS")]
    for p in state.get("processes") or []:
        exit_desc = (
            f"signal {p['signal']}"
            if p.get("signal")
            else "-"
            if p.get("exit_code") is None
            else f"code {p['exit_code']}"
        )
        rows.append(
            (
                str(p.get("role")),
                str(p.get("rank")),
                str(p.get("host")),
                str(p.get("state")),
                exit_desc,
                str(p.get("pid") or "-"),
                str(p.get("metrics") or "-"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    launchers = state.get("launchers") or [state.get("launcher_metrics")]
    if any(launchers):
        lines.append("launcher metrics: " + ", ".join(str(x) for x in launchers if x))
    if state.get("failure_summary"):
        lines += ["", str(state["failure_summary"])]
    return "\n".join(lines)


@tools.command(name="status")
@click.argument("job", required=False)
@click.option(
    "--log_dir",
    "--log-dir",
    "log_dir",
    default=None,
    help="A local or Ray job's log_dir: show its job_state.json (every node's "
    "job_state.node<R>.json, merged, for a job of several nodes).",
)
@_NAMESPACE
def status_cmd(job: str | None, log_dir: str | None, namespace: str) -> None:
    """Status of a Kubernetes JOB (its objects, the trainers' Job, every pod), or with
    --log_dir of a local / Ray / multi-node job from the files fleetrun keeps there."""
    if log_dir is not None:
        from launcher.telemetry import read_job_states  # lazy: the metrics module, --log_dir only

        state, error = read_job_states(log_dir)
        if state is None:
            _fail(
                LaunchError(f"{error}; is --log_dir the job's log_dir, and has fleetrun started?")
            )
            return
        click.echo(format_job_state(state, log_dir))
        if error:
            click.echo(f"fleetrun: warning: {error}", err=True)
        return
    if job is None:
        _fail(
            ConfigError(
                "give the Kubernetes job's name (fleetrun status JOB), or a local / Ray "
                "job's log directory (fleetrun status --log_dir DIR)",
                key="status",
            )
        )
        return
    try:
        click.echo(get_scheduler(JOBS_BY_NAME).status(job, namespace))
    except FleetError as err:
        _fail(err)


@tools.command(name="logs")
@click.argument("job")
@click.option("--rank", type=int, default=None, help="Only this trainer's log (its pod's).")
@click.option(
    "--server", "server", type=int, default=None, help="Only this parameter server's log."
)
@_NAMESPACE
def logs_cmd(job: str, rank: int | None, server: int | None, namespace: str) -> None:
    """Logs of a Kubernetes job's pods (each headed by the pod name)."""
    try:
        click.echo(
            get_scheduler(JOBS_BY_NAME).logs(job, namespace, rank=rank, server=server), nl=False
        )
    except FleetError as err:
        _fail(err)


@tools.command(name="delete")
@click.argument("job")
@_NAMESPACE
def delete_cmd(job: str, namespace: str) -> None:
    """Delete every Kubernetes object of a job (its pods go with them)."""
    try:
        deleted = get_scheduler(JOBS_BY_NAME).delete(job, namespace)
    except FleetError as err:
        _fail(err)
        return
    click.echo(
        f"deleted {', '.join(deleted)}" if deleted else f"job '{job}' has no objects in {namespace}"
    )


@tools.group(name="k8s")
def k8s_group() -> None:
    """Kubernetes jobs: fleetrun k8s scale JOB N."""


@k8s_group.command(name="scale")
@click.argument("job")
@click.argument("replicas", metavar="N", type=int)
@_NAMESPACE
def scale_cmd(job: str, replicas: int, namespace: str) -> None:
    """Set an elastic JOB's trainer pods to N (within its --nnodes MIN:MAX): added pods join
    the next rendezvous round; removed ones leave and the others re-form without them."""
    try:
        click.echo(get_scheduler(JOBS_BY_NAME).scale(job, namespace, replicas))
    except FleetError as err:
        _fail(err)


@tools.command(name="pod")
@click.option("--role", type=click.Choice(["trainer", "server", "heter"]), required=True)
@click.option("--job", required=True, help="Job name.")
@click.option("--mode", type=click.Choice(["collective", "ps"]), default="collective")
@click.option("--trainer_host", required=True, help="DNS name of trainer pod {index}.")
@click.option("--master_port", type=int, required=True, help="Trainer 0's rendezvous port.")
@click.option("--trainers", type=int, required=True, help="Trainer pods (collective: nodes).")
@click.option(
    "--nproc_per_node", type=int, default=1, help="Trainer processes per pod (collective)."
)
@click.option("--server_host", default="", help="DNS name of server pod {index} (PS).")
@click.option("--server_port", type=int, default=0, help="Port of every server (PS).")
@click.option("--servers", type=int, default=0, help="Server pods (PS).")
@click.option("--heter_host", default="", help="DNS name of heter pod {index} (heterogeneous PS).")
@click.option("--heter_port", type=int, default=0, help="Port of every heter worker.")
@click.option("--heters", type=int, default=0, help="Heter worker pods (heterogeneous PS).")
@click.option("--heter_devices", default="", help="Heter workers' devices, comma-separated.")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto")
@click.option("--log_dir", default="log")
@click.option("--run_id", default="none")
@click.option("--strategy", default=None, help="DistributedStrategy YAML (FLEET_STRATEGY).")
@click.option("--grace_period", type=float, default=5.0)
@click.option("--rdzv_timeout", type=float, default=300.0, help="Seconds to wait for DNS names.")
@click.option("--index", type=int, default=None, help="Pod index (default: from the environment).")
@click.option(
    "--warm_start",
    type=click.Choice(["on", "off"]),
    default="off",
    help="on: fork this pod's Python processes from one warm process (see fleetrun --warm_start).",
)
@click.option("--warm_imports", default="", help="Modules the warm process also imports.")
@click.option("-m", "--module", "module", is_flag=True, help="ENTRY is a module.")
@click.option("--no_python", is_flag=True, help="ENTRY is an executable.")
@click.argument("entry")
@click.argument("entry_args", nargs=-1, type=click.UNPROCESSED)
def pod_cmd(
    role: str,
    job: str,
    mode: str,
    trainer_host: str,
    master_port: int,
    trainers: int,
    nproc_per_node: int,
    server_host: str,
    server_port: int,
    servers: int,
    heter_host: str,
    heter_port: int,
    heters: int,
    heter_devices: str,
    backend: str,
    log_dir: str,
    run_id: str,
    strategy: str | None,
    grace_period: float,
    rdzv_timeout: float,
    index: int | None,
    warm_start: str,
    warm_imports: str,
    module: bool,
    no_python: bool,
    entry: str,
    entry_args: tuple[str, ...],
) -> None:
    """Inside a Kubernetes pod: derive rank/role/endpoints from the pod index, run ENTRY."""
    # lazy: a pod's entry point (pulls in the agent and rendezvous code) for `fleetrun pod` only
    from collective.env import Backend
    from launcher.schedulers.k8s.pod import PodConfig, run_pod
    from launcher.spec import Entrypoint, Mode, WarmStart, split_modules

    try:
        cfg = PodConfig(
            role=role,
            job=job,
            mode=Mode(mode),
            trainer_host=trainer_host,
            master_port=master_port,
            trainers=trainers,
            nproc_per_node=nproc_per_node,
            entrypoint=Entrypoint(
                script=None if module else entry,
                module=entry if module else None,
                args=tuple(entry_args),
                no_python=no_python,
            ),
            server_host=server_host,
            server_port=server_port,
            servers=servers,
            heter_host=heter_host,
            heter_port=heter_port,
            heters=heters,
            heter_devices=tuple(d for d in heter_devices.split(",") if d),
            backend=Backend(backend),
            log_dir=log_dir,
            run_id=run_id,
            strategy=strategy,
            grace_period_s=grace_period,
            rdzv_timeout_s=rdzv_timeout,
            index=index,
            warm_start=WarmStart(warm_start),
            warm_imports=tuple(split_modules(warm_imports)),
        )
        code = run_pod(cfg)
    except FleetError as err:
        _fail(err)
        return
    raise SystemExit(code)


@tools.command(name="dashboard")
@click.option("--log_dir", "--log-dir", "log_dir", default="log", help="The job's log_dir.")
@click.option(
    "--port",
    type=int,
    default=None,
    help="Port on 127.0.0.1 (default 8270, or a free one if busy; 0 = any free port).",
)
@click.option(
    "--poll_interval",
    "--poll-interval",
    "poll_interval",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between two scrapes of the job.",
)
def dashboard_cmd(log_dir: str, port: int | None, poll_interval: float) -> None:
    """Serve the live dashboard of a job on 127.0.0.1 until Ctrl-C."""
    import os
    import signal
    import threading

    from launcher.dashboard import DashboardConfig, start_dashboard  # lazy: HTTP server code

    try:
        dash = start_dashboard(
            DashboardConfig(log_dir=log_dir, port=port, poll_interval_s=poll_interval)
        )
    except FleetError as err:
        _fail(err)
        return
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: done.set())
    waiting = (
        "" if dash.monitor.job else f" (waiting for {os.path.join(log_dir, 'job_state*.json')})"
    )
    click.echo(
        f"fleetrun dashboard: {dash.url} for {os.path.abspath(log_dir)}{waiting}; Ctrl-C stops it"
    )
    try:
        while not done.wait(1.0):
            pass
    finally:
        dash.close()


tools.add_command(plan_cmd)  # ``fleetrun plan`` (launcher/plan_command.py)
