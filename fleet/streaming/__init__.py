"""Online (day/pass) training on the parameter server: ``fleet.train_days`` and
:class:`StreamingTrainer`.

Owns :mod:`fleet.streaming.loop` (the loop: per pass progressive AUC, one pass of
``train_from_dataset``, a delta save; per day ``end_day``, ``shrink``, a base),
:mod:`fleet.streaming.checkpoints` (the resume after a restart, and under fleetrun's
``--ps_checkpoint_dir`` the job's checkpoints cut at pass boundaries and the recovery from them),
:mod:`fleet.streaming.config` (:class:`StreamingConfig`, :class:`PassResult`, the day/pass
folders), :mod:`fleet.streaming.model_io` (Paddle's ``load_model`` / ``save_cache_model``) and
:mod:`fleet.streaming.donefile` (the donefile).
"""

from __future__ import annotations

from fleet.streaming.config import PassResult, StreamingConfig, list_passes
from fleet.streaming.donefile import BASE_PASS, DONEFILE, DoneRecord, read_donefile
from fleet.streaming.loop import StreamingTrainer, train_days
from fleet.streaming.model_io import load_model, save_cache_model

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
