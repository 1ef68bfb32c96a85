"""Paddle's ``InMemoryDataset`` on torch: load the files into columnar memory, shuffle locally or
across every trainer, iterate batches.

::

    ds = fleet.InMemoryDataset()
    ds.init(batch_size=512, thread_num=2, use_var=slots, pipe_command="cat")
    ds.set_filelist(fleet.util.get_file_shard(files))
    ds.load_into_memory()
    ds.global_shuffle(fleet)                      # examples move between all trainers
    print(ds.get_memory_data_size(fleet))         # summed over trainers
    for batch in ds: ...

Paddle's public methods and what they do here:

==========================================  ====================================================
method                                      here
==========================================  ====================================================
load_into_memory(is_shuffle=False)          parse every file (compiled, ``thread_num`` threads)
                                            and append to memory; all or nothing: a failing
                                            load leaves the examples loaded before it intact;
                                            ``is_shuffle=True`` shuffles locally afterwards
preload_into_memory(thread_num=None)        the same load on a background thread ...
wait_preload_done()                         ... joined here (its error raised here)
local_shuffle()                             a random order of this trainer's examples
global_shuffle(fleet=None, thread_num=12)   examples dealt out at random over every trainer of
                                            the ``torch.distributed`` job (``fleet`` and
                                            ``thread_num`` accepted, not needed: the process
                                            group is used whenever there is one; without one
                                            it is a local shuffle)
get_memory_data_size(fleet=None)            examples held; with any ``fleet`` (e.g. the
                                            ``fleet`` module) summed over every trainer
get_shuffle_data_size(fleet=None)           examples held after the last shuffle (0 before
                                            one); summed likewise
release_memory()                            drop the examples
slots_shuffle(slots)                        permute the named slots' values across examples
                                            (feature importance; ``fea_eval`` not required)
set_shuffle_seed(seed) (ours)               reproducible shuffles
set_date, tdm_sample                        refused (FleetNotImplementedError): PSLib/TDM
==========================================  ====================================================

Memory: chunks of columns (:mod:`fleet.data.columns`): an example costs its payload plus 8 B
per sparse slot. Shuffles move the examples (column by column: the peak is the data plus one
column), so batches are slices, shuffled or not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from collective.errors import ConfigError, FleetNotImplementedError
from fleet.base import data_position, lookahead
from fleet.data import shuffle
from fleet.data.batch import Batch
from fleet.data.columns import Columns, permute_chunks, trim_heap
from fleet.data.dataset import DatasetBase, skip_examples_of
from fleet.data.loader import LoadConfig, Pipeline

logger = logging.getLogger(__name__)


class InMemoryDataset(DatasetBase):
    """Paddle's ``InMemoryDataset`` (module docstring); settings as
    :class:`~fleet.data.dataset.DatasetBase`."""

    _KIND = "inmemory"

    def __init__(self) -> None:
        super().__init__()
        self._chunks: list[Columns] = []
        """The examples: parsed blocks in file order, or the chunks of the last shuffle."""
        self._shuffled = 0
        self._seed: int | None = None
        self._round = 0
        self._preload: threading.Thread | None = None
        self._preload_result: tuple[list[Columns], int, BaseException | None] | None = None

    # -- loading ---------------------------------------------------------------------------------
    def _load(self, cfg: LoadConfig) -> tuple[list[Columns], int]:
        """(chunks of every file's examples in file order, lines skipped); raises on failure."""
        pipe = Pipeline(cfg)
        try:
            blocks = sorted(pipe.blocks())
            pipe.report()
        finally:
            pipe.close()
        trim_heap()
        return [b.columns for b in blocks if b.columns.num_examples], pipe.stats.skipped

    def _append(self, chunks: list[Columns], skipped: int) -> None:
        self._chunks.extend(chunks)
        self.skipped_lines = skipped

    def load_into_memory(self, is_shuffle: bool = False) -> None:
        """Read every file of the list into memory, appended to what is there."""
        self._check_no_preload("load_into_memory")
        cols, skipped = self._load(self._load_config())
        self._append(cols, skipped)
        if is_shuffle:
            self.local_shuffle()

    def preload_into_memory(self, thread_num: int | None = None) -> None:
        """Start :meth:`load_into_memory` on a background thread (``thread_num`` parser threads,
        default the dataset's); :meth:`wait_preload_done` finishes it."""
        self._check_no_preload("preload_into_memory")
        if thread_num is not None:
            thread_num = int(thread_num)
            if thread_num < 1:
                raise ConfigError(f"got {thread_num}; expected >= 1", key="thread_num")
        cfg = self._load_config(thread_num)

        def run() -> None:
            try:
                chunks, skipped = self._load(cfg)
                self._preload_result = (chunks, skipped, None)
            except BaseException as err:  # noqa: BLE001 - raised by wait_preload_done
                self._preload_result = ([], 0, err)

        self._preload_result = None
        self._preload = threading.Thread(target=run, name="fleet-data-preload", daemon=True)
        self._preload.start()

    def wait_preload_done(self) -> None:
        """Wait for :meth:`preload_into_memory`; raises its error, if any."""
        if self._preload is None:
            raise ConfigError(
                "no preload is running: call preload_into_memory() first", key="wait_preload_done"
            )
        self._preload.join()
        self._preload = None
        result, self._preload_result = self._preload_result, None
        assert result is not None
        chunks, skipped, err = result
        if err is not None:
            raise err
        self._append(chunks, skipped)

    def _check_no_preload(self, what: str) -> None:
        if self._preload is not None:
            raise ConfigError(
                f"{what}() while a preload runs: call wait_preload_done() first",
                key="preload_into_memory",
            )

    def release_memory(self) -> None:
        """Drop every example (and the shuffle order)."""
        self._check_no_preload("release_memory")
        self._chunks, self._shuffled = [], 0
        trim_heap()

    # -- sizes -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Examples held by this trainer."""
        return sum(c.num_examples for c in self._chunks)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays holding the examples."""
        return sum(c.nbytes for c in self._chunks)

    def get_memory_data_size(self, fleet: Any = None) -> int:
        """Examples held by this trainer, or (any truthy ``fleet``) summed over every trainer
        (a collective then: every trainer calls it). A trainer that resumed from a checkpoint
        counts only the examples its next pass has left (:mod:`fleet.base.data_position`)."""
        n = len(self)
        n -= data_position.skip_examples(self.batch_size, n)
        return shuffle.sum_over_trainers(n) if fleet else n

    def get_shuffle_data_size(self, fleet: Any = None) -> int:
        """Examples held after the last local or global shuffle (0 before any), summed over every
        trainer with a truthy ``fleet``."""
        return shuffle.sum_over_trainers(self._shuffled) if fleet else self._shuffled

    # -- shuffles --------------------------------------------------------------------------------
    def set_shuffle_seed(self, seed: int | None) -> None:
        """Seed of the following shuffles (None: fresh randomness). With a seed, shuffle ``k``
        on trainer ``r`` is a fixed function of ``(seed, r, k)``."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ConfigError(f"got {seed!r}; use an int >= 0 or None", key="shuffle_seed")
        self._seed, self._round = seed, 0

    def _rng(self) -> np.random.Generator:
        self._round += 1
        return shuffle.make_rng(self._seed, shuffle.world()[0], self._round)

    def local_shuffle(self) -> None:
        """Put this trainer's examples in a random order."""
        self._check_no_preload("local_shuffle")
        n = len(self)
        self._chunks = permute_chunks(self._chunks, self._rng().permutation(n))
        trim_heap()
        self._shuffled = n

    def global_shuffle(self, fleet: Any = None, thread_num: int = 12) -> None:
        """Deal the examples of every trainer out to all of them at random
        (:func:`fleet.data.shuffle.exchange`); each ends with a near-equal random share. A
        collective: every trainer calls it."""
        self._check_no_preload("global_shuffle")
        if shuffle.world()[1] == 1:
            self.local_shuffle()
            return
        t0, before = time.perf_counter(), len(self)
        chunks, self._chunks, self._shuffled = self._chunks, [], 0
        rng = self._rng()
        # the exchange drops each column once sent: a failure (a trainer gone) loses the data
        received = shuffle.exchange(chunks, self.use_var, rng)
        trim_heap()
        n = received.num_examples
        self._chunks = permute_chunks([received], rng.permutation(n)) if n else []
        trim_heap()
        self._shuffled = n
        logger.info(
            "global shuffle over %d trainers: %d examples here before, %d after (%.2f s)",
            shuffle.world()[1],
            before,
            n,
            time.perf_counter() - t0,
        )

    def slots_shuffle(self, slots: Sequence[str]) -> None:
        """Permute the values of the named slots across this trainer's examples (Paddle's
        feature-importance evaluation: train or evaluate again and compare the AUC)."""
        names = [s.name for s in self.use_var]
        if isinstance(slots, str):
            slots = [slots]
        unknown = [s for s in slots if s not in names]
        if unknown:
            raise ConfigError(f"unknown slots {unknown}; use_var has {names}", key="slots")
        rng = self._rng()
        for name in sorted(set(slots), key=names.index):
            shuffle.permute_slot(self._chunks, names.index(name), rng)

    def set_date(self, date: str) -> None:
        """Paddle's PSLib pass date: not here."""
        raise FleetNotImplementedError(
            "InMemoryDataset.set_date (PSLib passes)", "fleetrun's PS has no dated passes"
        )

    def tdm_sample(self, *args: Any, **kwargs: Any) -> None:
        """Paddle's TDM tree sampling: not here."""
        raise FleetNotImplementedError("InMemoryDataset.tdm_sample (TDM tree sampling)")

    # -- batches ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        """Batches of ``batch_size`` in the loaded order, or the last shuffle's (a trainer that
        resumed from a checkpoint skips the batches it trained: :mod:`fleet.base.data_position`)."""
        skip = data_position.tracker().begin_pass()
        if skip is None:
            return
        parts = skip_examples_of(iter(list(self._chunks)), skip * self.batch_size)
        yield from lookahead.batches(self._batches_of(parts, copy=True))


__all__ = ["InMemoryDataset"]
