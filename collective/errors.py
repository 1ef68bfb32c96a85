"""The one error hierarchy of fleetrun.

Every package raises these (``collective`` is the lowest layer and imports only the standard
library here, so ``launcher``, ``fleet`` and ``ps_server`` can all share it). Messages say what
happened, the value seen and the fix.
"""

from __future__ import annotations


class FleetError(Exception):
    """Root of every error fleetrun raises on purpose."""


class ConfigError(FleetError, ValueError):
    """A job spec, CLI flag, strategy or environment value is wrong.

    ``key`` is the dotted path of the offending setting (``"sizes.nproc_per_node"``) when known.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message


class EnvContractError(ConfigError):
    """The environment a launcher gave this process is missing or inconsistent."""


class LaunchError(FleetError):
    """The launcher could not start the job (busy port, missing script, ...)."""


class RendezvousError(LaunchError):
    """Nodes of a multi-node job did not meet (a node never arrived, the master went away)."""


class WorkerFailedError(FleetError):
    """One or more worker processes failed; ``summary`` is the root-cause-first report."""

    def __init__(self, summary: str) -> None:
        super().__init__(summary)
        self.summary = summary


class FleetNotImplementedError(FleetError, NotImplementedError):
    """A feature that is asked for but has not landed yet; never silently ignored."""

    def __init__(self, feature: str, hint: str = "") -> None:
        msg = f"{feature} is not implemented yet in fleetrun"
        super().__init__(msg + (f": {hint}" if hint else ""))
        self.feature = feature


class PSError(FleetError):
    """Parameter-server errors (tables, RPCs)."""


class DatasetFormatError(FleetError, ValueError):
    """A data file (``fleet.data``) holds a line that is not valid MultiSlot text for the slots.

    ``path``, ``line`` (1-based), ``slot`` (name, or None when the line as a whole is wrong) and
    ``text`` (the offending token or line) say where; the message says what was expected.
    """

    def __init__(
        self, message: str, path: str = "", line: int = 0, slot: str | None = None, text: str = ""
    ) -> None:
        super().__init__(message)
        self.path, self.line, self.slot, self.text = path, line, slot, text


class ShutdownError(FleetError):
    """Shutdown callbacks of subsystems raised (the rest of the shutdown still ran)."""


__all__ = [
    "ConfigError",
    "DatasetFormatError",
    "EnvContractError",
    "FleetError",
    "FleetNotImplementedError",
    "LaunchError",
    "PSError",
    "RendezvousError",
    "ShutdownError",
    "WorkerFailedError",
]
