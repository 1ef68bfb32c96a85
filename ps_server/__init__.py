"""fleetrun's gRPC parameter server (sparse and dense tables, server-side optimizers).

Not implemented yet: any use raises :class:`collective.errors.FleetNotImplementedError`.
"""

from __future__ import annotations

from typing import Any

from collective.errors import FleetNotImplementedError


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise FleetNotImplementedError(
        f"ps_server.{name}", "the parameter server has not landed yet; use collective mode"
    )
