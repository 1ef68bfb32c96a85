"""A trainer's async step in one call: :meth:`ps_server.client.PSClient.push_step`.

An async trainer's step sends its sparse gradients (one push per table) and its dense block's
gradient, whose reply brings the block's values back: two calls (PushSparse, PushDense with
``return_values``) when sent apart. :func:`push_step` sends them as one PushStep call, a gRPC
call's fixed cost (~0.8 ms of server CPU on a 2-core machine, more than a small push's
handler) saved per step. The server applies the parts in order, exactly as the separate calls.

One call when everything goes to one server: a one-server job, every push whole (through its
shared-memory segment, or small enough to share one message with the others) and APPLY mode.
Otherwise, and against a server that does not know PushStep (UNIMPLEMENTED: an older server;
remembered for the client's life), the same pushes go as separate calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from ps_server.config import SparseTableConfig
from ps_server.rpc.codec import (
    KEY_BYTES,
    KEY_DTYPE,
    VALUE_BYTES,
    VALUE_DTYPE,
    as_flat_values,
    as_keys,
    as_rows,
    decode_values,
    encode_values,
)
from ps_server.rpc.proto import ps_pb2
from ps_server.rpc.rpc_client import Call
from ps_server.rpc.status import PSFailedPreconditionError, PSRpcError

SparsePush = tuple[str, Any, Any]
"""(table, keys, grads) of one sparse push."""
DensePush = tuple[str, str, Any]
"""(table, block name, flat gradient) of the dense push."""
_FIELDS = ("num_keys", "applied", "created", "filtered", "skipped_nonfinite", "evicted")


def push_step(
    client: Any, sparse: Sequence[SparsePush], dense: DensePush | None
) -> tuple[list[dict[str, int]], np.ndarray | None]:
    """APPLY the sparse pushes, in order, then the dense push; returns each sparse push's stats
    (as :meth:`PSClient.push_sparse`) and the dense block's values after the push (None
    without a dense push). One PushStep call when it can (module docstring), else separate
    calls with the same effect."""
    if client.num_servers != 1 or client.push_step_unsupported:
        return _separate(client, sparse, dense)
    parts: list[tuple[bool, int, ps_pb2.PushSparseRequest]] = []  # (tcp, position, request)
    segs: list[Any] = []
    budget = client._payload_bytes
    try:
        for position, (table, keys, grads) in enumerate(sparse):
            config: SparseTableConfig = client._config(table, SparseTableConfig)
            keys = as_keys(table, keys)
            grads = as_rows(table, grads, keys.shape[0], config.dim)
            n = keys.shape[0]
            if n == 0:
                continue  # nothing to push (as push_sparse: no request)
            seg = client._lease(0, n, config.dim)
            if seg is not None:
                segs.append(seg)
                k, g = seg.views(n, config.dim)
                k[...], g[...] = keys, grads
                request = ps_pb2.PushSparseRequest(
                    table=table, mode=ps_pb2.PUSH_MODE_APPLY, shm_segment=seg.name, shm_num_keys=n
                )
                parts.append((False, position, request))
                continue
            budget -= n * (config.dim * VALUE_BYTES + KEY_BYTES)
            if budget < 0:
                client._release(segs, None)
                return _separate(client, sparse, dense)
            request = ps_pb2.PushSparseRequest(
                table=table,
                mode=ps_pb2.PUSH_MODE_APPLY,
                keys=np.ascontiguousarray(keys, KEY_DTYPE).tobytes(),
                grads=np.ascontiguousarray(grads, VALUE_DTYPE).tobytes(),
            )
            parts.append((True, position, request))
        step = ps_pb2.PushStepRequest()
        # the shared-memory parts first: a server that lost its segments (restarted) refuses
        # the first part, before anything is applied, and the step goes again as separate calls
        parts.sort(key=lambda p: (p[0], p[1]))
        step.sparse.extend(p[2] for p in parts)
        if dense is not None:
            table, name, grad = dense
            flat = as_flat_values(table, grad, "grad")
            if client._dense_server(table, name) != 0 or flat.nbytes > budget:
                client._release(segs, None)
                return _separate(client, sparse, dense)
            step.dense.CopyFrom(
                ps_pb2.PushDenseRequest(
                    table=table,
                    name=name,
                    grad=encode_values(flat),
                    mode=ps_pb2.PUSH_MODE_APPLY,
                    return_values=True,
                )
            )
        (reply,) = client._invoke([Call(0, "PushStep", step)], idempotent=False, reconnect=True)
    except PSRpcError as err:
        client._release(segs, err)
        if err.code is grpc.StatusCode.UNIMPLEMENTED:
            client.push_step_unsupported = True  # an older server: separate calls from now on
            return _separate(client, sparse, dense)
        if isinstance(err, PSFailedPreconditionError) and "shm:" in err.details:
            return _separate(client, sparse, dense)
        raise
    except BaseException:
        client._release(segs, None)
        raise
    client._release(segs, None)
    stats = [dict.fromkeys(_FIELDS, 0) for _ in sparse]
    for (_, position, _), part in zip(parts, reply.sparse, strict=True):
        stats[position] = {f: int(getattr(part, f)) for f in _FIELDS}
    if dense is None:
        return stats, None
    if not reply.dense.has_values:
        return stats, client.pull_dense(dense[0], dense[1])
    return stats, decode_values(dense[0], reply.dense.values, "values (reply)")


def _separate(
    client: Any, sparse: Sequence[SparsePush], dense: DensePush | None
) -> tuple[list[dict[str, int]], np.ndarray | None]:
    """The same pushes as separate PushSparse / PushDense calls."""
    stats = [
        client.push_sparse(table, keys, grads, mode="apply")
        if len(keys)
        else dict.fromkeys(_FIELDS, 0)
        for table, keys, grads in sparse
    ]
    if dense is None:
        return stats, None
    return stats, client.push_pull_dense(dense[0], dense[1], dense[2], mode="apply")


__all__ = ["DensePush", "SparsePush", "push_step"]
