"""The dashboard's settings: one frozen dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

from collective.errors import ConfigError

DEFAULT_PORT = 8270
"""Port tried first when none is given (a free one is taken if it is busy)."""


@dataclass(frozen=True)
class DashboardConfig:
    """How ``fleetrun dashboard`` serves and polls one job."""

    log_dir: str
    """The job's log_dir (where the launcher writes job_state.json and metrics_targets.json)."""
    host: str = "127.0.0.1"
    """Interface to bind; loopback only by default (the page shows logs)."""
    port: int | None = None
    """TCP port; 0 = any free port; None = DEFAULT_PORT, or any free port when that is busy."""
    poll_interval_s: float = 1.0
    """Seconds between two polls of the state files and scrapes of every process."""
    scrape_timeout_s: float = 1.0
    """Bound on one ``/metrics`` GET."""
    max_points: int = 900
    """Points kept per time series (900 at 1 s = the last 15 minutes)."""
    max_points_out: int = 300
    """Points per series sent to the page (evenly thinned, the newest always kept)."""
    max_points_per_chart: int = 2400
    """Points per chart sent to the page, all series together (fewer per series on many
    ranks), so the JSON the page polls every second stays small (~60 KiB per chart)."""
    rate_window_s: float = 10.0
    """Rates and the step-time breakdown are taken over about this many seconds."""
    history_scrapes: int = 64
    """Raw scrapes kept per process for the rate window."""
    max_log_bytes: int = 4 << 20
    """A log link serves at most the last this-many bytes of the file."""

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(
                f"port {self.port} is not a TCP port; give 0..65535 (0 = any free)",
                key="dashboard.port",
            )
        for name in ("poll_interval_s", "scrape_timeout_s", "rate_window_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(
                    f"{name} must be > 0 seconds, got {value}", key=f"dashboard.{name}"
                )
        for name in (
            "max_points",
            "max_points_out",
            "max_points_per_chart",
            "history_scrapes",
            "max_log_bytes",
        ):
            value = getattr(self, name)
            if value < 2:
                raise ConfigError(f"{name} must be >= 2, got {value}", key=f"dashboard.{name}")
