"""Parameter-server errors: subclasses of :class:`collective.errors.PSError`.

The gRPC layer maps these to status codes in one place (suggested mapping in brackets):

* :class:`TableInputError` and subclasses — the request is wrong (``INVALID_ARGUMENT``);
  :class:`WrongShardError` is a routing bug of the client (``FAILED_PRECONDITION``).
* :class:`TableConfigMismatchError` — a second create with another config (``ALREADY_EXISTS``).
* :class:`TableCapacityError` — a batch needs more rows than ``max_capacity``
  (``RESOURCE_EXHAUSTED``).
* :class:`SsdTierError` — an SSD table's directory or RocksDB cannot be used
  (``FAILED_PRECONDITION``).
* :class:`CheckpointError` and subclasses — saving or loading failed (``DATA_LOSS`` for a corrupt
  file, ``PERMISSION_DENIED`` for a path outside the server's checkpoint roots,
  ``FAILED_PRECONDITION`` otherwise, e.g. :class:`CheckpointBusyError`).
* :class:`DataPathError` — a graph file outside the server's data roots (``PERMISSION_DENIED``).
* :class:`ReadOnlyServingError` — a mutating call to a server serving a read-only export
  (``FAILED_PRECONDITION``).
* :class:`ShmSegmentError` — the same-host shared-memory path cannot be used
  (``FAILED_PRECONDITION``).

Configuration mistakes (a bad table config, a bad optimizer argument) raise
:class:`collective.errors.ConfigError` naming the field, not these.
"""

from __future__ import annotations

from collective.errors import PSError


class TableInputError(PSError, ValueError):
    """A pull/push/init argument is wrong (dtype, shape, length, unknown block).

    ``table`` and ``field`` name the table and the argument (``"keys"``, ``"grads"``, ...).
    """

    def __init__(self, table: str, field: str, message: str) -> None:
        super().__init__(f"table {table!r}, {field}: {message}")
        self.table = table
        self.field = field
        self.message = message


class NonFiniteGradientError(TableInputError):
    """A push carried NaN/inf gradients under ``nonfinite="reject"``; nothing was applied."""

    def __init__(self, table: str, num_values: int, num_rows: int, field: str = "grads") -> None:
        super().__init__(
            table,
            field,
            f"{num_values} non-finite value(s) (NaN/inf) in {num_rows} row(s); the whole push "
            "was rejected and nothing was applied. Fix the gradients (loss scaling, clipping) or "
            "create the table with nonfinite='skip' to drop only those rows",
        )
        self.num_values = num_values
        self.num_rows = num_rows


class WrongShardError(TableInputError):
    """Keys were sent to a server that does not own their shard (a client routing bug)."""


class TableNotFoundError(PSError, LookupError):
    """A request named a table (or a dense block) that does not exist."""


class TableConfigMismatchError(PSError):
    """A table was created again with a different config; the message shows both."""

    def __init__(self, table: str, differences: list[str], existing: dict, requested: dict) -> None:
        super().__init__(
            f"table {table!r} already exists with a different config:\n  "
            + "\n  ".join(differences)
            + f"\nexisting:  {existing}\nrequested: {requested}\n"
            "Create it with the same config (creating is idempotent), or use another table name."
        )
        self.table = table
        self.differences = differences


class TableCapacityError(PSError):
    """One batch needs more new rows than ``max_capacity`` allows even after evicting."""


class SsdTierError(PSError):
    """The SSD tier of a sparse table cannot be used (no ``--ssd_root``, a missing, unwritable or
    foreign directory, RocksDB failing to open, ``rocksdict`` not installed, or an operation
    SSD tables do not support yet). ``table`` and ``path`` name the table and the directory."""

    def __init__(self, table: str, path: str, message: str) -> None:
        where = f", SSD directory {path!r}" if path else ""
        super().__init__(f"table {table!r}{where}: {message}")
        self.table = table
        self.path = path


class CheckpointError(PSError):
    """Saving or loading a checkpoint failed (missing shards, mismatched configs, I/O)."""


class CheckpointCorruptError(CheckpointError):
    """A shard file is truncated, has a bad magic number or fails its checksum."""


class CheckpointPathError(CheckpointError, PermissionError):
    """A Save / Load path leaves the server's checkpoint roots (absolute elsewhere, ``..``, a
    symlink out); the message names the roots and the ``--checkpoint_root`` flag."""


class CheckpointVersionError(CheckpointError):
    """A shard file or manifest was written in a format version this code cannot read."""


class CheckpointBusyError(CheckpointError):
    """A server is still writing its part of the previous checkpoint (one at a time)."""


class DataPathError(PSError, PermissionError):
    """A graph file a request names (LoadEdges / LoadNodes) lies outside the server's data roots
    (``--data_root``, FLEET_PS_DATA_ROOT); the message names the path, the roots and the
    variable (``PERMISSION_DENIED``)."""


class ReadOnlyServingError(PSError):
    """A call that would change a server serving a read-only export (pushes, creates, saves,
    shrink, end_day, checkpoints) — ``FAILED_PRECONDITION``."""


class ShmSegmentError(PSError):
    """A shared-memory segment cannot be used: the server cannot open it (another host or
    container), it is not attached (the server restarted) or the server maps too many
    (``FAILED_PRECONDITION``; the client falls back to TCP or re-attaches)."""


__all__ = [
    "CheckpointBusyError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointPathError",
    "CheckpointVersionError",
    "NonFiniteGradientError",
    "ReadOnlyServingError",
    "ShmSegmentError",
    "SsdTierError",
    "TableCapacityError",
    "TableConfigMismatchError",
    "TableInputError",
    "TableNotFoundError",
    "WrongShardError",
]
