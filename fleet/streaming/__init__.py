"""Online (day/pass) training on the parameter server: ``fleet.train_days`` and
:class:`StreamingTrainer` (:mod:`fleet.streaming.loop`: per pass progressive AUC, one pass of
``train_from_dataset``, a delta save; per day ``end_day``, ``shrink``, a base; the resume after a
restart, and under fleetrun's ``--ps_checkpoint_dir`` the job's checkpoints cut at pass
boundaries and the recovery from them), its donefile (:mod:`fleet.streaming.donefile`), and
Paddle's ``load_model`` / ``save_cache_model``.
"""

from __future__ import annotations

from fleet.streaming.donefile import BASE_PASS, DONEFILE, DoneRecord, read_donefile
from fleet.streaming.loop import (
    PassResult,
    StreamingConfig,
    StreamingTrainer,
    list_passes,
    load_model,
    save_cache_model,
    train_days,
)

__all__ = [
    "BASE_PASS",
    "DONEFILE",
    "DoneRecord",
    "PassResult",
    "StreamingConfig",
    "StreamingTrainer",
    "list_passes",
    "load_model",
    "read_donefile",
    "save_cache_model",
    "train_days",
]
