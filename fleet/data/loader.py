"""The load pipeline shared by both datasets: reader threads -> blocks of lines -> parser threads.

::

    files --(readers: open, gunzip, pipe; up to thread_num files at once)--> raw block queue
          --(thread_num parsers: the C parser, GIL released)--> parsed block queue --> consumer

Both queues are bounded (``queue_blocks`` each), so memory stays flat however large the files:
the readers wait when the parsers are behind, the parsers when the consumer is. Blocks carry
their ``(file index, block index)`` key: :class:`~fleet.data.dataset.InMemoryDataset` sorts by
it (the loaded order is the file order), :class:`~fleet.data.dataset.QueueDataset` takes blocks
as they come (with ``thread_num > 1`` the order varies from run to run, as in Paddle).

The first failure of any thread (a bad line with ``on_error="raise"``, a missing file, a failing
command) stops every thread and is raised to the consumer; :meth:`Pipeline.close` kills the
commands still running.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from fleet.data import metrics
from fleet.data.columns import Columns
from fleet.data.parser import LineError, ParseSpec, make_format_error, parse_block
from fleet.data.sources import BufferPool, ByteSource, SourceConfig, iter_blocks

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a blocked thread looks at the stop flag


@dataclass(frozen=True)
class LoadConfig:
    """One pass over the files."""

    files: tuple[str, ...]
    """Resolved file names (:func:`~fleet.data.sources.expand_filelist`)."""
    spec: ParseSpec
    source: SourceConfig
    threads: int = 1
    """Parser threads; also the most files read at once."""
    skip_bad: bool = False
    block_bytes: int = 4 << 20
    """Bytes of text per block (a longer line makes a longer block)."""
    queue_blocks: int = 0
    """Bound of each queue, in blocks; 0 = ``2 * threads``."""
    kind: str = "inmemory"
    """Label of the metrics (``inmemory`` or ``queue``)."""


@dataclass
class LoadStats:
    """What a pass read."""

    files: int = 0
    lines: int = 0
    examples: int = 0
    skipped: int = 0
    first_skipped: str = ""
    """The error message of the first skipped line (for the log)."""
    seconds: float = 0.0


@dataclass(order=True)
class ParsedBlock:
    """Examples of one block, with the key giving its place in the file order."""

    key: tuple[int, int]
    columns: Columns = field(compare=False)


_DONE = object()


class Pipeline:
    """Readers and parsers of one pass; iterate :meth:`blocks`, then :meth:`close`."""

    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.stats = LoadStats(files=len(cfg.files))
        bound = cfg.queue_blocks or 2 * cfg.threads
        self._raw: queue.Queue = queue.Queue(bound)
        self._out: queue.Queue = queue.Queue(bound)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._next_file = 0
        self._readers_left = min(cfg.threads, len(cfg.files))
        self._parsers_left = cfg.threads
        self._sources: set[ByteSource] = set()
        self._hints = [1.0] * len(cfg.spec.slots)
        self._pool = BufferPool(cfg.block_bytes)
        self._threads = [
            threading.Thread(
                target=self._guard,
                args=(self._read, self._reader_done),
                name=f"fleet-data-read-{i}",
                daemon=True,
            )
            for i in range(self._readers_left)
        ] + [
            threading.Thread(
                target=self._guard,
                args=(self._parse, self._parser_done),
                name=f"fleet-data-parse-{i}",
                daemon=True,
            )
            for i in range(cfg.threads)
        ]
        self._t0 = time.perf_counter()
        for t in self._threads:
            t.start()

    # -- threads -------------------------------------------------------------------------------
    def _guard(self, body, done) -> None:
        """Run a thread's ``body``; a failure is recorded (and everything stopped) *before*
        ``done`` may tell the consumer that the pass is over."""
        try:
            body()
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, not swallowed
            with self._lock:
                if self._error is None:
                    self._error = err
            self._stop.set()
            self._abort_sources()
        finally:
            done()

    def _reader_done(self) -> None:
        with self._lock:
            self._readers_left -= 1
            last = self._readers_left == 0
        if last:  # one end mark per parser
            for _ in range(self.cfg.threads):
                self._put(self._raw, _DONE)

    def _parser_done(self) -> None:
        with self._lock:
            self._parsers_left -= 1
            last = self._parsers_left == 0
        if last:
            self._put(self._out, _DONE)

    def _put(self, q: queue.Queue, item: object) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                index = self._next_file
                self._next_file += 1
            if index >= len(self.cfg.files):
                return
            name = self.cfg.files[index]
            source = ByteSource(name, self.cfg.source)
            with self._lock:
                self._sources.add(source)
            try:
                blocks = iter_blocks(source, self.cfg.block_bytes, self._pool)
                for block, (first_line, buf, length, newlines) in enumerate(blocks):
                    item = (index, block, name, first_line, buf, length, newlines)
                    if not self._put(self._raw, item):
                        return
            finally:
                with self._lock:
                    self._sources.discard(source)
                if self._stop.is_set():
                    source.abort()
                source.close()

    def _parse(self) -> None:
        spec, cfg = self.cfg.spec, self.cfg
        while not self._stop.is_set():
            try:
                item = self._raw.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _DONE:
                return
            index, block, name, first_line, buf, length, newlines = item
            with memoryview(buf) as whole, whole[:length] as text:
                result = parse_block(text, spec, cfg.skip_bad, self._hints, newlines)
            self._pool.put(buf)
            del buf, item
            if result.error is not None and not cfg.skip_bad:
                raise make_format_error(result.error, spec, name, first_line)
            n = result.columns.num_examples
            if n:
                self._learn_hints(result.columns)
            with self._lock:
                self.stats.lines += result.num_lines
                self.stats.examples += n
                self.stats.skipped += result.num_skipped
                if result.error is not None and not self.stats.first_skipped:
                    self.stats.first_skipped = str(
                        _skipped_message(result.error, spec, name, first_line)
                    )
            if not self._put(self._out, ParsedBlock((index, block), result.columns)):
                return

    def _learn_hints(self, cols: Columns) -> None:
        """Values per example of each sparse slot (sizes the next blocks' first allocation)."""
        n = cols.num_examples
        for s, col in enumerate(cols.data):
            if isinstance(col, tuple):
                self._hints[s] = float(col[1][-1]) / n

    def _abort_sources(self) -> None:
        with self._lock:
            sources = list(self._sources)
        for source in sources:
            source.abort()

    # -- consumer ------------------------------------------------------------------------------
    def blocks(self) -> Iterator[ParsedBlock]:
        """Parsed blocks as they come; raises the first failure of any thread."""
        while True:
            if self._error is not None:
                raise self._error
            try:
                item = self._out.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _DONE:
                if self._error is not None:
                    raise self._error
                self.stats.seconds = time.perf_counter() - self._t0
                return
            yield item

    def close(self) -> None:
        """Stop every thread (a no-op after a complete pass) and wait for them."""
        self._stop.set()
        self._abort_sources()
        for t in self._threads:
            t.join(timeout=30)

    def report(self) -> None:
        """Log the pass and count it in the metrics (after a complete pass)."""
        s = self.stats
        metrics.record_pass(self.cfg.kind, s.examples, s.skipped)
        logger.info(
            "read %d examples (%d lines) from %d files in %.2f s (%.0f lines/s, %d threads)",
            s.examples,
            s.lines,
            s.files,
            s.seconds,
            s.lines / s.seconds if s.seconds > 0 else 0.0,
            self.cfg.threads,
        )
        if s.skipped:
            logger.warning(
                "skipped %d malformed lines (on_error='skip'); the first: %s",
                s.skipped,
                s.first_skipped,
            )


def _skipped_message(err: LineError, spec: ParseSpec, name: str, first_line: int) -> str:
    return str(make_format_error(err, spec, name, first_line, on_error_hint=False))


__all__ = ["LoadConfig", "LoadStats", "ParsedBlock", "Pipeline"]
