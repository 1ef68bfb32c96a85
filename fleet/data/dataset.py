"""Paddle's ``DatasetBase`` and ``QueueDataset`` on torch: settings, file lists, streaming batches.

::

    ds = fleet.QueueDataset()
    ds.init(batch_size=512, thread_num=2, use_var=slots, pipe_command="python reader.py")
    ds.set_filelist(fleet.util.get_file_shard(files))
    for batch in ds:                       # Paddle: exe.train_from_dataset(program, ds)
        loss = model(batch)...

``init`` takes Paddle's arguments (``batch_size``, ``thread_num``, ``use_var``,
``pipe_command``, ``input_type``, ``fs_name``, ``fs_ugi``, ``download_cmd``, and
:class:`~fleet.data.in_memory.InMemoryDataset`'s distributed settings) plus ours:

=============================  ===============================================================
argument                       here
=============================  ===============================================================
batch_size, thread_num         honoured (``thread_num`` parser threads; files read at once)
use_var                        a list of :class:`~fleet.data.slots.Slot` (Paddle: variables)
pipe_command, download_cmd     honoured (:mod:`fleet.data.sources`)
fs_name, fs_ugi                honoured through fsspec (paths without a scheme go to fs_name)
input_type                     accepted (0 or 1), ignored: one example per line either way
parse_ins_id, parse_content    honoured: the leading ``1 <id>`` fields are checked, skipped
                               and not kept (no ins ids: nothing here dumps or merges by them)
merge_size > 0                 refused (FleetNotImplementedError): merging by line id needs the
                               ins ids kept
fleet_send_batch_size,         accepted, ignored: they throttle Paddle's RPC shuffle; ours is
fleet_send_sleep_seconds       one all_to_all per column
fea_eval, candidate_size       accepted; ``slots_shuffle`` works with or without them
data_feed_type, queue_num      accepted, ignored: Paddle's C++ feed class and its channels
drop_last (ours)               drop the last, smaller batch
on_error (ours)                ``"raise"`` (default) or ``"skip"`` malformed lines
block_bytes, queue_blocks      text per parser block (4 MiB) and queue bound in blocks
(ours)                         (0 = 2 x thread_num): the QueueDataset's memory bound
=============================  ===============================================================

Unknown arguments raise :class:`~collective.errors.ConfigError` (Paddle ignores them). Paddle's
``_set_*`` setters are public here (``set_batch_size``, ``set_thread``, ...).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from collective.env import StrEnum
from collective.errors import ConfigError, FleetNotImplementedError
from fleet.base import data_position, lookahead
from fleet.data.batch import Batch, make_batch
from fleet.data.columns import Columns, concat_columns
from fleet.data.loader import LoadConfig, Pipeline
from fleet.data.parser import ParseSpec
from fleet.data.slots import Slot, check_use_var
from fleet.data.sources import SourceConfig, expand_filelist

logger = logging.getLogger(__name__)


class OnError(StrEnum):
    """What a malformed line does."""

    RAISE = "raise"
    """Stop with a DatasetFormatError naming file, line, slot and text (nothing is loaded)."""
    SKIP = "skip"
    """Drop the line, count it (``skipped_lines``, ``fleet_data_skipped_lines_total``, a log
    line at the end of the pass)."""


_IGNORED = {
    "data_feed_type": "Paddle's C++ feed class; one parser here",
    "queue_num": "Paddle's output channels; batches come from one Python iterator here",
    "fleet_send_batch_size": "throttles Paddle's RPC shuffle; ours is one all_to_all",
    "fleet_send_sleep_seconds": "throttles Paddle's RPC shuffle; ours is one all_to_all",
}


_INIT_DEFAULTS = {
    "drop_last": False,
    "on_error": "raise",
    "block_bytes": 4 << 20,
    "queue_blocks": 0,
    "parse_ins_id": False,
    "parse_content": False,
}


def _positive_int(value: Any, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"got {value!r}; expected an int >= {minimum}", key=key)
    return value


class DatasetBase:
    """Settings and file list shared by both datasets (Paddle's ``DatasetBase``)."""

    _KIND = "queue"
    looks_ahead = True
    """Iterating goes through :func:`fleet.base.lookahead.batches`: in async PS training the
    next batch's sparse rows are pulled while the current one trains."""

    def __init__(self) -> None:
        self.batch_size = 1
        """Examples per batch."""
        self.thread_num = 1
        """Parser threads (and files read at once)."""
        self.use_var: tuple[Slot, ...] = ()
        """The slots of each line, in order."""
        self.pipe_command = "cat"
        self.input_type = 0
        self.source = SourceConfig()
        self.drop_last = False
        self.on_error = OnError.RAISE
        self.block_bytes = _INIT_DEFAULTS["block_bytes"]
        self.queue_blocks = 0
        self.parse_ins_id = False
        self.parse_content = False
        self.fea_eval = False
        self.candidate_size = 10000
        self.filelist: list[str] = []
        self.skipped_lines = 0
        """Malformed lines skipped by the last pass over the files (``on_error="skip"``)."""

    # -- settings --------------------------------------------------------------------------------
    def init(
        self,
        batch_size: int = 1,
        thread_num: int = 1,
        use_var: Sequence[Slot] = (),
        pipe_command: str = "cat",
        input_type: int = 0,
        fs_name: str = "",
        fs_ugi: str = "",
        download_cmd: str = "cat",
        **kwargs: Any,
    ) -> None:
        """Set every setting (module docstring's table; those not given get their defaults);
        then ``set_filelist``."""
        self.set_batch_size(batch_size)
        self.set_thread(thread_num)
        self.set_use_var(use_var)
        self.set_pipe_command(pipe_command)
        self.set_input_type(input_type)
        self.set_hdfs_config(fs_name, fs_ugi)
        self.set_download_cmd(download_cmd)
        self.update_settings(**{**_INIT_DEFAULTS, **kwargs})

    def update_settings(self, **kwargs: Any) -> None:
        """Change some settings by name (Paddle's ``update_settings``; the same names as
        :meth:`init`)."""
        setters = {
            "batch_size": self.set_batch_size,
            "thread_num": self.set_thread,
            "use_var": self.set_use_var,
            "pipe_command": self.set_pipe_command,
            "input_type": self.set_input_type,
            "download_cmd": self.set_download_cmd,
        }
        for key, value in kwargs.items():
            if key in setters:
                setters[key](value)
            elif key in ("fs_name", "fs_ugi"):
                self.set_hdfs_config(
                    kwargs.get("fs_name", self.source.fs_name),
                    kwargs.get("fs_ugi", self.source.fs_ugi),
                )
            elif key == "drop_last":
                if not isinstance(value, bool):
                    raise ConfigError(f"got {value!r}; use True or False", key="drop_last")
                self.drop_last = value
            elif key == "on_error":
                try:
                    self.on_error = OnError(value)
                except ValueError:
                    raise ConfigError(
                        f"got {value!r}; use 'raise' or 'skip'", key="on_error"
                    ) from None
            elif key == "block_bytes":
                self.block_bytes = _positive_int(value, key, 64)
            elif key == "queue_blocks":
                self.queue_blocks = _positive_int(value, key, 0)
            elif key in _IGNORED:
                logger.debug("dataset setting %s=%r ignored: %s", key, value, _IGNORED[key])
            else:
                self._distributed_setting(key, value)

    def _distributed_setting(self, key: str, value: Any) -> None:
        """Paddle's ``_init_distributed_settings`` keys (InMemoryDataset)."""
        if key in ("parse_ins_id", "parse_content", "fea_eval"):
            setattr(self, key, bool(value))
        elif key == "candidate_size":
            self.candidate_size = _positive_int(value, key)
        elif key == "merge_size":
            if isinstance(value, int) and value > 0:
                raise FleetNotImplementedError(
                    "merge_size (merging instances by line id after a shuffle)",
                    "set merge_size=-1, or merge examples in the pipe_command",
                )
        else:
            raise ConfigError(
                f"unknown dataset setting {key!r}={value!r}; see fleet.data."
                "dataset's table of init arguments",
                key=key,
            )

    def set_batch_size(self, batch_size: int) -> None:
        """Examples per batch."""
        self.batch_size = _positive_int(batch_size, "batch_size")

    def set_thread(self, thread_num: int) -> None:
        """Parser threads (also the most files read at once)."""
        self.thread_num = _positive_int(thread_num, "thread_num")

    def set_use_var(self, var_list: Sequence[Slot]) -> None:
        """The slots of each line, in order (Paddle: a list of static variables)."""
        self.use_var = check_use_var(var_list)

    def set_pipe_command(self, pipe_command: str) -> None:
        """Shell command every file is piped through (``"cat"``: read as is)."""
        if not isinstance(pipe_command, str) or not pipe_command.strip():
            raise ConfigError(
                f"got {pipe_command!r}; use a shell command, 'cat' to read the files as they are",
                key="pipe_command",
            )
        self.pipe_command = pipe_command
        self.source = SourceConfig(
            pipe_command, self.source.download_cmd, self.source.fs_name, self.source.fs_ugi
        )

    def set_input_type(self, input_type: int) -> None:
        """Paddle's 0 (one sample per line) or 1 (one batch); the files read the same."""
        if input_type not in (0, 1):
            raise ConfigError(f"got {input_type!r}; use 0 or 1", key="input_type")
        self.input_type = input_type

    def set_hdfs_config(self, fs_name: str, fs_ugi: str) -> None:
        """``fs_name``: file system URL for paths without a scheme (``"hdfs://nn:9000"``);
        ``fs_ugi``: ``"user,password"`` (the user goes to HDFS)."""
        for key, value in (("fs_name", fs_name), ("fs_ugi", fs_ugi)):
            if not isinstance(value, str):
                raise ConfigError(f"got {value!r}; expected a string", key=key)
        if fs_name and "://" not in fs_name:
            raise ConfigError(
                f"got {fs_name!r}; fs_name is a URL like 'hdfs://namenode:9000'", key="fs_name"
            )
        self.source = SourceConfig(self.pipe_command, self.source.download_cmd, fs_name, fs_ugi)

    def set_download_cmd(self, download_cmd: str) -> None:
        """``"cat"``: open files directly; else a file's bytes are ``<download_cmd> <path>``'s
        stdout."""
        if not isinstance(download_cmd, str) or not download_cmd.strip():
            raise ConfigError(
                f"got {download_cmd!r}; use a shell command or 'cat'", key="download_cmd"
            )
        self.source = SourceConfig(
            self.pipe_command, download_cmd, self.source.fs_name, self.source.fs_ugi
        )

    def set_fea_eval(self, record_candidate_size: int, fea_eval: bool = True) -> None:
        """Paddle's feature-evaluation switch for :meth:`slots_shuffle` (accepted; the shuffle
        permutes whole columns, so the candidate size is not needed)."""
        self.candidate_size = _positive_int(record_candidate_size, "record_candidate_size")
        self.fea_eval = bool(fea_eval)

    def set_filelist(self, filelist: Sequence[str]) -> None:
        """The files to read: local paths, globs, fsspec URLs (checked when a pass starts)."""
        if isinstance(filelist, (str, bytes)) or not isinstance(filelist, Sequence):
            raise ConfigError(
                f"got {type(filelist).__name__} {filelist!r}; set_filelist takes a "
                "list of file names, globs or URLs",
                key="filelist",
            )
        self.filelist = list(filelist)

    # -- passes ----------------------------------------------------------------------------------
    def _load_config(self, threads: int | None = None) -> LoadConfig:
        if not self.use_var:
            raise ConfigError(
                "no slots: call init(use_var=[fleet.data.Slot(...), ...]) first", key="use_var"
            )
        files = expand_filelist(self.filelist, self.source)
        spec = ParseSpec(self.use_var, int(self.parse_ins_id) + int(self.parse_content))
        return LoadConfig(
            tuple(files),
            spec,
            self.source,
            threads or self.thread_num,
            self.on_error is OnError.SKIP,
            self.block_bytes,
            self.queue_blocks,
            self._KIND,
        )

    def _batches_of(self, parts: Iterator[Columns], copy: bool = False) -> Iterator[Batch]:
        """Consecutive batches of ``batch_size`` over a stream of column chunks (``copy``: the
        chunks stay in use, a batch must not share their memory)."""
        size, pending, have = self.batch_size, [], 0
        for cols in parts:
            start, n = 0, cols.num_examples
            while n - start >= size - have:
                piece = cols.slice(start, start + size - have)
                start += size - have
                if pending:
                    yield make_batch(concat_columns(self.use_var, [*pending, piece]), copy=False)
                    pending, have = [], 0
                else:
                    yield make_batch(piece, copy=copy)
            if start < n:
                pending.append(cols.slice(start, n))
                have += n - start
        if pending and not self.drop_last:  # a lone piece is still a view of a chunk
            yield make_batch(concat_columns(self.use_var, pending), copy=copy and len(pending) == 1)


def skip_examples_of(parts: Iterator[Columns], skip: int) -> Iterator[Columns]:
    """``parts`` without their first ``skip`` examples (a resumed pass,
    :mod:`fleet.base.data_position`)."""
    for cols in parts:
        n = cols.num_examples
        if skip >= n:
            skip -= n
            continue
        yield cols.slice(skip, n) if skip else cols
        skip = 0


class QueueDataset(DatasetBase):
    """Paddle's ``QueueDataset``: streams the files through ``thread_num`` parser threads and
    bounded queues, one pass per iteration; never holds more than a few blocks of lines.

    With ``thread_num > 1`` blocks come in the order the parsers finish them (as Paddle, the
    order of examples varies between passes); ``thread_num=1`` keeps the file order. No shuffles
    (use :class:`~fleet.data.in_memory.InMemoryDataset`).
    """

    _KIND = "queue"

    def __iter__(self) -> Iterator[Batch]:
        skip = data_position.tracker().begin_pass()  # a resumed trainer skips what it trained
        if skip is None:
            return
        pipe = Pipeline(self._load_config())
        try:
            blocks = (block.columns for block in pipe.blocks())
            yield from lookahead.batches(
                self._batches_of(skip_examples_of(blocks, skip * self.batch_size))
            )
            self.skipped_lines = pipe.stats.skipped
            pipe.report()
        finally:
            pipe.close()

    def local_shuffle(self) -> None:
        """Not for a stream (Paddle's QueueDataset refuses it too)."""
        raise FleetNotImplementedError(
            "QueueDataset.local_shuffle", "use InMemoryDataset for local_shuffle"
        )

    def global_shuffle(self, fleet: Any = None, thread_num: int = 12) -> None:
        """Not for a stream (Paddle's QueueDataset refuses it too)."""
        raise FleetNotImplementedError(
            "QueueDataset.global_shuffle", "use InMemoryDataset for global_shuffle"
        )


__all__ = ["DatasetBase", "OnError", "QueueDataset"]
