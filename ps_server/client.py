"""The parameter-server client: :class:`PSClient` (usable without fleet).

One gRPC channel per server. A sparse call routes keys with
:func:`ps_server.core.routing.group_by_server`, sends one request per server (several when a
request would exceed the max message size), all at once as gRPC futures, and scatters the replies
back into the caller's key order (duplicates allowed). Dense blocks live on the server of
``block_shard(name) % num_servers``; a block larger than one message is uploaded in parts (one
``upload_id``; the server acts on the last part) and pulled in ranges.

Transport, retries, deadlines and the same-host shared-memory path are
:class:`~ps_server.rpc.rpc_client.RpcClient`'s (its module docstring says which calls are retried);
job checkpoints (``checkpoint``, ``begin_checkpoint``, ``load_latest``, ``list_checkpoints``) and
serving exports (``export_serving``) are :class:`~ps_server.rpc.checkpoint_client.CheckpointCalls`'.

Errors: a failed call raises a :class:`ps_server.rpc.status.PSRpcError` subclass naming the method,
the server endpoint, the status code and the server's message; local argument checks raise
:class:`~ps_server.errors.TableInputError` / :class:`~collective.errors.ConfigError` before any
request is sent.

A split APPLY push keeps every occurrence of a key in the same request (keys are sorted first),
so the optimizer rule still sees each key once per push. A dense block pulled in ranges while
another client pushes to it may mix values from before and after that push.
"""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import Message

from collective.errors import ConfigError
from ps_server.config import (
    DenseTableConfig,
    SparseTableConfig,
    TableConfig,
    config_from_dict,
    config_to_dict,
)
from ps_server.core.batch_ops import put_rows, take_rows
from ps_server.core.entry import EntryPolicy
from ps_server.core.initializers import Initializer, Uniform
from ps_server.core.optimizers import SGD, OptimizerRule
from ps_server.core.routing import block_shard, shards_of_server, split_by_server
from ps_server.errors import TableInputError
from ps_server.rpc.checkpoint_client import CheckpointCalls
from ps_server.rpc.codec import (
    KEY_BYTES,
    KEY_DTYPE,
    VALUE_BYTES,
    VALUE_DTYPE,
    as_flat_values,
    as_keys,
    as_rows,
    as_shows,
    decode_rows,
    decode_values,
    encode_values,
)
from ps_server.rpc.proto import ps_pb2
from ps_server.rpc.rpc_client import RETRYABLE, Call
from ps_server.rpc.shm import blocks
from ps_server.rpc.status import PSFailedPreconditionError, PSNotFoundError, PSRpcError
from ps_server.rpc.step_client import DensePush, SparsePush, push_step
from ps_server.rpc.wire import wire_message

logger = logging.getLogger(__name__)

DEFAULT_OPTIMIZER = SGD(0.01)
"""Default server-side rule of tables created through the client (immutable)."""
DEFAULT_INITIALIZER = Uniform(-0.01, 0.01)
"""Default initializer of sparse tables created through the client (immutable)."""
_MODES = {
    "apply": ps_pb2.PUSH_MODE_APPLY,
    "sync": ps_pb2.PUSH_MODE_SYNC,
    "delta": ps_pb2.PUSH_MODE_DELTA,
}
_PULL_SPARSE_REQUEST = wire_message(ps_pb2.PullSparseRequest)
_PUSH_SPARSE_REQUEST = wire_message(ps_pb2.PushSparseRequest)


ROUTE_CACHE_MIN_KEYS = 4096
"""Routings of at least this many keys are remembered for the next call (PSClient._route)."""


def _le(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` as a C-contiguous little-endian array (no copy when it already is one)."""
    return np.ascontiguousarray(values, dtype=dtype)


class PSClient(CheckpointCalls):
    """Client of the servers at ``endpoints`` (``["host:port", ...]`` or ``"h:p,h:p"``), in
    server-index order; the keyword arguments are :class:`~ps_server.rpc.rpc_client.RpcClient`'s
    (``timeout_s``, ``retries``, ``max_message_mb``, ``backoff_s``, ``shm``, ``shm_max_mb``,
    ``token`` — the job's token, default FLEET_PS_TOKEN — ``tls_ca``, ``tls_cert``,
    ``tls_key``, ``tls_server_name``, and ``reconnect_s``: how long idempotent calls wait for a
    server that is UNAVAILABLE, e.g. restarting, default FLEET_PS_RECONNECT_S)."""

    def __init__(self, endpoints: Sequence[str] | str, **options: Any) -> None:
        super().__init__(endpoints, **options)
        self._configs: dict[str, TableConfig] = {}
        self._last_route: tuple[int, np.ndarray, list[Any]] | None = None
        self.push_step_unsupported = False
        """A server answered PushStep with UNIMPLEMENTED (older): :meth:`push_step` sends
        separate calls."""

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
        (reply,) = self._invoke([Call(0, "ListTables", ps_pb2.ListTablesRequest())], True)
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
    def _route(
        self, keys: np.ndarray, num_shards: int
    ) -> list[tuple[np.ndarray | None, np.ndarray]]:
        """(positions, keys) per server (positions None: all of them, one server).

        The last large routing is remembered (a push usually carries the keys just pulled:
        comparing them costs ~1/15 of routing them again); the arrays are only read."""
        if self.num_servers == 1:
            return [(None, keys)]
        last = self._last_route
        if (
            last is not None
            and last[0] == num_shards
            and last[1].shape == keys.shape
            and np.array_equal(last[1], keys)
        ):
            return last[2]
        routed = list(zip(*split_by_server(keys, self.num_servers, num_shards), strict=True))
        if keys.shape[0] >= ROUTE_CACHE_MIN_KEYS:
            self._last_route = (num_shards, keys.copy(), routed)
        return routed

    def pull_sparse(self, table: str, keys: Any) -> np.ndarray:
        """float32[len(keys), dim]: the rows of ``keys`` (any order, duplicates allowed)."""
        return self._pull_sparse(table, keys, retry=True, with_state=False)[0]

    def pull_sparse_with_state(self, table: str, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """(float32[len(keys), dim] rows, float32[len(keys), state_dim] their optimizer state)
        of ``keys``, each server's part read under one lock: what a pass cache seeds its local
        rows with, so the rule (Adagrad's accumulators, Adam's moments and step) continues
        across passes."""
        values, state = self._pull_sparse(table, keys, retry=True, with_state=True)
        assert state is not None
        return values, state

    def _pull_sparse(
        self, table: str, keys: Any, retry: bool, with_state: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        config: SparseTableConfig = self._config(table, SparseTableConfig)
        keys = as_keys(table, keys)
        dim = config.dim
        sdim = config.optimizer.state_dim(dim) if with_state else 0
        out = np.empty((keys.shape[0], dim), dtype=np.float32)
        state = np.empty((keys.shape[0], sdim), dtype=np.float32) if with_state else None
        flag = {"with_state": True} if with_state else {}
        calls, targets, segs = [], [], []
        for server, (pos, skeys) in enumerate(self._route(keys, config.num_shards)):
            n = skeys.shape[0]
            if n == 0:
                continue
            seg = self._lease(server, n, dim + sdim)  # with state: values, then state
            if seg is not None:
                seg.views(n, dim + sdim)[0][...] = skeys
                fields: dict[str, Any] = {
                    "table": table,
                    "shm_segment": seg.name,
                    "shm_num_keys": n,
                    **flag,
                }
                parts: list[Any] = [slice(0, n)]
            else:
                parts = self._chunks(skeys, (dim + sdim) * VALUE_BYTES + KEY_BYTES, False)
            for part in parts:
                if seg is None:
                    fields = {"table": table, "keys": _le(skeys[part], KEY_DTYPE), **flag}
                calls.append(Call(server, "PullSparse", _PULL_SPARSE_REQUEST.encode(fields)))
                targets.append(part if pos is None else pos[part])
                segs.append(seg)
        try:
            replies = self._invoke(calls, idempotent=True)
            for target, reply, seg in zip(targets, replies, segs):
                n = target.stop - target.start if isinstance(target, slice) else target.shape[0]
                if seg is not None:
                    rows, rows_state = blocks(seg.views(n, dim + sdim)[1], (dim, sdim))
                else:
                    rows = decode_rows(table, reply.values, n, dim, "values (reply)")
                    rows_state = decode_rows(
                        table, reply.state, n, sdim, "state (reply)", "state_dim"
                    )
                put_rows(out, target, rows)
                if state is not None:
                    put_rows(state, target, rows_state)
        except PSRpcError as err:
            if self._release(segs, err) and retry:  # a server lost its segment: once more
                return self._pull_sparse(table, keys, False, with_state)
            raise
        except BaseException:
            self._release(segs, None)
            raise
        self._release(segs, None)
        return out, state

    def push_sparse(
        self,
        table: str,
        keys: Any,
        grads: Any,
        mode: str = "apply",
        sync_count: int | None = None,
        shows: Any = None,
        state_deltas: Any = None,
    ) -> dict[str, int]:
        """Push ``grads`` float32[len(keys), dim] for ``keys``; returns the summed push stats.

        ``mode``: ``"apply"`` (optimizer now), ``"sync"`` (with ``sync_count=W``: each server
        applies the mean of the W pushes of a round once; every server gets a request, empty if
        it has no keys, so its count reaches W — see :mod:`ps_server.rpc.sync`) or ``"delta"`` (GEO:
        add to the rows). ``shows`` (``"delta"`` only): the show count each key adds to its row
        (integers >= 0, one per key; default one per occurrence of the key), as a pass cache
        reports its examples' occurrences. ``state_deltas`` (``"delta"`` only):
        float32[len(keys), state_dim] changes of the rows' optimizer state, merged by the rule
        (a pass cache's state at the pass's end minus what it pulled). Not retried (see the
        module docstring).
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
        for name, given in (("shows", shows), ("state_deltas", state_deltas)):
            if given is not None and mode != "delta":
                raise ConfigError(f"is only for mode='delta' (mode is {mode!r})", key=name)
        extra = (shows, state_deltas)
        stats, lost = self._push_sparse(table, keys, grads, mode, sync_count, None, extra)
        if lost:  # restarted servers refused segments they no longer know, unread: once more
            again, _ = self._push_sparse(table, keys, grads, mode, sync_count, lost, extra)
            stats = {f: stats[f] + again[f] for f in stats}
        return stats

    def _push_sparse(
        self,
        table: str,
        keys: Any,
        grads: Any,
        mode: str,
        sync_count: int | None,
        only: set[int] | None,
        extra: tuple[Any, Any] = (None, None),
    ) -> tuple[dict[str, int], set[int]]:
        """The push to every server (``only``: to these); ``extra``: (shows, state_deltas) of a
        delta push. Returns the summed stats and, for an APPLY/GEO push, the servers that
        refused its shared-memory segment unread (lost it in a restart; the caller sends their
        part again)."""
        sync = mode == "sync"
        config: SparseTableConfig = self._config(table, SparseTableConfig)
        keys = as_keys(table, keys)
        grads = as_rows(table, grads, keys.shape[0], config.dim)
        shows, state_deltas = extra
        counts = None if shows is None else as_shows(table, shows, keys.shape[0])
        row_bytes = config.dim * VALUE_BYTES + KEY_BYTES + (0 if counts is None else 4)
        moved = None
        if state_deltas is not None:
            sdim = config.optimizer.state_dim(config.dim)
            moved = as_rows(table, state_deltas, keys.shape[0], sdim, "state_deltas")
            row_bytes += sdim * VALUE_BYTES
        first, last, segs = [], [], []  # SYNC: every part but a server's last goes first
        common = {"mode": _MODES[mode], "sync_count": sync_count or 0, "table": table}
        for server, (pos, skeys) in enumerate(self._route(keys, config.num_shards)):
            sgrads = grads if pos is None else take_rows(grads, pos)
            scounts = counts if counts is None or pos is None else counts[pos]
            smoved = moved if moved is None or pos is None else take_rows(moved, pos)
            n = skeys.shape[0]
            if (n == 0 and not sync) or (only is not None and server not in only):
                continue
            width = config.dim + (0 if smoved is None else smoved.shape[1])
            seg = self._lease(server, n, width)
            if seg is not None:  # with state deltas: the deltas, then the state deltas
                k, rows = seg.views(n, width)
                k[...] = skeys
                if smoved is None:
                    rows[...] = sgrads
                else:
                    g, m = blocks(rows, (config.dim, smoved.shape[1]))
                    g[...], m[...] = sgrads, smoved
                request = _PUSH_SPARSE_REQUEST.encode(
                    {
                        **common,
                        "shm_segment": seg.name,
                        "shm_num_keys": n,
                        "with_state": smoved is not None,
                        **({} if scounts is None else {"shows": scounts.tobytes()}),
                    }
                )
                last.append(Call(server, "PushSparse", request))
                segs.append(seg)
                continue
            parts = self._chunks(skeys, row_bytes, keep_keys_together=mode == "apply")
            for i, part in enumerate(parts):
                more = sync and i < len(parts) - 1
                request = _PUSH_SPARSE_REQUEST.encode(
                    {
                        **common,
                        "keys": _le(skeys[part], KEY_DTYPE),
                        "grads": _le(take_rows(sgrads, part), VALUE_DTYPE),
                        "more_parts": more,
                        **({} if scounts is None else {"shows": scounts[part].tobytes()}),
                        **(
                            {}
                            if smoved is None
                            else {"state_deltas": _le(take_rows(smoved, part), VALUE_DTYPE)}
                        ),
                    }
                )
                (first if more else last).append(Call(server, "PushSparse", request))
        lost: set[int] = set()
        try:
            replies = self._invoke(first, idempotent=False) if first else []
            if sync:
                replies += self._invoke(last, idempotent=False)
            else:
                done = self._invoke(last, idempotent=False, reconnect=True, keep_errors=True)
                for call, reply in zip(last, done):
                    if (
                        isinstance(reply, PSFailedPreconditionError)
                        and "shm:" in reply.details
                        and only is None
                    ):
                        lost.add(call.server)
                    elif isinstance(reply, BaseException):
                        raise reply
                    else:
                        replies.append(reply)
        finally:
            if segs:
                self._release(segs, sys.exc_info()[1])
        if lost and self._shm is not None:
            for server in lost:
                self._shm.forget_server(server)
        fields = ("num_keys", "applied", "created", "filtered", "skipped_nonfinite", "evicted")
        return {f: int(sum(getattr(r, f) for r in replies)) for f in fields}, lost

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

    def _upload(
        self,
        server: int,
        method: str,
        values: np.ndarray,
        make: Any,
        idem: bool,
        reconnect: bool = False,
    ) -> Any:
        """Send a flat block in one request or in parts; returns the reply to the last part
        (``reconnect``: a one-part block is sent again while its server is UNAVAILABLE)."""
        per = max(1, self._payload_bytes // VALUE_BYTES)
        total = values.shape[0]
        if total <= per:
            return self._invoke(
                [Call(server, method, make(values, None))], idem, reconnect=reconnect
            )[0]
        upload_id = uuid.uuid4().hex
        calls = [
            Call(
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

        def call(offset: int) -> Call:
            request = ps_pb2.PullDenseRequest(table=table, name=name, offset=offset, count=per)
            return Call(server, "PullDense", request)

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
        return bool(self._push_dense(table, name, grad, mode, sync_count, False).applied)

    def push_pull_dense(self, table: str, name: str, grad: Any, mode: str = "apply") -> np.ndarray:
        """Push a gradient (``mode="apply"``) or GEO delta (``"delta"``) of block ``name`` and
        return float32[numel]: the block's values after it, as :meth:`push_dense` then
        :meth:`pull_dense` do, in one call when the block fits one request (else, or from a
        server that does not answer with values, the pull follows)."""
        if mode not in ("apply", "delta"):
            raise ConfigError(f"must be 'apply' or 'delta', got {mode!r}", key="mode")
        reply = self._push_dense(table, name, grad, mode, None, True)
        if not reply.has_values:
            return self.pull_dense(table, name)
        return decode_values(table, reply.values, "values (reply)")

    def push_step(
        self, sparse: Sequence[SparsePush], dense: DensePush | None = None
    ) -> tuple[list[dict[str, int]], np.ndarray | None]:
        """An async step: APPLY ``sparse`` ((table, keys, grads) each, in order), then the
        dense push ``dense`` ((table, block, grad)); each sparse push's stats and the block's
        values after the push (None without one). One PushStep call on a one-server job, else
        separate calls (:mod:`ps_server.rpc.step_client`)."""
        return push_step(self, sparse, dense)

    def _push_dense(
        self,
        table: str,
        name: str,
        grad: Any,
        mode: str,
        sync_count: int | None,
        return_values: bool,
    ) -> Any:
        """The PushDense call(s) of a block; the reply to the last part."""
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
                return_values=return_values and upload is None,
            )

        return self._upload(server, "PushDense", flat, make, False, mode != "sync")

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
        (reply,) = self._invoke([Call(0, "Barrier", request)], False, timeout_s=timeout + 10.0)
        return int(reply.generation)

    def stats(self) -> list[dict[str, Any]]:
        """Each server's sizes and counters (tables, requests per RPC, errors per status)."""
        replies = self._all("Stats", ps_pb2.StatsRequest(), idempotent=True)
        return [json.loads(r.stats_json) for r in replies]

    def stop_servers(self) -> None:
        """Ask every server to stop (each replies, then shuts down gracefully)."""
        self._all("Stop", ps_pb2.StopRequest(), idempotent=False)


__all__ = ["RETRYABLE", "PSClient"]
