"""Local live dashboard (not landed yet)."""

from __future__ import annotations

from collective.errors import FleetNotImplementedError


def start_dashboard_thread(log_dir: str) -> None:
    """Serve the dashboard for ``log_dir`` on 127.0.0.1 in a daemon thread."""
    raise FleetNotImplementedError("fleetrun --dashboard", "run the job without --dashboard")
