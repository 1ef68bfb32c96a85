"""A server's checkpoint writes in the background: the snapshot is taken in the caller's thread
(training waits only for it) and the files are written on a thread of their own.

:meth:`CheckpointWriter.begin` takes the snapshot (:func:`~ps_server.checkpoint.save_load.take_snapshot`:
the tables' locks are held while their rows are copied) and starts the write
(:func:`~ps_server.checkpoint.save_load.write_snapshot`: shard files, fsyncs, this server's
manifest last); :meth:`CheckpointWriter.wait` blocks until that write is durable and returns the
manifest, or raises the error that stopped it. One write at a time per server: a second
``begin`` while one runs is refused (:class:`~ps_server.errors.CheckpointBusyError`), so two
checkpoints never compete for the disk and the memory of their copies never adds up. The last
few finished jobs are remembered, so a ``wait`` that arrives after the write finished still
gets its result.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ps_server.checkpoint.save_load import Snapshot, take_snapshot, write_snapshot
from ps_server.core.graph_table import GraphTable
from ps_server.core.table import ChangeLog, Table
from ps_server.errors import CheckpointBusyError, CheckpointError

logger = logging.getLogger(__name__)

REMEMBERED_JOBS = 16
"""Finished jobs kept for late ``wait`` calls."""


class CheckpointJob:
    """One background write of one directory."""

    def __init__(
        self,
        directory: Path,
        snapshot: Snapshot,
        writer: str,
        kind: str,
        min_show: int,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.directory = directory
        self._on_failure = on_failure
        self.kind = kind
        self.snapshot_s = snapshot.seconds
        self.snapshot_bytes = snapshot.nbytes
        self.write_s = 0.0
        self.manifest: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(snapshot, writer, min_show),
            name=f"ps-ckpt-{directory.name}",
            daemon=True,
        )

    def start(self) -> None:
        """Start writing."""
        self._thread.start()

    def _run(self, snapshot: Snapshot, writer: str, min_show: int) -> None:
        t0 = time.perf_counter()
        try:
            self.manifest = write_snapshot(self.directory, snapshot, writer, self.kind, min_show)
        except BaseException as err:  # noqa: BLE001 - kept and raised to whoever waits
            self.error = err
            logger.error("checkpoint write to %s failed: %s", self.directory, err)
            snapshot.requeue()
            if self._on_failure is not None:
                self._on_failure()
        finally:
            del snapshot  # the copies go as soon as the files are written
            self.write_s = time.perf_counter() - t0
            self._done.set()

    @property
    def done(self) -> bool:
        """Whether the write finished (well or not)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> dict[str, Any]:
        """This server's manifest once the write is durable; the write's error if it failed;
        CheckpointError if it is still running after ``timeout_s``."""
        if not self._done.wait(timeout_s):
            raise CheckpointError(
                f"{self.directory}: still writing after {timeout_s:.0f}s (snapshot of "
                f"{self.snapshot_bytes} bytes); wait longer"
            )
        if self.error is not None:
            if isinstance(self.error, CheckpointError):
                raise self.error
            raise CheckpointError(
                f"writing {self.directory} failed: {type(self.error).__name__}: {self.error}"
            ) from self.error
        assert self.manifest is not None
        return self.manifest


class CheckpointWriter:
    """The background checkpoint writes of one server (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: OrderedDict[Path, CheckpointJob] = OrderedDict()

    def running(self) -> CheckpointJob | None:
        """The job still writing, if any."""
        with self._lock:
            return next((j for j in self._jobs.values() if not j.done), None)

    def begin(
        self,
        directory: Path,
        tables: Mapping[str, Table],
        writer: str,
        *,
        kind: str = "checkpoint",
        mode: str = "all",
        log: ChangeLog | None = None,
        min_show: int = 0,
        on_failure: Callable[[], None] | None = None,
        graphs: Mapping[str, GraphTable] | None = None,
    ) -> CheckpointJob:
        """Snapshot ``tables`` (and graph tables ``graphs``) now and write them into
        ``directory`` in the background; a failed write gives the snapshot's changes back to
        ``log`` and calls ``on_failure``."""
        with self._lock:
            busy = next((j for j in self._jobs.values() if not j.done), None)
            if busy is not None:
                raise CheckpointBusyError(
                    f"this server is still writing {busy.directory}; wait for it (CheckpointWait) "
                    f"before starting {directory}"
                )
            snapshot = take_snapshot(tables, mode, log, graphs)
            job = CheckpointJob(directory, snapshot, writer, kind, min_show, on_failure)
            self._jobs.pop(directory, None)
            self._jobs[directory] = job
            while len(self._jobs) > REMEMBERED_JOBS:
                self._jobs.popitem(last=False)
            job.start()
        logger.info(
            "%s snapshot for %s taken in %.3fs (%d bytes); writing in the background",
            kind,
            directory,
            snapshot.seconds,
            snapshot.nbytes,
        )
        return job

    def job(self, directory: Path) -> CheckpointJob:
        """The job writing (or that wrote) ``directory``."""
        with self._lock:
            job = self._jobs.get(directory)
        if job is None:
            raise CheckpointError(
                f"no checkpoint of {directory} was started on this server (did it restart since?)"
            )
        return job

    def close(self, timeout_s: float = 60.0) -> None:
        """Let a running write finish (a stopping server does not leave it half done)."""
        job = self.running()
        if job is not None:
            logger.info(
                "waiting up to %.0fs for the checkpoint write to %s", timeout_s, job.directory
            )
            job._done.wait(timeout_s)


__all__ = ["REMEMBERED_JOBS", "CheckpointJob", "CheckpointWriter"]
