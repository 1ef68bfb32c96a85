"""The local live dashboard: ``fleetrun dashboard --log_dir DIR`` or ``fleetrun ... --dashboard``.

A stdlib HTTP server on 127.0.0.1 (:mod:`.server`) and a poller (:mod:`.monitor`) that reads the
launcher's ``job_state.json`` / ``metrics_targets.json`` in the job's log_dir and scrapes every
process's Prometheus ``/metrics`` (:mod:`.scrape`). The page (:mod:`.page`) draws SVG charts from
``/api/state``. No torch import anywhere here.
"""

from __future__ import annotations

import logging

from launcher.dashboard.config import DEFAULT_PORT, DashboardConfig
from launcher.dashboard.server import Dashboard

__all__ = [
    "DEFAULT_PORT",
    "Dashboard",
    "DashboardConfig",
    "start_dashboard",
    "start_dashboard_thread",
]

logger = logging.getLogger(__name__)


def start_dashboard(config: DashboardConfig) -> Dashboard:
    """Bind, take a first poll, and serve in daemon threads; ``close()`` the result to stop."""
    return Dashboard(config).start()


def start_dashboard_thread(log_dir: str, port: int | None = None) -> Dashboard:
    """Serve the dashboard for ``log_dir`` on 127.0.0.1 in daemon threads (``fleetrun
    --dashboard``: it lives as long as the launcher) and log its URL."""
    dash = start_dashboard(DashboardConfig(log_dir=log_dir, port=port))
    logger.info("dashboard: %s (job log_dir %s)", dash.url, log_dir)
    return dash
