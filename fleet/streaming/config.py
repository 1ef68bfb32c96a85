"""What the online day/pass loop streams and measures: :class:`StreamingConfig` (one per job,
every trainer the same), :class:`PassResult` (one pass's AUCs, examples and times),
:func:`list_passes` (the day and pass folders under ``data_root``) and the run's plan of them.
The loop itself is :mod:`fleet.streaming.loop`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from collective.errors import ConfigError
from fleet.streaming.donefile import DoneRecord


@dataclass(frozen=True)
class StreamingConfig:
    """What :func:`~fleet.streaming.loop.train_days` streams and where it saves (one per job;
    every trainer the same)."""

    data_root: str
    """Folder of day folders, each holding pass folders of slot files."""
    output_dir: str
    """Where deltas and bases go (``<day>/delta-<pass>``, ``<day>/base``: paths on the servers'
    file system, under their checkpoint roots) and the donefile (written by trainer 0)."""
    days: tuple[str, ...] = ()
    """Day folders to train, in order (empty: every folder of ``data_root``, sorted)."""
    file_pattern: str = "part-*"
    """Glob of a pass's files inside its folder."""
    progressive_validation: bool = True
    """Evaluate the model on each pass before training on it (the pass's progressive AUC)."""
    save_delta: bool = True
    """Save a delta (``save_persistables(mode=1)``) after each pass. Off, a resume can only
    restart from a day's base (or a job checkpoint)."""
    shrink_unseen_days: int | None = 30
    """``fleet.shrink`` at the end of each day: rows unseen for more days are evicted
    (None: no shrink)."""
    checkpoint_dir: str = ""
    """Job checkpoints after every save, in this directory ("" : off). Under fleetrun's
    ``--ps_checkpoint_dir`` leave it empty: the loop cuts the job's checkpoints there."""
    checkpoint_keep: int = 2
    """Job checkpoints kept."""
    resume: bool = True
    """Continue after the donefile's last record (False: refuse a non-empty donefile)."""
    label: str = "click"
    """The label slot of the datasets' batches."""
    print_period: int = 100
    """Batches between progress lines of ``train_from_dataset``."""
    max_passes: int | None = None
    """Stop after this many passes trained in this run (smoke runs; None: all)."""

    def __post_init__(self) -> None:
        if not self.data_root or not self.output_dir:
            raise ConfigError("data_root and output_dir must be set", key="data_root/output_dir")
        if self.shrink_unseen_days is not None and self.shrink_unseen_days < 0:
            raise ConfigError(
                f"must be None or >= 0, got {self.shrink_unseen_days!r}", key="shrink_unseen_days"
            )
        if self.max_passes is not None and self.max_passes < 0:
            raise ConfigError(f"must be None or >= 0, got {self.max_passes!r}", key="max_passes")
        if self.checkpoint_keep < 0:
            raise ConfigError(f"must be >= 0, got {self.checkpoint_keep!r}", key="checkpoint_keep")


@dataclass(frozen=True)
class PassResult:
    """What one pass measured (``auc`` values over every trainer)."""

    day: str
    pass_id: str
    examples: int
    """Examples trained on, every trainer together."""
    progressive_auc: float
    """AUC of the model on the pass before training on it (nan when off)."""
    train_auc: float
    """AUC of the predictions made while training (``TrainStats.auc``)."""
    train_seconds: float
    """Wall time of ``train_from_dataset`` (slowest trainer)."""
    pass_seconds: float
    """Wall time of the whole pass: dataset, validation, training, delta save."""
    save_path: str = ""

    @property
    def examples_per_second(self) -> float:
        """Training throughput of the pass, every trainer together."""
        return self.examples / self.train_seconds if self.train_seconds > 0 else math.nan


@dataclass
class _Plan:
    """The day/pass folders, and what the donefile says is done."""

    days: list[tuple[str, list[str]]]
    records: list[DoneRecord] = field(default_factory=list)


def list_passes(config: StreamingConfig) -> list[tuple[str, list[str]]]:
    """``[(day, [pass, ...]), ...]`` under ``data_root`` (folders, sorted by name)."""
    root = config.data_root
    if not os.path.isdir(root):
        raise ConfigError(
            f"{root!r} is not a directory: write day/pass folders of slot files "
            "there (examples/ctr/gen_slot_files.py --days ... --passes ...)",
            key="data_root",
        )
    days = list(config.days) or sorted(
        d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))
    )
    out = []
    for day in days:
        folder = os.path.join(root, day)
        if not os.path.isdir(folder):
            raise ConfigError(f"day {day!r} has no folder {folder!r}", key="days")
        passes = sorted(p for p in os.listdir(folder) if os.path.isdir(os.path.join(folder, p)))
        if not passes:
            raise ConfigError(f"day folder {folder!r} has no pass folders", key="data_root")
        out.append((day, passes))
    if not out:
        raise ConfigError(f"{root!r} has no day folders", key="data_root")
    return out


__all__ = ["PassResult", "StreamingConfig", "list_passes"]
