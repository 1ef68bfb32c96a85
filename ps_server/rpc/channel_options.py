"""gRPC options both ends of the parameter-server protocol share: the message-size limit.

The server (:mod:`ps_server.server`) and the client transport (:mod:`ps_server.rpc.rpc_client`)
must agree on it: a reply larger than the client's receive limit fails with RESOURCE_EXHAUSTED
even when the server could send it. The client also splits large requests to stay below it.
"""

from __future__ import annotations

from typing import Any

from collective.errors import ConfigError

MIB = 1 << 20
"""Bytes in one MiB (the unit of ``max_message_mb``)."""
DEFAULT_MAX_MESSAGE_MB = 64
"""Default largest request/response in MiB, on both ends (gRPC's own default is 4)."""


def grpc_message_options(max_message_mb: float) -> list[tuple[str, Any]]:
    """Channel/server options for a ``max_message_mb`` MiB limit each way."""
    if not max_message_mb > 0:
        raise ConfigError(f"must be > 0, got {max_message_mb!r}", key="max_message_mb")
    limit = int(max_message_mb * MIB)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


__all__ = ["DEFAULT_MAX_MESSAGE_MB", "MIB", "grpc_message_options"]
