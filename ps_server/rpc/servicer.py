"""The gRPC side of the parameter server: a thin servicer over the RPC functions of
:mod:`ps_server.rpc.service`, and its registration.

:class:`ParameterServerServicer` counts the request, calls the function and turns an exception
into a status code through :func:`ps_server.rpc.status.status_of` (the one mapping); it records the
request's metrics (:mod:`ps_server.telemetry`). :func:`add_servicer_to_server` registers it with a
lenient request parser (a body that is not the method's message becomes INVALID_ARGUMENT; gRPC's
own parser would answer INTERNAL) and the zero-copy codec of :mod:`ps_server.rpc.wire` for the
sparse pull / push messages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from ps_server import telemetry
from ps_server.errors import NonFiniteGradientError
from ps_server.rpc.checkpoint_service import (
    check_writable,
    checkpoint_begin,
    checkpoint_commit,
    checkpoint_wait,
    list_checkpoints,
    load,
)
from ps_server.rpc.proto import ps_pb2, ps_pb2_grpc
from ps_server.rpc.service import (
    MAX_DETAILS_CHARS,
    SERVICE_NAME,
    PullSparseReply,
    ServerState,
    barrier,
    create_table,
    end_day,
    init_dense,
    list_tables,
    pull_dense,
    pull_sparse,
    push_dense,
    push_sparse,
    push_step,
    save,
    shm_attach,
    shm_detach,
    shrink,
    stats,
    stop,
)
from ps_server.rpc.status import RequestDecodeError, status_of
from ps_server.rpc.wire import wire_message

logger = logging.getLogger(__name__)


# -- the servicer ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Undecodable:
    """Stands for a request body the lenient deserializer could not parse."""

    type_name: str
    size: int
    error: str


def _record(state: ServerState, op: str, request: Any, code: str, t0: float, reply: Any) -> None:
    """Metrics of one RPC (:mod:`ps_server.telemetry`); the table label only for tables that
    exist (a bad name in a request must not create a label)."""
    table = getattr(request, "table", "")
    if table not in state.tables:
        table = ""
    keys = 0
    if isinstance(reply, PullSparseReply):
        keys = int(reply.values.shape[0])
    elif op == "PushSparse" and reply is not None:
        keys = int(reply.num_keys)
    elif op == "PushStep" and reply is not None:
        keys = sum(int(r.num_keys) for r in reply.sparse)
    telemetry.record_request(op, table, code, time.perf_counter() - t0, keys)


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    """Thin servicer: count, delegate to the module functions, map errors to status codes."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _run(self, op: str, fn: Callable[..., Message], request: Any, context: Any) -> Message:
        st = self.state
        with st.counter_lock:
            st.requests[op] += 1
        t0 = time.perf_counter() if telemetry.enabled() else 0.0
        if isinstance(request, _Undecodable):
            err: BaseException = RequestDecodeError(
                f"{op}: the {request.size}-byte request body is not a valid "
                f"fleetrun.ps.v1.{request.type_name}: {request.error}"
            )
        else:
            try:
                check_writable(st, op)
                reply = fn(st, request)
                if t0:
                    _record(st, op, request, "OK", t0, reply)
                return reply
            except Exception as exc:  # noqa: BLE001 - every error becomes a status code
                err = exc
        code = status_of(err)
        if t0:
            _record(st, op, request, code.name, t0, None)
        with st.counter_lock:
            st.errors[f"{op}:{code.name}"] += 1
            if isinstance(err, NonFiniteGradientError):
                st.events["nonfinite_rejected"] += 1
                st.nonfinite_rejected[getattr(request, "table", "")] += 1
        if code is grpc.StatusCode.INTERNAL:
            logger.error("%s failed with an unexpected error (a bug)", op, exc_info=err)
            details = f"{type(err).__name__}: {err} (unexpected server error; see the server log)"
        else:
            logger.debug("%s -> %s: %s", op, code.name, err)
            details = str(err)
        if len(details) > MAX_DETAILS_CHARS:
            details = details[: MAX_DETAILS_CHARS - 20] + " ... (cut)"
        context.abort(code, details)
        raise AssertionError("context.abort returned")  # pragma: no cover - abort raises

    def CreateTable(self, request: Any, context: Any) -> Message:
        return self._run("CreateTable", create_table, request, context)

    def ListTables(self, request: Any, context: Any) -> Message:
        return self._run("ListTables", list_tables, request, context)

    def PullSparse(self, request: Any, context: Any) -> Message:
        return self._run("PullSparse", pull_sparse, request, context)

    def PushSparse(self, request: Any, context: Any) -> Message:
        return self._run("PushSparse", push_sparse, request, context)

    def InitDense(self, request: Any, context: Any) -> Message:
        return self._run("InitDense", init_dense, request, context)

    def PullDense(self, request: Any, context: Any) -> Message:
        return self._run("PullDense", pull_dense, request, context)

    def PushDense(self, request: Any, context: Any) -> Message:
        return self._run("PushDense", push_dense, request, context)

    def PushStep(self, request: Any, context: Any) -> Message:
        return self._run("PushStep", push_step, request, context)

    def Save(self, request: Any, context: Any) -> Message:
        return self._run("Save", save, request, context)

    def Load(self, request: Any, context: Any) -> Message:
        return self._run("Load", load, request, context)

    def CheckpointBegin(self, request: Any, context: Any) -> Message:
        return self._run("CheckpointBegin", checkpoint_begin, request, context)

    def CheckpointWait(self, request: Any, context: Any) -> Message:
        return self._run("CheckpointWait", checkpoint_wait, request, context)

    def CheckpointCommit(self, request: Any, context: Any) -> Message:
        return self._run("CheckpointCommit", checkpoint_commit, request, context)

    def ListCheckpoints(self, request: Any, context: Any) -> Message:
        return self._run("ListCheckpoints", list_checkpoints, request, context)

    def Shrink(self, request: Any, context: Any) -> Message:
        return self._run("Shrink", shrink, request, context)

    def EndDay(self, request: Any, context: Any) -> Message:
        return self._run("EndDay", end_day, request, context)

    def Barrier(self, request: Any, context: Any) -> Message:
        return self._run(
            "Barrier", lambda st, req: barrier(st, req, context.is_active), request, context
        )

    def ShmAttach(self, request: Any, context: Any) -> Message:
        return self._run("ShmAttach", shm_attach, request, context)

    def ShmDetach(self, request: Any, context: Any) -> Message:
        return self._run("ShmDetach", shm_detach, request, context)

    def Stats(self, request: Any, context: Any) -> Message:
        return self._run("Stats", stats, request, context)

    def Stop(self, request: Any, context: Any) -> Message:
        return self._run("Stop", stop, request, context)


_PULL_SPARSE_RESPONSE = wire_message(ps_pb2.PullSparseResponse)
_FAST_REQUESTS = {
    "PullSparse": wire_message(ps_pb2.PullSparseRequest).decode,
    "PushSparse": wire_message(ps_pb2.PushSparseRequest).decode,
}
"""Requests parsed by :mod:`ps_server.rpc.wire` (zero-copy views of the packed arrays)."""


def _lenient(type_name: str, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def lenient_parse(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as err:
            return _Undecodable(type_name, len(data), str(err))

    return lenient_parse


def _serialize(reply: Any) -> bytes:
    if isinstance(reply, PullSparseReply):
        values = b"" if reply.in_shm else reply.values
        if reply.state is None:
            return _PULL_SPARSE_RESPONSE.encode({"values": values, "dim": reply.dim})
        return _PULL_SPARSE_RESPONSE.encode(
            {
                "values": values,
                "dim": reply.dim,
                "state": b"" if reply.in_shm else reply.state,
                "state_dim": reply.state.shape[1],
            }
        )
    return reply.SerializeToString()


def add_servicer_to_server(servicer: ParameterServerServicer, server: grpc.Server) -> None:
    """Register ``servicer`` like the generated ``add_ParameterServerServicer_to_server``, but
    with request parsing that turns an undecodable body into INVALID_ARGUMENT, and the
    zero-copy codec of :mod:`ps_server.rpc.wire` for the sparse pull/push messages."""
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, m.name),
            request_deserializer=_lenient(
                m.input_type.name,
                _FAST_REQUESTS.get(m.name, getattr(ps_pb2, m.input_type.name).FromString),
            ),
            response_serializer=_serialize,
        )
        for m in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


__all__ = ["ParameterServerServicer", "add_servicer_to_server"]
