"""Errors of :mod:`fleet.data` (both in the one hierarchy rooted at ``FleetError``)."""

from __future__ import annotations

from collective.errors import DatasetFormatError, FleetError


class DataSourceError(FleetError, OSError):
    """A data file cannot be read: missing, a glob matching nothing, an empty file list, a
    ``pipe_command`` / ``download_cmd`` that exited non-zero (the message quotes its stderr)."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:  # OSError's would print the args tuple
        return str(self.args[0]) if self.args else ""


__all__ = ["DataSourceError", "DatasetFormatError"]
