"""Resuming an elastic job at any world size: ``fleet.elastic.Checkpointer`` and
``fleet.elastic.ElasticSampler``.

An elastic job (``fleetrun --nnodes MIN:MAX``) restarts its workers whenever the membership
changes, with a new world size; each worker resumes from the newest checkpoint::

    sampler = fleet.elastic.ElasticSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True)
    ckpt = fleet.elastic.Checkpointer(model, opt, "/shared/ckpt", every_steps=50)
    resume = ckpt.restore()                  # step 0, epoch 0, offset 0 on a fresh start
    step, epoch, offset = resume.step, resume.epoch, resume.offset
    while step < total_steps:
        sampler.set_epoch(epoch, offset)     # the rest of the epoch, split over today's ranks
        for x, y in loader:
            ...forward, backward, opt.step(), opt.zero_grad()...
            step, offset = step + 1, offset + len(x) * fleet.worker_num()
            ckpt.step(step, epoch=epoch, offset=offset)   # saves every ``every_steps``
            if step == total_steps: break
        epoch, offset = epoch + 1, 0

What a checkpoint holds: the model and optimizer state through :func:`fleet.save_checkpoint`
(so it loads at any data-parallel degree, and for sharding stages 1/2 the partitioned optimizer
state is resharded over the new owners), the step, the data position (``epoch`` and ``offset``,
the samples of that epoch already consumed by all ranks together), an optional LR scheduler's
state and any JSON ``extra`` the script passes.

On disk (``dir`` must be one directory every rank sees: local on one machine, shared storage
across nodes)::

    <dir>/step_00000050/   fleet checkpoint files + elastic.json (written last)
    <dir>/step_00000100/
    <dir>/.tmp-step_00000150/   a save in progress (never read; removed by the next restore)

A save writes into the temporary directory (rank 0 alone writes replicated state — all of a
data-parallel job's; each sharding owner its optimizer shard), every file is fsynced, rank 0
writes ``elastic.json`` atomically, renames the directory to its final name and fsyncs ``dir``:
after a crash a ``step_*`` directory is complete or absent. The newest ``keep`` are kept.

Why our own sampler: torch's ``DistributedSampler`` splits a whole epoch's permutation by rank,
so the samples still to come after ``k`` steps depend on the world size; torch's
``ElasticDistributedSampler`` skips a prefix of the *dataset*, not of the epoch's shuffled
order. :class:`ElasticSampler` shuffles as ``DistributedSampler`` does (``seed + epoch``), skips
the ``offset`` samples already consumed and splits the rest over the current ranks, so with a
fixed global batch (per-rank batch x world size) the job sees the same global batches whatever
world size it resumes at.

Where we differ from Paddle: Paddle 2.1's elastic mode restarts the script and leaves resuming
to it (``paddle.save`` / ``load`` of the state dicts); this module is that pattern, packaged.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from collections.abc import Iterator, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch.utils.data import DistributedSampler

from collective.errors import ConfigError
from fleet.checkpoint import load_checkpoint, save_checkpoint
from ps_server.checkpoint.files import fsync_dir, write_json_atomic

logger = logging.getLogger(__name__)

STATE_FILE = "elastic.json"
"""Written last into a checkpoint directory: the step, data position and world size."""
SCHEDULER_FILE = "lr_scheduler.pt"
"""The LR scheduler's ``state_dict`` (when the Checkpointer was given one)."""
FORMAT = "fleet-elastic-checkpoint"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


@dataclass(frozen=True)
class ResumePoint:
    """Where training resumes: what :meth:`Checkpointer.restore` found (zeros on a fresh
    start)."""

    step: int = 0
    """Optimizer steps already done."""
    epoch: int = 0
    """The epoch the next batch belongs to."""
    offset: int = 0
    """Samples of ``epoch`` already consumed, by all ranks together."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The JSON ``extra`` the script passed at that save."""
    path: str | None = None
    """The checkpoint directory restored from (None on a fresh start)."""
    saved_world_size: int | None = None
    """The world size of the job that saved it."""


def _rank() -> int:
    return tdist.get_rank() if tdist.is_initialized() else 0


def _world() -> int:
    return tdist.get_world_size() if tdist.is_initialized() else 1


def _from_rank0(value: Any) -> Any:
    """``value`` as rank 0 has it, on every rank."""
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return value
    box = [value]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints in ``root`` (a ``step_*`` directory holding elastic.json), oldest
    first."""
    out = []
    if not root.is_dir():
        return out
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and (entry / STATE_FILE).is_file():
            out.append((int(m.group(1)), entry))
    return sorted(out)


def _fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and every directory, deepest first."""
    for dirpath, _, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


class Checkpointer:
    """Periodic, atomic checkpoints of a training job that restore at any data-parallel world
    size (plain DP, sharding stages 1 and 2; see the module docstring for the loop).

    ``model`` / ``optimizer``: what ``fleet.distributed_model`` / ``fleet.distributed_optimizer``
    returned. ``dir``: the checkpoint root, shared by every rank. ``every_steps``: :meth:`step`
    saves when the step count is a multiple of it. ``keep``: how many checkpoints to keep
    (the newest). ``lr_scheduler``: saved and restored with the rest when given.
    Every method is collective: every rank calls it with the same arguments.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        dir: str | os.PathLike,
        every_steps: int,
        *,
        keep: int = 2,
        lr_scheduler: Any = None,
    ) -> None:
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ConfigError(
                f"must be a positive number of steps, got {every_steps!r}; "
                "pass e.g. every_steps=100",
                key="every_steps",
            )
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(
                f"must keep at least 1 checkpoint, got {keep!r}; pass keep=2 to "
                "keep the newest two",
                key="keep",
            )
        if not str(dir):
            raise ConfigError("is empty; pass the directory checkpoints go to", key="dir")
        self.model = model
        self.optimizer = optimizer
        self.dir = Path(dir)
        self.every_steps = every_steps
        self.keep = keep
        self.lr_scheduler = lr_scheduler
        self.last_saved_step: int | None = None

    # ---- restore -----------------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest committed checkpoint directory (as rank 0 sees it), or None."""
        found = _step_dirs(self.dir) if _rank() == 0 else []
        newest = _from_rank0(str(found[-1][1]) if found else None)
        return Path(newest) if newest else None

    def restore(self) -> ResumePoint:
        """Load the newest checkpoint into the model, optimizer (and LR scheduler) and return
        where to resume; a :class:`ResumePoint` of zeros when ``dir`` holds none. Removes what
        a crashed save left behind."""
        choice: Any = None
        if _rank() == 0:
            self._remove_leftovers()
            found = _step_dirs(self.dir)
            if found:
                path = found[-1][1]
                choice = (str(path), self._read_state(path))
        choice = _from_rank0(choice)
        if choice is None:
            logger.info("no checkpoint in %s: starting at step 0", self.dir)
            return ResumePoint()
        path, state = choice
        load_checkpoint(path, self.model, self.optimizer)
        if self.lr_scheduler is not None:
            sched = Path(path) / SCHEDULER_FILE
            if not sched.is_file():
                raise ConfigError(
                    f"checkpoint {path} has no LR scheduler state ({SCHEDULER_FILE})"
                    "; it was saved without lr_scheduler=, pass none to restore it",
                    key="lr_scheduler",
                )
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=False))
        self.last_saved_step = int(state["step"])
        point = ResumePoint(
            step=int(state["step"]),
            epoch=int(state["epoch"]),
            offset=int(state["offset"]),
            extra=dict(state.get("extra") or {}),
            path=path,
            saved_world_size=int(state["world_size"]),
        )
        logger.info(
            "resumed from %s: step %d, epoch %d, offset %d (saved at world size %d, now %d)",
            path,
            point.step,
            point.epoch,
            point.offset,
            point.saved_world_size,
            _world(),
        )
        return point

    @staticmethod
    def _read_state(path: Path) -> dict[str, Any]:
        try:
            state = json.loads((path / STATE_FILE).read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"cannot read {path / STATE_FILE}: {err}; remove {path} to resume "
                "from the checkpoint before it",
                key="dir",
            ) from None
        if state.get("format") != FORMAT or state.get("format_version") != FORMAT_VERSION:
            raise ConfigError(
                f"{path / STATE_FILE} is not a {FORMAT} of version {FORMAT_VERSION} "
                f"(format {state.get('format')!r}, version {state.get('format_version')!r}); "
                "point dir= at a directory of fleet.elastic checkpoints",
                key="dir",
            )
        return state

    def _remove_leftovers(self) -> None:
        """Rank 0: delete temporary directories of saves that never finished."""
        if not self.dir.is_dir():
            return
        for entry in self.dir.iterdir():
            if entry.name.startswith((_TMP_PREFIX, _OLD_PREFIX)) and entry.is_dir():
                logger.warning("removing %s (a checkpoint save that did not finish)", entry)
                shutil.rmtree(entry, ignore_errors=True)

    # ---- save --------------------------------------------------------------------------------

    def step(
        self, step: int, *, epoch: int = 0, offset: int = 0, extra: dict[str, Any] | None = None
    ) -> bool:
        """Call after optimizer step number ``step`` (counting from 1): saves when ``step`` is a
        multiple of ``every_steps``. Returns whether it saved."""
        if step % self.every_steps != 0 or step == self.last_saved_step:
            return False
        self.save(step, epoch=epoch, offset=offset, extra=extra)
        return True

    def save(
        self, step: int, *, epoch: int = 0, offset: int = 0, extra: dict[str, Any] | None = None
    ) -> Path:
        """Save now, as checkpoint ``step`` (the data position: the next batch is of ``epoch``,
        ``offset`` samples of it consumed by all ranks together). Returns its directory."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"must be a step count >= 0, got {step!r}", key="step")
        if offset < 0 or epoch < 0:
            raise ConfigError(
                f"epoch and offset must be >= 0, got epoch={epoch!r}, offset={offset!r}",
                key="offset",
            )
        try:
            json.dumps(extra or {})
        except TypeError as err:
            raise ConfigError(
                f"must be JSON data (numbers, strings, lists, dicts): {err}", key="extra"
            ) from None
        final = self.dir / f"step_{step:08d}"
        tmp = self.dir / f"{_TMP_PREFIX}{final.name}"
        error = None
        if _rank() == 0:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as err:
                error = f"cannot create {tmp}: {err}"
        error = _from_rank0(error)  # also: nobody writes before the directory exists
        if error:
            raise ConfigError(f"{error}; pass a writable directory every rank sees", key="dir")
        save_checkpoint(tmp, self.model, self.optimizer, single_writer=True)  # ends in a barrier
        if _rank() == 0:
            try:
                self._commit(tmp, final, step, epoch, offset, extra or {})
            except OSError as err:
                error = f"cannot commit checkpoint {final}: {err}"
        error = _from_rank0(error)
        if error:
            raise ConfigError(
                f"{error}; check the space and permissions of the directory", key="dir"
            )
        self.last_saved_step = step
        logger.info("saved checkpoint %s (epoch %d, offset %d)", final, epoch, offset)
        return final

    def _commit(
        self, tmp: Path, final: Path, step: int, epoch: int, offset: int, extra: dict[str, Any]
    ) -> None:
        """Rank 0: make the written checkpoint durable and visible, then prune old ones."""
        if self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), tmp / SCHEDULER_FILE)
        _fsync_tree(tmp)  # DCP fsyncs its data files; the manifests it does not
        write_json_atomic(
            tmp / STATE_FILE,
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "step": step,
                "epoch": epoch,
                "offset": offset,
                "world_size": _world(),
                "extra": extra,
            },
        )
        old = None
        if final.exists():  # the same step saved again (e.g. an explicit save at the end)
            old = final.with_name(f"{_OLD_PREFIX}{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        for _, path in _step_dirs(self.dir)[: -self.keep]:
            doomed = path.with_name(f"{_OLD_PREFIX}{path.name}")
            os.rename(path, doomed)  # never a half-deleted directory that looks complete
            shutil.rmtree(doomed, ignore_errors=True)


class ElasticSampler(DistributedSampler):
    """A ``DistributedSampler`` whose position in an epoch survives a change of world size.

    ``set_epoch(epoch, offset)``: the epoch's permutation (``seed + epoch``, as
    ``DistributedSampler``), without its first ``offset`` samples (consumed before the restart,
    by all ranks together), split over the current ranks: rank ``r`` of ``W`` takes every
    ``W``-th sample from ``r``. With a per-rank batch ``B`` and ``drop_last``, global batch
    ``k`` after the offset is the permutation's samples ``offset + k*B*W ... + (k+1)*B*W``
    whatever ``W`` is. ``drop_last=False`` pads the rest to a multiple of ``W`` with its first
    samples, as ``DistributedSampler`` does.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.offset = 0
        self._resize()

    def set_epoch(self, epoch: int, offset: int = 0) -> None:  # type: ignore[override]
        """Iterate epoch ``epoch`` from sample ``offset`` of its order (0: the whole epoch)."""
        size = len(self.dataset)  # type: ignore[arg-type]
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= size:
            raise ConfigError(
                f"must be between 0 and the dataset's {size} samples, got "
                f"{offset!r}; pass the offset the Checkpointer restored",
                key="offset",
            )
        self.epoch = epoch
        self.offset = offset
        self._resize()

    def _resize(self) -> None:
        rest = len(self.dataset) - self.offset  # type: ignore[arg-type]
        if self.drop_last:
            self.num_samples = rest // self.num_replicas
        else:
            self.num_samples = math.ceil(rest / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        size = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(size, generator=g).tolist()
        else:
            order = list(range(size))
        rest = order[self.offset :]
        if self.drop_last:
            rest = rest[: self.total_size]
        elif rest:
            pad = self.total_size - len(rest)
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
        return iter(rest[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


__all__ = ["Checkpointer", "ElasticSampler", "ResumePoint"]
