"""The parameter-server client: :class:`PSClient` (usable without fleet).

One gRPC channel per server. A sparse call routes keys with
:func:`ps_server.routing.group_by_server`, sends one request per server (several when a request
would exceed the max message size), all at once as gRPC futures, and scatters the replies back
into the caller's key order (duplicates allowed). Dense blocks live on the server of
``block_shard(name) % num_servers``; a block larger than one message is uploaded in parts (one
``upload_id``; the server acts on the last part) and pulled in ranges.

Retries: idempotent calls (pulls, CreateTable, ListTables, InitDense, Stats, health) are retried
up to ``retries`` times with exponential backoff on UNAVAILABLE / DEADLINE_EXCEEDED, each attempt
with its own deadline of ``timeout_s``. Pushes, Save, Load, Shrink, EndDay, Barrier and Stop are
never retried: when a reply is lost the server may already have acted, and a second push would
apply a gradient twice (APPLY), count one trainer twice toward a SYNC round (the mean and the
round boundary go wrong) or add a GEO delta twice. (gRPC's built-in retry policy is not used: it
shares one deadline across attempts and cannot retry DEADLINE_EXCEEDED.)

Errors: a failed call raises a :class:`ps_server.status.PSRpcError` subclass naming the method,
the server endpoint, the status code and the server's message; local argument checks raise
:class:`~ps_server.errors.TableInputError` / :class:`~collective.errors.ConfigError` before any
request is sent.

A split APPLY push keeps every occurrence of a key in the same request (keys are sorted first),
so the optimizer rule still sees each key once per push. A dense block pulled in ranges while
another client pushes to it may mix values from before and after that push.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collective.errors import ConfigError
from ps_server.codec import (
    KEY_BYTES,
    KEY_DTYPE,
    VALUE_BYTES,
    VALUE_DTYPE,
    as_flat_values,
    as_keys,
    as_rows,
    decode_rows,
    decode_values,
    encode_values,
)
from ps_server.config import (
    DenseTableConfig,
    SparseTableConfig,
    TableConfig,
    config_from_dict,
    config_to_dict,
)
from ps_server.entry import EntryPolicy
from ps_server.errors import TableInputError
from ps_server.initializers import Initializer, Uniform
from ps_server.optimizers import SGD, OptimizerRule
from ps_server.proto import ps_pb2
from ps_server.routing import block_shard, group_by_server, shards_of_server
from ps_server.server import DEFAULT_MAX_MESSAGE_MB, MIB, grpc_message_options
from ps_server.service import SERVICE_NAME
from ps_server.status import PSDeadlineExceededError, PSNotFoundError, rpc_error
from ps_server.wire import wire_message

logger = logging.getLogger(__name__)

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Status codes an idempotent call is retried on."""
DEFAULT_OPTIMIZER = SGD(0.01)
"""Default server-side rule of tables created through the client (immutable)."""
DEFAULT_INITIALIZER = Uniform(-0.01, 0.01)
"""Default initializer of sparse tables created through the client (immutable)."""
MESSAGE_OVERHEAD_BYTES = 64 * 1024
"""Room left in each message for everything but the packed arrays (names, framing)."""
_MODES = {
    "apply": ps_pb2.PUSH_MODE_APPLY,
    "sync": ps_pb2.PUSH_MODE_SYNC,
    "delta": ps_pb2.PUSH_MODE_DELTA,
}


_PULL_SPARSE_REQUEST = wire_message(ps_pb2.PullSparseRequest)
_PULL_SPARSE_RESPONSE = wire_message(ps_pb2.PullSparseResponse)
_PUSH_SPARSE_REQUEST = wire_message(ps_pb2.PushSparseRequest)


def _methods(channel: grpc.Channel) -> dict[str, Any]:
    """The service's methods on ``channel``: generated (de)serializers, except the sparse
    pull/push, which go through :mod:`ps_server.wire` (requests are encoded by the caller)."""
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    out = {}
    for m in service.methods:
        serializer = getattr(ps_pb2, m.input_type.name).SerializeToString
        deserializer = getattr(ps_pb2, m.output_type.name).FromString
        if m.name in ("PullSparse", "PushSparse"):
            serializer = None  # already wire-encoded bytes
        if m.name == "PullSparse":
            deserializer = _PULL_SPARSE_RESPONSE.decode
        out[m.name] = channel.unary_unary(
            f"/{SERVICE_NAME}/{m.name}",
            request_serializer=serializer,
            response_deserializer=deserializer,
        )
    return out


@dataclass
class _Call:
    server: int
    method: str
    request: Any
    """A generated message, or wire-encoded bytes (PullSparse, PushSparse)."""


def _le(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` as a C-contiguous little-endian array (no copy when it already is one)."""
    return np.ascontiguousarray(values, dtype=dtype)


class _Inline:
    """A call run on the spot, with a future's ``result()``."""

    def __init__(self, fn: Any, call: Any) -> None:
        self._fn, self._call = fn, call

    def result(self) -> Any:
        return self._fn(self._call)


class PSClient:
    """Client of the servers at ``endpoints`` (``["host:port", ...]`` or ``"h:p,h:p"``), in
    server-index order."""

    def __init__(
        self,
        endpoints: Sequence[str] | str,
        *,
        timeout_s: float = 60.0,
        retries: int = 3,
        max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
        backoff_s: float = 0.2,
    ) -> None:
        """``timeout_s``: deadline of each attempt; ``retries``: extra attempts of idempotent
        calls; ``max_message_mb``: largest message this client sends or accepts (larger requests
        are split)."""
        eps = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        eps = [e.strip() for e in eps if e.strip()]
        if not eps:
            raise ConfigError("must name at least one server (host:port)", key="endpoints")
        if not timeout_s > 0:
            raise ConfigError(f"must be > 0, got {timeout_s!r}", key="timeout_s")
        if not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"must be an integer >= 0, got {retries!r}", key="retries")
        options = grpc_message_options(max_message_mb)
        self.endpoints: tuple[str, ...] = tuple(eps)
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_message_bytes = int(max_message_mb * MIB)
        self._payload_bytes = max(self.max_message_bytes - MESSAGE_OVERHEAD_BYTES, 1024)
        self._channels = [grpc.insecure_channel(e, options=options) for e in self.endpoints]
        self._methods = [_methods(c) for c in self._channels]
        self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        self._configs: dict[str, TableConfig] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(4, 2 * len(self.endpoints)), thread_name_prefix="psclient"
        )

    @property
    def num_servers(self) -> int:
        """Number of servers."""
        return len(self.endpoints)

    # -- plumbing ---------------------------------------------------------------------------
    def _invoke(
        self, calls: list[_Call], idempotent: bool, timeout_s: float | None = None
    ) -> list[Any]:
        """Send ``calls`` at once, wait for every reply; raise the first failure."""
        timeout = self.timeout_s if timeout_s is None else timeout_s

        def blocking(c: _Call) -> Any:
            return self._methods[c.server][c.method](c.request, timeout=timeout)

        # grpc's .future() starts a thread per call (~1 ms each on this class of machine): one
        # call runs inline, several run on the client's long-lived pool, in parallel.
        if len(calls) == 1:
            futs: list[Any] = [_Inline(blocking, calls[0])]
        else:
            futs = [self._pool.submit(blocking, c) for c in calls]
        results: list[Any] = [None] * len(calls)
        error: Exception | None = None
        for i, (call, fut) in enumerate(zip(calls, futs)):
            try:
                results[i] = fut.result()
            except grpc.RpcError as err:
                if idempotent and err.code() in RETRYABLE and self.retries:
                    try:
                        results[i] = self._retry(call, timeout, err)
                        continue
                    except grpc.RpcError as last:
                        err = last
                error = error or rpc_error(call.method, self.endpoints[call.server], err)
        if error is not None:
            raise error
        return results

    def _retry(self, call: _Call, timeout: float, err: grpc.RpcError) -> Any:
        method = self._methods[call.server][call.method]
        for attempt in range(1, self.retries + 1):
            delay = self.backoff_s * 2 ** (attempt - 1)
            logger.warning(
                "%s on %s: %s; retry %d/%d in %.1fs",
                call.method,
                self.endpoints[call.server],
                err.code().name,
                attempt,
                self.retries,
                delay,
            )
            time.sleep(delay)
            try:
                return method(call.request, timeout=timeout)
            except grpc.RpcError as again:
                if again.code() not in RETRYABLE or attempt == self.retries:
                    raise
                err = again
        raise err  # pragma: no cover - the loop returns or raises

    def _all(self, method: str, request: Message, idempotent: bool) -> list[Any]:
        return self._invoke(
            [_Call(s, method, request) for s in range(self.num_servers)], idempotent
        )

    # -- tables -----------------------------------------------------------------------------
    def create_table(
        self,
        name: str,
        dim: int,
        optimizer: OptimizerRule = DEFAULT_OPTIMIZER,
        initializer: Initializer = DEFAULT_INITIALIZER,
        entry: EntryPolicy | None = None,
        num_shards: int = 64,
        seed: int = 0,
        **more_config: Any,
    ) -> SparseTableConfig:
        """Create sparse table ``name`` on every server (idempotent; ALREADY_EXISTS with another
        config). ``more_config``: other :class:`SparseTableConfig` fields (``nonfinite``,
        ``max_capacity``)."""
        config = SparseTableConfig(
            name, dim, optimizer, initializer, entry, num_shards, seed, **more_config
        )
        self.create_table_from_config(config)
        return config

    def create_dense_table(
        self,
        name: str,
        optimizer: OptimizerRule = DEFAULT_OPTIMIZER,
        num_shards: int = 16,
        **more_config: Any,
    ) -> DenseTableConfig:
        """Create dense table ``name`` on every server (idempotent)."""
        config = DenseTableConfig(name, optimizer, num_shards, **more_config)
        self.create_table_from_config(config)
        return config

    def create_table_from_config(self, config: TableConfig) -> bool:
        """Create a table from its config on every server; True if any server created it."""
        shards_of_server(0, self.num_servers, config.num_shards)  # ConfigError: too few shards
        request = ps_pb2.CreateTableRequest(config_json=json.dumps(config_to_dict(config)))
        replies = self._all("CreateTable", request, idempotent=True)
        self._configs[config.name] = config
        return any(r.created for r in replies)

    def table_config(self, table: str) -> TableConfig:
        """The config of ``table`` (cached; asked of server 0 the first time)."""
        config = self._configs.get(table)
        if config is not None:
            return config
        (reply,) = self._invoke([_Call(0, "ListTables", ps_pb2.ListTablesRequest())], True)
        configs = [config_from_dict(json.loads(c)) for c in reply.config_json]
        self._configs.update({c.name: c for c in configs})
        if table not in self._configs:
            raise PSNotFoundError(
                "table lookup",
                self.endpoints[0],
                grpc.StatusCode.NOT_FOUND,
                f"table {table!r} does not exist; tables: {sorted(c.name for c in configs)}",
            )
        return self._configs[table]

    def _config(self, table: str, kind: type) -> Any:
        config = self.table_config(table)
        if not isinstance(config, kind):
            other = "dense" if isinstance(config, DenseTableConfig) else "sparse"
            raise TableInputError(
                table, "table", f"is a {other} table; this call needs the other kind"
            )
        return config

    # -- sparse -----------------------------------------------------------------------------
    def _route(self, keys: np.ndarray, num_shards: int) -> list[np.ndarray | None]:
        """Positions of ``keys`` per server (None: all of them, one server)."""
        if self.num_servers == 1:
            return [None]
        return list(group_by_server(keys, self.num_servers, num_shards))

    def _chunks(self, keys: np.ndarray, row_bytes: int, keep_keys_together: bool) -> list[Any]:
        """Slices (or position arrays) of ``keys`` that each fit one message."""
        per = max(1, self._payload_bytes // row_bytes)
        n = keys.shape[0]
        if n <= per:
            return [slice(0, n)]
        if not keep_keys_together:
            return [slice(s, min(s + per, n)) for s in range(0, n, per)]
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        out, start = [], 0
        while start < n:
            stop = min(start + per, n)
            if stop < n:  # move the cut back to the start of the key run it falls in
                run_start = int(np.searchsorted(sorted_keys, sorted_keys[stop], "left"))
                stop = (
                    run_start
                    if run_start > start
                    else int(np.searchsorted(sorted_keys, sorted_keys[stop], "right"))
                )
            out.append(order[start:stop])
            start = stop
        return out

    def pull_sparse(self, table: str, keys: Any) -> np.ndarray:
        """float32[len(keys), dim]: the rows of ``keys`` (any order, duplicates allowed)."""
        config: SparseTableConfig = self._config(table, SparseTableConfig)
        keys = as_keys(table, keys)
        out = np.empty((keys.shape[0], config.dim), dtype=np.float32)
        calls, targets = [], []
        for server, pos in enumerate(self._route(keys, config.num_shards)):
            skeys = keys if pos is None else keys[pos]
            if skeys.shape[0] == 0:
                continue
            for part in self._chunks(skeys, config.dim * VALUE_BYTES + KEY_BYTES, False):
                request = _PULL_SPARSE_REQUEST.encode(
                    {"table": table, "keys": _le(skeys[part], KEY_DTYPE)}
                )
                calls.append(_Call(server, "PullSparse", request))
                targets.append(part if pos is None else pos[part])
        for target, reply in zip(targets, self._invoke(calls, idempotent=True)):
            n = target.stop - target.start if isinstance(target, slice) else target.shape[0]
            out[target] = decode_rows(table, reply.values, n, config.dim, "values (reply)")
        return out

    def push_sparse(
        self,
        table: str,
        keys: Any,
        grads: Any,
        mode: str = "apply",
        sync_count: int | None = None,
    ) -> dict[str, int]:
        """Push ``grads`` float32[len(keys), dim] for ``keys``; returns the summed push stats.

        ``mode``: ``"apply"`` (optimizer now), ``"sync"`` (with ``sync_count=W``: each server
        applies the mean of the W pushes of a round once; every server gets a request, empty if
        it has no keys, so its count reaches W — see :mod:`ps_server.sync`) or ``"delta"`` (GEO:
        add to the rows). Not retried (see the module docstring).
        """
        if mode not in _MODES:
            raise ConfigError(f"must be one of {sorted(_MODES)}, got {mode!r}", key="mode")
        sync = mode == "sync"
        if sync and (not isinstance(sync_count, int) or sync_count < 1):
            raise ConfigError(
                f"mode='sync' needs sync_count = the number of trainers (>= 1), got {sync_count!r}",
                key="sync_count",
            )
        if not sync and sync_count is not None:
            raise ConfigError(f"is only for mode='sync' (mode is {mode!r})", key="sync_count")
        config: SparseTableConfig = self._config(table, SparseTableConfig)
        keys = as_keys(table, keys)
        grads = as_rows(table, grads, keys.shape[0], config.dim)
        row_bytes = config.dim * VALUE_BYTES + KEY_BYTES
        first, last = [], []  # SYNC: every part but a server's last goes first
        for server, pos in enumerate(self._route(keys, config.num_shards)):
            skeys = keys if pos is None else keys[pos]
            sgrads = grads if pos is None else grads[pos]
            if skeys.shape[0] == 0 and not sync:
                continue
            parts = self._chunks(skeys, row_bytes, keep_keys_together=mode == "apply")
            for i, part in enumerate(parts):
                more = sync and i < len(parts) - 1
                request = _PUSH_SPARSE_REQUEST.encode(
                    {
                        "table": table,
                        "keys": _le(skeys[part], KEY_DTYPE),
                        "grads": _le(sgrads[part], VALUE_DTYPE),
                        "mode": _MODES[mode],
                        "sync_count": sync_count or 0,
                        "more_parts": more,
                    }
                )
                (first if more else last).append(_Call(server, "PushSparse", request))
        replies = self._invoke(first, idempotent=False) if first else []
        replies += self._invoke(last, idempotent=False)
        fields = ("num_keys", "applied", "created", "filtered", "skipped_nonfinite", "evicted")
        return {f: int(sum(getattr(r, f) for r in replies)) for f in fields}

    def shrink(self, table: str, unseen_days: int) -> int:
        """Delete rows unseen for more than ``unseen_days`` days on every server; rows removed."""
        self._config(table, SparseTableConfig)
        request = ps_pb2.ShrinkRequest(table=table, unseen_days=unseen_days)
        return sum(int(r.removed) for r in self._all("Shrink", request, idempotent=False))

    def end_day(self) -> None:
        """Close a day on every table of every server."""
        self._all("EndDay", ps_pb2.EndDayRequest(), idempotent=False)

    # -- dense ------------------------------------------------------------------------------
    def _dense_server(self, table: str, name: str) -> int:
        config: DenseTableConfig = self._config(table, DenseTableConfig)
        return block_shard(name, config.num_shards) % self.num_servers

    def _upload(self, server: int, method: str, values: np.ndarray, make: Any, idem: bool) -> Any:
        """Send a flat block in one request or in parts; returns the reply to the last part."""
        per = max(1, self._payload_bytes // VALUE_BYTES)
        total = values.shape[0]
        if total <= per:
            return self._invoke([_Call(server, method, make(values, None))], idem)[0]
        upload_id = uuid.uuid4().hex
        calls = [
            _Call(
                server,
                method,
                make(
                    values[s : s + per],
                    ps_pb2.DenseUpload(
                        upload_id=upload_id, offset=s, total=total, more_parts=s + per < total
                    ),
                ),
            )
            for s in range(0, total, per)
        ]
        self._invoke(calls[:-1], idem)
        return self._invoke(calls[-1:], idem)[0]

    def init_dense(self, table: str, name: str, values: Any) -> bool:
        """Create block ``name`` of dense ``table`` with ``values`` (stored flat); True if
        created, False if it already held exactly these values."""
        server = self._dense_server(table, name)
        flat = as_flat_values(table, values, "values")

        def make(part: np.ndarray, upload: Any) -> Message:
            return ps_pb2.InitDenseRequest(
                table=table, name=name, values=encode_values(part), upload=upload
            )

        return bool(self._upload(server, "InitDense", flat, make, True).created)

    def pull_dense(self, table: str, name: str) -> np.ndarray:
        """float32[numel]: the values of block ``name`` (flat; the caller keeps the shape)."""
        server = self._dense_server(table, name)
        per = max(1, self._payload_bytes // VALUE_BYTES)

        def call(offset: int) -> _Call:
            request = ps_pb2.PullDenseRequest(table=table, name=name, offset=offset, count=per)
            return _Call(server, "PullDense", request)

        (head,) = self._invoke([call(0)], idempotent=True)
        replies = [head] + self._invoke(
            [call(o) for o in range(per, int(head.total), per)], idempotent=True
        )
        return np.concatenate([decode_values(table, r.values, "values (reply)") for r in replies])

    def push_dense(
        self,
        table: str,
        name: str,
        grad: Any,
        mode: str = "apply",
        sync_count: int | None = None,
    ) -> bool:
        """Push a gradient (or GEO delta) of block ``name``; modes as :meth:`push_sparse`.
        Returns whether it was applied (False: accumulated in a SYNC round, or skipped)."""
        if mode not in _MODES:
            raise ConfigError(f"must be one of {sorted(_MODES)}, got {mode!r}", key="mode")
        if mode == "sync" and (not isinstance(sync_count, int) or sync_count < 1):
            raise ConfigError(
                f"mode='sync' needs sync_count >= 1, got {sync_count!r}", key="sync_count"
            )
        if mode != "sync" and sync_count is not None:
            raise ConfigError(f"is only for mode='sync' (mode is {mode!r})", key="sync_count")
        server = self._dense_server(table, name)
        flat = as_flat_values(table, grad, "grad")

        def make(part: np.ndarray, upload: Any) -> Message:
            return ps_pb2.PushDenseRequest(
                table=table,
                name=name,
                grad=encode_values(part),
                mode=_MODES[mode],
                sync_count=sync_count or 0,
                upload=upload,
            )

        return bool(self._upload(server, "PushDense", flat, make, False).applied)

    # -- checkpoints, coordination, admin ---------------------------------------------------
    def save(self, directory: str, mode: str = "all") -> list[dict[str, Any]]:
        """Every server saves its shards into ``directory`` (a path on the servers' file system,
        shared by all of them); returns each server's manifest."""
        if mode not in ("all", "delta"):
            raise ConfigError(f"must be 'all' or 'delta', got {mode!r}", key="mode")
        replies = self._all("Save", ps_pb2.SaveRequest(dir=str(directory), mode=mode), False)
        return [json.loads(r.manifest_json) for r in replies]

    def load(self, directory: str) -> dict[str, int]:
        """Every server loads the shards it owns from ``directory`` (saved by any number of
        servers); tables the servers lack are created. Returns rows read per table."""
        replies = self._all("Load", ps_pb2.LoadRequest(dir=str(directory)), idempotent=False)
        self._configs.clear()
        rows: dict[str, int] = {}
        for reply in replies:
            for table, n in reply.rows.items():
                rows[table] = rows.get(table, 0) + int(n)
        return rows

    def barrier(self, name: str, count: int, timeout_s: float | None = None) -> int:
        """Block until ``count`` callers reached barrier ``name`` (held by server 0); returns
        its generation. PSDeadlineExceededError names how many arrived."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        request = ps_pb2.BarrierRequest(name=name, count=count, timeout_s=timeout)
        (reply,) = self._invoke([_Call(0, "Barrier", request)], False, timeout_s=timeout + 10.0)
        return int(reply.generation)

    def stats(self) -> list[dict[str, Any]]:
        """Each server's sizes and counters (tables, requests per RPC, errors per status)."""
        replies = self._all("Stats", ps_pb2.StatsRequest(), idempotent=True)
        return [json.loads(r.stats_json) for r in replies]

    def stop_servers(self) -> None:
        """Ask every server to stop (each replies, then shuts down gracefully)."""
        self._all("Stop", ps_pb2.StopRequest(), idempotent=False)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until every server answers its health check with SERVING."""
        deadline = time.monotonic() + timeout_s
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        for server, stub in enumerate(self._health):
            while True:
                remaining = deadline - time.monotonic()
                status, err = None, None
                if remaining > 0:
                    try:
                        reply = stub.Check(request, timeout=remaining, wait_for_ready=True)
                        status = reply.status
                    except grpc.RpcError as exc:
                        err = exc
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                if time.monotonic() >= deadline:
                    raise PSDeadlineExceededError(
                        "health check",
                        self.endpoints[server],
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"not serving after {timeout_s:g}s (last: "
                        f"{err.code().name if err is not None else status}); servers not "
                        f"checked yet: {list(self.endpoints[server + 1 :])}",
                    )
                time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))

    def close(self) -> None:
        """Close the channels and the call pool."""
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> PSClient:  # noqa: PYI034 - py3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["RETRYABLE", "PSClient"]
