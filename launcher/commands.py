"""``fleetrun status|logs|delete|dashboard``: tool subcommands next to the launch command.

``launcher.cli.main`` routes here when the first argument is one of ``cli.SUBCOMMANDS``.
"""

from __future__ import annotations

import click

from collective.errors import ConfigError, FleetError, FleetNotImplementedError


@click.group(name="fleetrun", context_settings={"help_option_names": ["-h", "--help"]})
def tools() -> None:
    """fleetrun tool subcommands."""


def _fail(err: FleetError) -> None:
    click.echo(f"fleetrun: error: {err}", err=True)
    raise SystemExit(2 if isinstance(err, ConfigError) else 1)


@tools.command(name="status")
@click.argument("job")
def status_cmd(job: str) -> None:
    """Status of a Kubernetes job."""
    _fail(FleetNotImplementedError("fleetrun status", "the Kubernetes scheduler has not landed"))


@tools.command(name="logs")
@click.argument("job")
@click.option("--rank", type=int, default=None, help="Only this trainer's log.")
def logs_cmd(job: str, rank: int | None) -> None:
    """Logs of a Kubernetes job."""
    _fail(FleetNotImplementedError("fleetrun logs", "the Kubernetes scheduler has not landed"))


@tools.command(name="delete")
@click.argument("job")
def delete_cmd(job: str) -> None:
    """Delete a Kubernetes job's objects."""
    _fail(FleetNotImplementedError("fleetrun delete", "the Kubernetes scheduler has not landed"))


@tools.command(name="dashboard")
@click.option("--log_dir", "--log-dir", "log_dir", default="log", help="The job's log_dir.")
def dashboard_cmd(log_dir: str) -> None:
    """Serve the live dashboard of a job on 127.0.0.1."""
    _fail(FleetNotImplementedError("fleetrun dashboard", "the dashboard has not landed"))
