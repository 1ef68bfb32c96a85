"""Server-side coordination state: SYNC push rounds, named barriers, staged dense uploads.

Pure Python + numpy (no gRPC): the service module calls these, tests can drive them directly.

**SYNC rounds** (:class:`SyncRounds`). Synchronous training averages the W trainers' step-t
gradients: every trainer pushes with ``mode=SYNC, sync_count=W`` (a trainer with no keys for a
server still sends it an empty push, so each server's count reaches W). A server keeps one open
round per sparse table (per dense block for dense tables): the first W-1 pushes are validated,
stored and answered at once; the W-th push takes the round's W contributions and applies their
MEAN (the sum of every contribution divided by W — a key pushed by one trainer only gets 1/W of
its gradient, as data-parallel averaging does) once, with the table's optimizer rule, and
returns after it was applied. A push split by the client into several requests carries
``more_parts=True`` on all but its last part; only the last part counts toward W. A push that is
rejected (bad shape, non-finite under ``reject``) is not counted. Trainers must not push step
t+1 before every trainer's step-t push returned — the trainers' barrier after the push gives
that, and also makes every trainer see the applied update in its next pull. If applying fails
(e.g. max_capacity), the W-th caller gets the error and the round is dropped. A Save holds
the applied state only: the contributions of a round still open are not in the checkpoint.

**Barriers** (:class:`Barriers`). ``wait(name, count, timeout)`` blocks until ``count`` callers
of ``name`` arrived, then all return the barrier's new generation; the name is reusable for the
next generation right away. A caller that times out (or whose RPC was cancelled) withdraws.

**Dense uploads** (:class:`DenseUploads`). A dense block larger than one message arrives in
parts with one ``upload_id``; the parts are staged and the block is handed over on the last.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collective.errors import ConfigError
from ps_server.errors import TableInputError
from ps_server.rpc.status import BarrierTimeoutError, ServerStoppingError

logger = logging.getLogger(__name__)

UPLOAD_TTL_S = 600.0
"""A staged dense upload whose last part has not arrived after this long is dropped."""
MAX_UPLOAD_ELEMENTS = 2**32
"""Largest dense block (elements) accepted in parts."""


@dataclass
class _Round:
    count: int
    arrived: int = 0
    parts: list[Any] = field(default_factory=list)


class SyncRounds:
    """Open SYNC rounds, one per key (a table name, or ``(table, block)``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rounds: dict[Hashable, _Round] = {}

    def add(
        self, table: str, key: Hashable, sync_count: int, part: Any, final: bool
    ) -> tuple[int, list[Any] | None]:
        """Store one contribution; returns (pushes arrived, the round's parts if this push
        completed it — the caller applies them — else None)."""
        if not isinstance(sync_count, int) or sync_count < 1:
            raise TableInputError(
                table,
                "sync_count",
                f"mode SYNC needs sync_count >= 1 (W trainers), got {sync_count!r}",
            )
        with self._lock:
            rnd = self._rounds.get(key)
            if rnd is None:
                rnd = self._rounds[key] = _Round(sync_count)
            elif rnd.count != sync_count:
                raise TableInputError(
                    table,
                    "sync_count",
                    f"a SYNC round of {rnd.count} pushes is open ({rnd.arrived} arrived), this "
                    f"push says sync_count={sync_count}; every trainer must push with the same W",
                )
            rnd.parts.append(part)
            if final:
                rnd.arrived += 1
            if rnd.arrived < rnd.count:
                return rnd.arrived, None
            del self._rounds[key]
            return rnd.arrived, rnd.parts

    def pending(self) -> dict[str, dict[str, int]]:
        """Open rounds as plain data (``{"<key>": {"count": W, "arrived": k}}``)."""
        with self._lock:
            return {
                str(k): {"count": r.count, "arrived": r.arrived} for k, r in self._rounds.items()
            }


@dataclass
class _Barrier:
    count: int = 0
    arrived: int = 0
    generation: int = 0


class Barriers:
    """Named, reusable barriers (see the module docstring)."""

    POLL_S = 0.25
    """How often a waiter checks whether its RPC is still alive."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._barriers: dict[str, _Barrier] = {}
        self._stopping = False

    def wait(
        self,
        name: str,
        count: int,
        timeout_s: float,
        is_active: Callable[[], bool] = lambda: True,
    ) -> int:
        """Arrive at barrier ``name`` of ``count`` callers and wait up to ``timeout_s``; returns
        the generation that opened. BarrierTimeoutError / ServerStoppingError otherwise."""
        if not name:
            raise ConfigError("must be a non-empty string", key="barrier.name")
        if count < 1:
            raise ConfigError(f"must be >= 1, got {count}", key="barrier.count")
        if not timeout_s > 0:
            raise ConfigError(f"must be > 0 seconds, got {timeout_s}", key="barrier.timeout_s")
        with self._cond:
            if self._stopping:
                raise ServerStoppingError(f"barrier {name!r}: the server is stopping")
            b = self._barriers.setdefault(name, _Barrier())
            if b.arrived and b.count != count:
                raise ConfigError(
                    f"barrier {name!r} is waiting for {b.count} callers ({b.arrived} arrived), "
                    f"this caller says {count}; every caller must pass the same count",
                    key="barrier.count",
                )
            b.count = count
            b.arrived += 1
            generation = b.generation
            if b.arrived == count:
                b.generation += 1
                b.arrived = 0
                self._cond.notify_all()
                return b.generation
            deadline = time.monotonic() + timeout_s
            while b.generation == generation:
                remaining = deadline - time.monotonic()
                if self._stopping or remaining <= 0 or not is_active():
                    b.arrived -= 1
                    if self._stopping:
                        raise ServerStoppingError(
                            f"barrier {name!r}: the server is stopping ({b.arrived + 1} of "
                            f"{count} had arrived)"
                        )
                    raise BarrierTimeoutError(
                        f"barrier {name!r}: only {b.arrived + 1} of {count} callers arrived "
                        f"within {timeout_s:g}s"
                        + ("" if remaining <= 0 else " (this caller's RPC was cancelled)")
                        + "; a trainer is missing, slow or passed another count"
                    )
                self._cond.wait(min(remaining, self.POLL_S))
            return generation + 1

    def stop(self) -> None:
        """Release every waiter with ServerStoppingError; later waits fail at once."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Barriers as plain data."""
        with self._cond:
            return {
                n: {"count": b.count, "arrived": b.arrived, "generation": b.generation}
                for n, b in self._barriers.items()
            }


@dataclass
class _Upload:
    table: str
    name: str
    buf: np.ndarray
    parts: dict[int, int] = field(default_factory=dict)  # offset -> elements (a retry overwrites)
    started: float = field(default_factory=time.monotonic)


class DenseUploads:
    """Dense blocks arriving in parts (keyed by ``upload_id``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uploads: dict[str, _Upload] = {}

    def add_part(
        self,
        table: str,
        name: str,
        upload_id: str,
        offset: int,
        total: int,
        values: np.ndarray,
        more_parts: bool,
    ) -> np.ndarray | None:
        """Stage ``values`` at ``offset`` of a ``total``-element block; returns the whole block
        when this was the last part (every element received), else None."""
        if total > MAX_UPLOAD_ELEMENTS:
            raise TableInputError(
                table, "upload.total", f"{total} elements exceeds {MAX_UPLOAD_ELEMENTS}"
            )
        end = offset + values.shape[0]
        if end > total:
            raise TableInputError(
                table,
                "upload.offset",
                f"part [{offset}, {end}) of {name!r} is past the block's {total} elements",
            )
        now = time.monotonic()
        with self._lock:
            for uid in [u for u, up in self._uploads.items() if now - up.started > UPLOAD_TTL_S]:
                logger.warning(
                    "dropping the unfinished upload %s of %r", uid, self._uploads[uid].name
                )
                del self._uploads[uid]
            up = self._uploads.get(upload_id)
            if up is None:
                up = self._uploads[upload_id] = _Upload(table, name, np.empty(total, np.float32))
            elif (up.table, up.name, up.buf.shape[0]) != (table, name, total):
                raise TableInputError(
                    table,
                    "upload.upload_id",
                    f"upload {upload_id!r} belongs to {up.table}/{up.name} ({up.buf.shape[0]} "
                    f"elements), this part says {table}/{name} ({total})",
                )
            up.buf[offset:end] = values
            up.parts[offset] = values.shape[0]
            if more_parts:
                return None
            del self._uploads[upload_id]
        received = sum(up.parts.values())
        if received != total:
            raise TableInputError(
                table,
                "upload",
                f"the last part of {name!r} arrived with {received} of {total} elements "
                "received; the upload was dropped",
            )
        return up.buf

    def num_pending(self) -> int:
        """Uploads waiting for their last part."""
        with self._lock:
            return len(self._uploads)


__all__ = ["Barriers", "DenseUploads", "SyncRounds"]
