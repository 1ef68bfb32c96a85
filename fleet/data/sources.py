"""Where the bytes of a dataset come from: file lists, globs, fsspec URLs, gzip, download and pipe
commands, and the blocks of whole lines the parser threads take.

A file's bytes go through, in Paddle's order:

1. **open**: a local path (``open``), a URL of any fsspec file system (``s3://``, ``hdfs://``,
   ``memory://``, ``file://``; with Paddle's ``fs_name`` a path without a scheme is taken on that
   file system), or -- when ``download_cmd`` is not ``"cat"`` -- the stdout of
   ``<download_cmd> <path>`` run by the shell (Paddle's custom ``hadoop fs -cat``);
2. **gzip**: decompressed when the name ends in ``.gz`` or the bytes start with gzip's magic;
3. **pipe_command**: unless it is ``"cat"`` (read directly: the same bytes, no process), the
   bytes are fed to ``sh -c <pipe_command>`` and its stdout is the MultiSlot text.

A command that exits non-zero fails the load with a :class:`DataSourceError` quoting the tail of
its stderr. Paddle's ``set_filelist`` takes plain names; globs are our addition.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import io
import os
import queue
import shlex
import subprocess
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from collective.errors import ConfigError
from fleet.data.errors import DataSourceError

try:
    from fleet.data import _parser as _c
except ImportError:  # not built: bytes.count
    _c = None

STDERR_TAIL_BYTES = 4096
"""How much of a failing command's stderr the error quotes."""
_GLOB_CHARS = frozenset("*?[")
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class SourceConfig:
    """How files are opened (Paddle's ``init`` arguments of the same names)."""

    pipe_command: str = "cat"
    """Shell command each file's bytes are piped through; its stdout is MultiSlot text."""
    download_cmd: str = "cat"
    """Not ``"cat"``: a file's bytes are the stdout of ``<download_cmd> <path>``."""
    fs_name: str = ""
    """A file system URL prefix (``"hdfs://namenode:9000"``) for paths without a scheme."""
    fs_ugi: str = ""
    """Paddle's ``"user,password"``: the user is passed to an HDFS file system."""


def _has_scheme(path: str) -> bool:
    return "://" in path


def resolve_name(path: str, cfg: SourceConfig) -> str:
    """``path`` with ``fs_name`` put in front when it has no scheme and ``fs_name`` is set."""
    if cfg.fs_name and not _has_scheme(path):
        if cfg.fs_name.endswith("://"):  # "memory://" + "/a/b"
            return cfg.fs_name + path
        return cfg.fs_name.rstrip("/") + "/" + path.lstrip("/")
    return path


def _fsspec(url: str, cfg: SourceConfig) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs
    except ImportError:  # pragma: no cover - fsspec is a dependency
        raise ConfigError(
            f"{url!r} is a URL: install fsspec to read it (pip install fsspec)", key="filelist"
        ) from None
    options: dict[str, Any] = {}
    if cfg.fs_ugi and url.split("://", 1)[0] in ("hdfs", "viewfs", "webhdfs"):
        options["user"] = cfg.fs_ugi.split(",", 1)[0]
    try:
        return url_to_fs(url, **options)
    except (ImportError, ValueError) as err:
        raise DataSourceError(f"cannot open the file system of {url!r}: {err}", url) from None


def expand_filelist(filelist: Sequence[str], cfg: SourceConfig) -> list[str]:
    """The files to read: globs expanded (sorted), every file checked to exist.

    :class:`DataSourceError` names an empty list, a glob that matches nothing, or a missing
    file. With a custom ``download_cmd`` names are passed to it unchecked.
    """
    if isinstance(filelist, (str, bytes)) or not isinstance(filelist, Sequence):
        raise ConfigError(
            f"got {type(filelist).__name__} {filelist!r}; set_filelist takes a list "
            "of file names, globs or URLs",
            key="filelist",
        )
    if not filelist:
        raise DataSourceError(
            "the file list is empty: call set_filelist([...]) with at least one "
            "file (an empty trainer shard? check fleet.util.get_file_shard)"
        )
    out: list[str] = []
    for entry in filelist:
        if not isinstance(entry, str) or not entry:
            raise ConfigError(f"file list item {entry!r} is not a file name", key="filelist")
        name = resolve_name(entry, cfg)
        if cfg.download_cmd != "cat":
            out.append(name)
            continue
        is_glob = bool(_GLOB_CHARS & set(name))
        if _has_scheme(name):
            fs, path = _fsspec(name, cfg)
            found = (
                [fs.unstrip_protocol(p) for p in sorted(fs.glob(path))]
                if is_glob
                else ([name] if fs.isfile(path) else [])
            )
        else:
            found = sorted(glob.glob(name)) if is_glob else ([name] if os.path.isfile(name) else [])
        if not found:
            what = "no file matches the glob" if is_glob else "file not found"
            raise DataSourceError(
                f"{what} {name!r} (from the file list given to set_filelist)", name
            )
        out.extend(found)
    return out


class _StderrTail:
    """Drains a process's stderr on a thread, keeping the last bytes (a full pipe would block
    the process)."""

    def __init__(self, pipe: BinaryIO) -> None:
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.thread = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self.thread.start()

    def _drain(self, pipe: BinaryIO) -> None:
        read = pipe.read1 if hasattr(pipe, "read1") else pipe.read
        for chunk in iter(lambda: read(65536), b""):
            self.chunks.append(chunk)
            self.size += len(chunk)
            while self.size - len(self.chunks[0]) >= STDERR_TAIL_BYTES:
                self.size -= len(self.chunks.popleft())
        pipe.close()

    def text(self) -> str:
        self.thread.join(timeout=5)
        return b"".join(self.chunks)[-STDERR_TAIL_BYTES:].decode("utf-8", "replace").strip()


class ByteSource:
    """One file's bytes after download, gzip and pipe (module docstring); read with
    :meth:`readinto`, then :meth:`close` (raises when a command failed) or :meth:`abort`."""

    def __init__(self, name: str, cfg: SourceConfig) -> None:
        self.name = name
        self._procs: list[tuple[str, subprocess.Popen, _StderrTail]] = []
        self._closers: list[Any] = []
        self._feed_error: BaseException | None = None
        self._feeder: threading.Thread | None = None
        self._aborted = False
        try:
            stream = self._open_raw(name, cfg)
            stream = self._maybe_gunzip(stream, name)
            if cfg.pipe_command != "cat":
                stream = self._pipe(stream, cfg.pipe_command)
        except BaseException:
            self.abort()
            with contextlib.suppress(DataSourceError):
                self.close()
            raise
        self.stream = stream

    def _spawn(self, what: str, command: str, stdin: Any) -> subprocess.Popen:
        try:
            proc = subprocess.Popen(
                command,
                shell=True,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as err:
            raise DataSourceError(f"cannot start {what} {command!r}: {err}", self.name) from None
        assert proc.stderr is not None
        self._procs.append((f"{what} {command!r}", proc, _StderrTail(proc.stderr)))
        return proc

    def _open_raw(self, name: str, cfg: SourceConfig) -> BinaryIO:
        if cfg.download_cmd != "cat":
            proc = self._spawn(
                "download_cmd", f"{cfg.download_cmd} {shlex.quote(name)}", subprocess.DEVNULL
            )
            return proc.stdout  # type: ignore[return-value]
        try:
            if _has_scheme(name):
                fs, path = _fsspec(name, cfg)
                f = fs.open(path, "rb")
            else:
                f = open(name, "rb")  # noqa: SIM115 - closed in close()
        except FileNotFoundError:
            raise DataSourceError(f"file not found: {name!r}", name) from None
        except OSError as err:
            raise DataSourceError(f"cannot open {name!r}: {err}", name) from None
        self._closers.append(f)
        return f

    def _maybe_gunzip(self, stream: BinaryIO, name: str) -> BinaryIO:
        if not hasattr(stream, "peek"):
            stream = io.BufferedReader(stream)  # type: ignore[arg-type]
            self._closers.append(stream)
        head = stream.peek(2)[:2]  # type: ignore[attr-defined]
        if name.endswith(".gz") or head == _GZIP_MAGIC:
            stream = gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[assignment]
            self._closers.append(stream)
        return stream

    def _pipe(self, source: BinaryIO, command: str) -> BinaryIO:
        proc = self._spawn("pipe_command", command, subprocess.PIPE)
        assert proc.stdin is not None

        def feed() -> None:
            try:
                for chunk in iter(lambda: source.read(1 << 20), b""):
                    proc.stdin.write(chunk)  # type: ignore[union-attr]
            except BrokenPipeError:  # the command stopped reading; its exit code tells
                pass
            except (OSError, EOFError, ValueError, zlib.error) as err:  # a corrupt .gz, ...
                if not self._aborted:
                    self._feed_error = err
            finally:
                try:
                    proc.stdin.close()  # type: ignore[union-attr]
                except OSError:
                    pass

        self._feeder = threading.Thread(
            target=feed, name=f"fleet-data-feed-{self.name}", daemon=True
        )
        self._feeder.start()
        return proc.stdout  # type: ignore[return-value]

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` (fewer bytes only at the end of the data); returns the bytes read."""
        got = 0
        try:
            while got < len(view):
                n = self.stream.readinto(view[got:])  # type: ignore[attr-defined]
                if not n:
                    break
                got += n
        except (OSError, EOFError, zlib.error) as err:  # BadGzipFile is an OSError
            if self._aborted:
                return 0
            raise DataSourceError(f"cannot read {self.name!r}: {err}", self.name) from None
        return got

    def close(self) -> None:
        """Release everything; :class:`DataSourceError` when a command exited non-zero or the
        feed of a pipe failed."""
        failure = None
        if self._feeder is not None:
            self._feeder.join()
        for what, proc, tail in self._procs:
            if proc.stdout is not None:
                proc.stdout.close()
            code = proc.wait()
            err_text = tail.text()
            if code != 0 and failure is None and not self._aborted:
                failure = (
                    f"{what} exited with code {code} on {self.name!r}; its stderr ends "
                    f"with:\n{err_text or '(empty)'}"
                )
        for f in reversed(self._closers):
            try:
                f.close()
            except OSError:
                pass
        if failure:
            raise DataSourceError(failure, self.name)
        if self._feed_error is not None:
            raise DataSourceError(f"cannot read {self.name!r}: {self._feed_error}", self.name)

    def abort(self) -> None:
        """Stop early (another thread failed, or the consumer stopped): kill the commands."""
        self._aborted = True
        for _what, proc, _tail in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except (ProcessLookupError, PermissionError):
                    proc.kill()


class BufferPool:
    """Reused text buffers of the blocks: a pass touches a few blocks' worth of fresh memory,
    not the whole data's (fresh pages cost a fault and the kernel's zeroing each)."""

    def __init__(self, block_bytes: int) -> None:
        self.size = block_bytes + block_bytes // 8  # room for the carried part line
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()

    def get(self, need: int) -> bytearray:
        """A buffer of at least ``need`` bytes (contents undefined)."""
        if need <= self.size:
            try:
                return self._free.get_nowait()
            except queue.Empty:
                return bytearray(self.size)
        return bytearray(need)

    def put(self, buf: bytearray) -> None:
        """Give a buffer back once nothing reads it any more."""
        if len(buf) == self.size:
            self._free.put(buf)


def count_lines(buf: bytearray, length: int) -> int:
    """The ``\\n`` in ``buf[:length]`` (compiled: without the GIL)."""
    if _c is not None:
        return _c.count_lines(buf, length)
    return buf.count(b"\n", 0, length)


def iter_blocks(
    source: ByteSource, block_bytes: int, pool: BufferPool
) -> Iterator[tuple[int, bytearray, int, int]]:
    """``(first line number, buffer, length, newlines)`` of consecutive blocks of whole lines
    (about ``block_bytes``; a longer line makes a longer block) in ``buffer[:length]``; the last
    block may lack its final ``\\n``. The consumer gives each buffer back to ``pool``."""
    carry = b""
    line = 1
    size = block_bytes
    while True:
        need = len(carry) + size
        buf = pool.get(need)
        buf[: len(carry)] = carry
        got = source.readinto(memoryview(buf)[len(carry) : need])
        end = len(carry) + got
        if got == 0:
            if carry:
                yield line, buf, len(carry), carry.count(b"\n")
            else:
                pool.put(buf)
            return
        cut = buf.rfind(b"\n", 0, end)
        if cut < 0:  # no line end yet: a line longer than the block
            carry, size = bytes(buf[:end]), size * 2
            pool.put(buf)
            continue
        carry, size = bytes(buf[cut + 1 : end]), block_bytes
        newlines = count_lines(buf, cut + 1)
        yield line, buf, cut + 1, newlines
        line += newlines


__all__ = [
    "BufferPool",
    "ByteSource",
    "SourceConfig",
    "count_lines",
    "expand_filelist",
    "iter_blocks",
    "resolve_name",
]
