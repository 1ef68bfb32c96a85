"""The client side of job checkpoints and serving exports: :class:`CheckpointCalls`, mixed into
:class:`~ps_server.client.PSClient`, and :class:`PendingCheckpoint`.

A checkpoint is one consistent cut of every server, made in two phases
(:mod:`ps_server.checkpoint.series`):

1. ``CheckpointBegin`` to every server at once: each snapshots its tables (they are locked only
   while their rows are copied) and starts writing its part in the background. When every
   server answered, the cut is taken: the caller may go on training.
2. ``CheckpointWait`` to every server, then — only when every part is durable —
   ``CheckpointCommit`` to server 0, which checks the parts, writes ``checkpoint.json`` last and
   keeps the newest K checkpoints. :meth:`PendingCheckpoint.result` does phase 2 (on a
   background thread with ``background=True``).

The caller makes the cut consistent: no push may reach a server between the first and the last
``CheckpointBegin`` (``fleet.ps.checkpoint`` flushes every trainer and meets them in a barrier
around phase 1; a server refuses a snapshot while a SYNC round is half pushed). Paths are on the
servers' file system (shared by all of them), under their checkpoint roots.
"""

from __future__ import annotations

import json
import logging
import posixpath
import threading
from pathlib import Path
from typing import Any

from collective.errors import ConfigError
from ps_server.checkpoint.series import (
    CheckpointRecord,
    CheckpointStatus,
    LatestGood,
    checkpoint_name,
    record_from_dict,
)
from ps_server.errors import CheckpointError
from ps_server.rpc.proto import ps_pb2
from ps_server.rpc.rpc_client import Call, RpcClient
from ps_server.rpc.status import PSDataLossError, PSFailedPreconditionError, PSNotFoundError

logger = logging.getLogger(__name__)

DEFAULT_WRITE_TIMEOUT_S = 3600.0
"""Longest phase 2 waits for the servers' writes."""


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"must be JSON data (dicts, lists, str, numbers): {err}", key=what
        ) from None


class PendingCheckpoint:
    """A checkpoint whose snapshot every server has taken (phase 1 done); :meth:`result` waits
    until every part is durable and commits it (phase 2)."""

    def __init__(
        self,
        client: CheckpointCalls,
        root: str,
        name: str,
        step: int,
        commit: ps_pb2.CheckpointCommitRequest,
        replies: list[Any],
        timeout_s: float,
        background: bool,
    ) -> None:
        self.root, self.name, self.step = root, name, step
        self.snapshot_s = max(float(r.snapshot_s) for r in replies)
        """The longest time a server's tables were locked for the snapshot (training waited)."""
        self.snapshot_bytes = sum(int(r.snapshot_bytes) for r in replies)
        """Memory the servers' copies hold until written."""
        self._client, self._commit, self._timeout_s = client, commit, timeout_s
        self._lock = threading.Lock()
        self._record: CheckpointRecord | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._finish, name=f"ps-commit-{name}", daemon=True
            )
            self._thread.start()

    @property
    def directory(self) -> str:
        """``root/name`` on the servers."""
        return posixpath.join(self.root, self.name)

    def _finish(self) -> None:
        with self._lock:
            if self._finished.is_set():
                return
            try:
                self._record = self._client._complete(self)
            except BaseException as err:  # noqa: BLE001 - raised by result()
                self._error = err
                logger.error("checkpoint %s was not committed: %s", self.directory, err)
            finally:
                self._finished.set()

    def done(self) -> bool:
        """Whether phase 2 finished (committed or failed)."""
        return self._finished.is_set()

    def result(self, timeout_s: float | None = None) -> CheckpointRecord:
        """The committed checkpoint (waits for the servers' writes and the commit); raises why
        it could not be committed — then it is never chosen by ``latest_good``."""
        if self._thread is None:
            self._finish()
        elif not self._finished.wait(timeout_s):
            raise CheckpointError(
                f"checkpoint {self.directory} still not committed after {timeout_s}s"
            )
        if self._error is not None:
            raise self._error
        assert self._record is not None
        return self._record


class CheckpointCalls(RpcClient):
    """Job checkpoints and serving exports (see the module docstring)."""

    def _begin(
        self, root: str, name: str, kind: str, mode: str = "all", min_show: int = 0
    ) -> list[Any]:
        request = ps_pb2.CheckpointBeginRequest(
            root=root, name=name, kind=kind, mode=mode, min_show=min_show
        )
        return self._all("CheckpointBegin", request, idempotent=False)

    def _complete(self, pending: PendingCheckpoint) -> CheckpointRecord:
        """Phase 2: every server's part durable, then the commit on server 0."""
        wait = ps_pb2.CheckpointWaitRequest(
            root=pending.root, name=pending.name, timeout_s=pending._timeout_s
        )
        calls = [Call(s, "CheckpointWait", wait) for s in range(self.num_servers)]
        self._invoke(calls, idempotent=True, timeout_s=pending._timeout_s + 30.0)
        (reply,) = self._invoke([Call(0, "CheckpointCommit", pending._commit)], False)
        record = record_from_dict(json.loads(reply.record_json))
        if reply.deleted:
            logger.info("checkpoints deleted (keep): %s", list(reply.deleted))
        return record

    def begin_checkpoint(
        self,
        root_dir: str,
        step: int,
        *,
        trainer_states: dict[int, Any] | None = None,
        keep: int = 0,
        background: bool = False,
        timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
    ) -> PendingCheckpoint:
        """Phase 1 of checkpoint ``root_dir/ckpt-<step>``: every server snapshots its tables and
        starts writing. Returns once every snapshot is taken; the result commits it (``keep``
        > 0: then only the newest ``keep`` checkpoints of ``root_dir`` stay). ``trainer_states``:
        rank -> any JSON value (e.g. ``{"file": ..., "pass": ..., "offset": ...}``), stored in
        ``checkpoint.json``. ``background``: phase 2 runs on its own thread at once."""
        name = checkpoint_name(step)
        if not isinstance(keep, int) or keep < 0:
            raise ConfigError(f"must be an integer >= 0 (0: keep all), got {keep!r}", key="keep")
        states = {str(int(k)): v for k, v in (trainer_states or {}).items()}
        commit = ps_pb2.CheckpointCommitRequest(
            root=str(root_dir),
            name=name,
            step=step,
            num_servers=self.num_servers,
            trainer_states_json=_json(states, "trainer_states"),
            keep=keep,
        )
        replies = self._begin(str(root_dir), name, "checkpoint")
        return PendingCheckpoint(
            self, str(root_dir), name, step, commit, replies, timeout_s, background
        )

    def checkpoint(
        self,
        root_dir: str,
        step: int,
        *,
        trainer_states: dict[int, Any] | None = None,
        keep: int = 0,
        timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
    ) -> CheckpointRecord:
        """Checkpoint ``root_dir/ckpt-<step>`` of every server and commit it (both phases; see
        :meth:`begin_checkpoint`). Returns the committed record."""
        return self.begin_checkpoint(
            root_dir, step, trainer_states=trainer_states, keep=keep, timeout_s=timeout_s
        ).result()

    def list_checkpoints(self, root_dir: str, full: bool = False) -> list[CheckpointStatus]:
        """The checkpoints of ``root_dir`` (asked of server 0), newest first, each verified:
        manifests and file sizes, or with ``full`` every file's CRC-32."""
        request = ps_pb2.ListCheckpointsRequest(root=str(root_dir), full=full)
        (reply,) = self._invoke([Call(0, "ListCheckpoints", request)], idempotent=True)
        return [
            CheckpointStatus(
                c["name"],
                int(c["step"]),
                Path(posixpath.join(str(root_dir), c["name"])),
                record_from_dict(c["record"]) if c["record"] else None,
                c["reason"],
            )
            for c in json.loads(reply.checkpoints_json)
        ]

    def load_latest(self, root_dir: str) -> LatestGood:
        """Load the newest checkpoint of ``root_dir`` that every server can load: candidates
        whose manifests or file sizes are wrong are skipped, then every server loads its shards
        (checking every file's CRC-32); a checkpoint a server finds corrupt is skipped and the
        previous one loaded. Returns what was chosen and why newer ones were skipped
        (``chosen`` None: ``root_dir`` holds no checkpoint, nothing changed). CheckpointError
        if checkpoints exist but none loads (the servers may then hold a mix: load again)."""
        skipped: list[tuple[str, str]] = []
        tried = False
        for status in self.list_checkpoints(root_dir):
            if status.record is None:
                skipped.append((status.name, status.reason))
                continue
            tried = True
            try:
                self.load(posixpath.join(str(root_dir), status.name))  # type: ignore[attr-defined]
            except (PSDataLossError, PSFailedPreconditionError, PSNotFoundError) as err:
                logger.warning("checkpoint %s skipped: %s", status.name, err)
                skipped.append((status.name, str(err)))
                continue
            result = LatestGood(status.record, tuple(skipped))
            (logger.warning if skipped else logger.info)("%s", result.describe())
            return result
        result = LatestGood(None, tuple(skipped))
        if tried:
            raise CheckpointError(f"{root_dir}: no checkpoint could be loaded: {result.describe()}")
        logger.info("%s: no checkpoint to load (%s)", root_dir, result.describe())
        return result

    def export_serving(
        self,
        dirname: str,
        *,
        min_show: int = 0,
        mode: str = "all",
        model_config: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
    ) -> CheckpointRecord:
        """Export a read-only serving copy of every table into ``dirname`` (on the servers,
        under their checkpoint roots): sparse rows whose show count is >= ``min_show`` (keys,
        values, counts), dense tables whole, ``model_config`` (any JSON: tables, slots) in
        ``checkpoint.json``. ``mode="delta"``: only what changed since the previous export of
        these servers (a base export must come first). Serve it with ``python -m ps_server
        --serve DIR [DELTA ...]``."""
        if not isinstance(min_show, int) or min_show < 0:
            raise ConfigError(f"must be an integer >= 0, got {min_show!r}", key="min_show")
        root, name = posixpath.split(str(dirname).rstrip("/"))
        replies = self._begin(root or ".", name, "serving", mode, min_show)
        follows = replies[0].previous_export if mode == "delta" else ""
        info = {"model_config": model_config or {}, "min_show": min_show, "follows": follows}
        commit = ps_pb2.CheckpointCommitRequest(
            root=root or ".",
            name=name,
            num_servers=self.num_servers,
            extra_json=_json({**(extra or {}), **info}, "model_config"),
        )
        pending = PendingCheckpoint(
            self, root or ".", name, 0, commit, replies, timeout_s, background=False
        )
        return pending.result()


__all__ = ["DEFAULT_WRITE_TIMEOUT_S", "CheckpointCalls", "PendingCheckpoint"]
