"""Errors of the RPC layer and the ONE mapping between fleetrun errors and gRPC status codes.

Server side, :func:`status_of` turns an exception raised while serving a request into a status
code (the servicer aborts the call with it and the exception's message):

* ``WrongShardError`` (a client routing bug), ``ShmSegmentError``, ``ReadOnlyServingError`` (a
  mutating call to a server serving a read-only export), ``SsdTierError`` (an SSD table's
  directory or RocksDB cannot be used) → FAILED_PRECONDITION
* ``TableInputError`` (incl. ``NonFiniteGradientError``), ``collective.errors.ConfigError``,
  ``RequestDecodeError`` (a body that is not the method's message) → INVALID_ARGUMENT
* ``TableNotFoundError`` → NOT_FOUND
* ``TableConfigMismatchError`` → ALREADY_EXISTS
* ``TableCapacityError`` → RESOURCE_EXHAUSTED
* ``CheckpointPathError`` (a Save / Load path outside the server's checkpoint roots) →
  PERMISSION_DENIED; ``CheckpointCorruptError`` → DATA_LOSS; other ``CheckpointError`` →
  FAILED_PRECONDITION
* ``AuthError`` (no token, or not the job's: :mod:`ps_server.rpc.auth`) → UNAUTHENTICATED
* ``BarrierTimeoutError`` → DEADLINE_EXCEEDED
* ``ServerStoppingError`` → UNAVAILABLE
* anything else (a bug) → INTERNAL, logged server-side with its traceback

A request larger than the server's max message size never reaches our code: gRPC answers
RESOURCE_EXHAUSTED by itself.

Client side, :func:`rpc_error` turns a ``grpc.RpcError`` into a :class:`PSRpcError` subclass
(one per status code, in :data:`ERROR_OF_CODE`) whose message names the method, the server
endpoint, the status code and the server's message.
"""

from __future__ import annotations

import grpc

from collective.errors import ConfigError, PSError
from ps_server.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointPathError,
    DataPathError,
    ReadOnlyServingError,
    ShmSegmentError,
    SsdTierError,
    TableCapacityError,
    TableConfigMismatchError,
    TableInputError,
    TableNotFoundError,
    WrongShardError,
)


# -- server-side errors of the RPC layer -------------------------------------------------------
class RequestDecodeError(PSError, ValueError):
    """The request body is not a valid protobuf message of the method's request type."""


class BarrierTimeoutError(PSError, TimeoutError):
    """Not every caller of a barrier arrived within its timeout (names who was missing)."""


class ServerStoppingError(PSError):
    """The server is shutting down: a waiting call (barrier) was released without completing."""


class AuthError(PSError, PermissionError):
    """A call without the job's token (none, or another one); nothing was done."""


_SERVER_MAP: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    # order matters: subclasses before their bases
    (WrongShardError, grpc.StatusCode.FAILED_PRECONDITION),
    (ShmSegmentError, grpc.StatusCode.FAILED_PRECONDITION),
    (ReadOnlyServingError, grpc.StatusCode.FAILED_PRECONDITION),
    (SsdTierError, grpc.StatusCode.FAILED_PRECONDITION),
    (TableInputError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (RequestDecodeError, grpc.StatusCode.INVALID_ARGUMENT),
    (TableNotFoundError, grpc.StatusCode.NOT_FOUND),
    (TableConfigMismatchError, grpc.StatusCode.ALREADY_EXISTS),
    (TableCapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CheckpointPathError, grpc.StatusCode.PERMISSION_DENIED),
    (DataPathError, grpc.StatusCode.PERMISSION_DENIED),
    (CheckpointCorruptError, grpc.StatusCode.DATA_LOSS),
    (CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
    (BarrierTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ServerStoppingError, grpc.StatusCode.UNAVAILABLE),
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code a request that raised ``exc`` ends with (INTERNAL: not a known error)."""
    for cls, code in _SERVER_MAP:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


# -- client-side errors -----------------------------------------------------------------------
class PSRpcError(PSError):
    """A parameter-server call failed; ``endpoint``, ``code`` (grpc.StatusCode), ``method`` and
    ``details`` (the server's message) say where and why."""

    def __init__(self, method: str, endpoint: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} on {endpoint} failed: {code.name}: {details}")
        self.method = method
        self.endpoint = endpoint
        self.code = code
        self.details = details


class PSInvalidArgumentError(PSRpcError, ValueError):
    """INVALID_ARGUMENT: the request is wrong (dim, lengths, non-finite values, bad config)."""


class PSNotFoundError(PSRpcError, LookupError):
    """NOT_FOUND: unknown table or dense block."""


class PSAlreadyExistsError(PSRpcError):
    """ALREADY_EXISTS: the table exists with another config (the message shows both)."""


class PSResourceExhaustedError(PSRpcError):
    """RESOURCE_EXHAUSTED: message larger than the limit, or a table's max_capacity."""


class PSFailedPreconditionError(PSRpcError):
    """FAILED_PRECONDITION: wrong routing, a checkpoint that cannot be saved / loaded, or a
    mutating call to a read-only serving server."""


class PSDataLossError(PSRpcError):
    """DATA_LOSS: a checkpoint file is corrupt."""


class PSUnavailableError(PSRpcError, ConnectionError):
    """UNAVAILABLE: the server cannot be reached or is stopping."""


class PSDeadlineExceededError(PSRpcError, TimeoutError):
    """DEADLINE_EXCEEDED: the call (or a barrier) timed out."""


class PSUnauthenticatedError(PSRpcError, PermissionError):
    """UNAUTHENTICATED: the call carried no token or not the job's (FLEET_PS_TOKEN)."""


class PSPermissionDeniedError(PSRpcError, PermissionError):
    """PERMISSION_DENIED: a checkpoint path outside the server's --checkpoint_root, or a graph
    file outside its data roots (FLEET_PS_DATA_ROOT)."""


class PSInternalError(PSRpcError):
    """INTERNAL / UNKNOWN / others: a bug; the server logged the traceback."""


ERROR_OF_CODE: dict[grpc.StatusCode, type[PSRpcError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: PSInvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: PSNotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: PSAlreadyExistsError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: PSResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: PSFailedPreconditionError,
    grpc.StatusCode.DATA_LOSS: PSDataLossError,
    grpc.StatusCode.UNAVAILABLE: PSUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: PSDeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: PSUnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PSPermissionDeniedError,
}
"""The client-side error class of each status code (others: :class:`PSInternalError`)."""


def rpc_error(method: str, endpoint: str, err: grpc.RpcError) -> PSRpcError:
    """The PSRpcError for a failed call (``err`` is a ``grpc.Call`` as well as an RpcError)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    return ERROR_OF_CODE.get(code, PSInternalError)(method, endpoint, code, details)


__all__ = [
    "ERROR_OF_CODE",
    "AuthError",
    "BarrierTimeoutError",
    "PSAlreadyExistsError",
    "PSDataLossError",
    "PSDeadlineExceededError",
    "PSFailedPreconditionError",
    "PSInternalError",
    "PSInvalidArgumentError",
    "PSNotFoundError",
    "PSPermissionDeniedError",
    "PSResourceExhaustedError",
    "PSRpcError",
    "PSUnauthenticatedError",
    "PSUnavailableError",
    "RequestDecodeError",
    "ServerStoppingError",
    "rpc_error",
    "status_of",
]
