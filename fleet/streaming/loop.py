"""Online (day/pass) training on the parameter server: ``fleet.train_days`` and
:class:`StreamingTrainer`.

This module owns the loop (:class:`StreamingTrainer`: passes, days, progressive validation;
:func:`train_days`). Its configuration and results are in :mod:`fleet.streaming.config`, its
saves, job checkpoints and resume in :mod:`fleet.streaming.checkpoints` (the trainer's base
class), Paddle's ``load_model`` / ``save_cache_model`` in :mod:`fleet.streaming.model_io` and the
donefile in :mod:`fleet.streaming.donefile`; the public names are importable from here too.

The loop Paddle's online trainers write by hand around ``fleet.save_persistables(mode=...)``,
``fleet.shrink`` and day/pass folders of slot files (``data_root/<day>/<pass>/part-*``)::

    for day in days:
        for pass in passes(day):                      # e.g. 20261120/00 .. 20261120/23
            files = fleet.util.get_file_shard(files of the pass)
            dataset = make_dataset(files)             # a fleet.data dataset, loaded
            progressive AUC: the current model on the pass, BEFORE training on it
            fleet.train_from_dataset(model, optimizer, dataset, loss_fn)
            fleet.save_persistables(output_dir/<day>/delta-<pass>, mode=1)   # rows changed since the last save
            donefile += (day, pass, path, "delta")
        fleet.end_day(); fleet.shrink(unseen_days)    # unseen_days + 1 for rows not pushed today; evict old rows
        fleet.save_persistables(output_dir/<day>/base, mode=0)               # the model entering the next day
        donefile += (day, -1, path, "base")

Every trainer calls :func:`train_days` with the same arguments; trainer 0 writes the donefile
(``output_dir/donefile.txt``, one tab-separated line per save, as Paddle's ``FleetUtil``
donefiles: ``day  pass  path  kind``; pass ``-1`` is a day's base) after the save it names is
complete.

**Order at the end of a day.** ``end_day`` and ``shrink`` run *before* the base is saved, so the
base is exactly the model the next day starts from: resuming from it, or serving it, needs no
replay, and the next day's deltas follow it directly.

**Resume.** Started again with the same ``output_dir`` (a crashed or restarted job: fresh, empty
servers), the loop reads the donefile, restores the model from the newest base and the deltas
after it, loaded in order (``PSClient.load`` of a delta updates the tables; its deleted keys and
``end_day`` calls are replayed), and continues after the last recorded save. A day whose passes
are all recorded but whose base is not gets its ``end_day`` / ``shrink`` / base first.

**Job checkpoints.** With ``checkpoint_dir`` a job checkpoint (:func:`fleet.ps.checkpoint`: one
consistent cut of every server, a full copy) follows every donefile record, its trainer state
naming the record; resuming then loads the newest good checkpoint (:func:`fleet.ps.load_latest`)
and replays only the deltas recorded after it (a few deltas instead of a base and a day of
them).

**fleetrun's automatic checkpoints** (``--ps_checkpoint_dir``; :mod:`fleet.ps.auto_checkpoint`).
The loop cuts the job's checkpoints at its own boundaries instead of every ``interval_s``: once
when the stream starts, then after every save (a delta, a base) *before* its donefile record, so
a record is published only once a checkpoint holds it. The trainer state carries the stream
position (records done and the last one, phase ``start``/``pass``/``day``, the last pass's
AUCs). After fleetrun restarts every process (servers restored from the newest good cut at
``distributed_optimizer``) the loop reconciles the donefile with the cut (appends the cut's
last record if missing, drops records after it), skips done passes and trains the pass in
progress again (at most one pass redone); a day's ``end_day``/``shrink``/base run once. Why
boundaries only: a job checkpoint does not hold the servers' delta change log, so servers
restored from a cut inside a pass (all of them, or one restarted alone in async/GEO mode) would
write a next delta missing the rows changed before the cut; at a boundary that log is empty. A
server restarted alone while a pass trains restores the last cut (its shard loses the pass's
updates so far, the delta chain stays exact). A dead trainer restarts every process: trainer 0
is marked not restartable alone (its replayed script would redo its saves and loads). A save,
``end_day``, ``shrink`` or cut that fails (a server down) raises: fleetrun then recovers the job
from the last cut (one more unit of ``--max_restarts``).

Where we differ from Paddle: one helper instead of the hand-written loop; the dataset comes
from a factory (``make_dataset(files)``) so any ``fleet.data`` dataset fits; progressive
validation is built in; ``mode=2`` (xbox/serving base) is :func:`fleet.ps.export_serving` /
:func:`save_cache_model` (a read-only copy with ``min_show``), not a save mode.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

import torch

import fleet.metrics as metrics
from collective.errors import ConfigError
from fleet.ps import runtime as ps_runtime
from fleet.streaming.checkpoints import StreamCheckpoints
from fleet.streaming.config import PassResult, StreamingConfig, _Plan, list_passes
from fleet.streaming.donefile import BASE_PASS, DoneRecord, read_donefile
from fleet.streaming.model_io import _from_rank0, _is_rank0, load_model, save_cache_model
from fleet.train_loop import positive_scores, train_from_dataset

logger = logging.getLogger(__name__)


def _lookahead(
    dataset: Iterable[Mapping[str, Any]], prefetch: Callable[[Mapping[str, Any]], None]
) -> Iterable[Mapping[str, Any]]:
    """``dataset``'s batches, each yielded after ``prefetch`` saw the one after it."""
    it = iter(dataset)
    current = next(it, None)
    while current is not None:
        following = next(it, None)
        if following is not None:
            prefetch(following)
        yield current
        current = following


class StreamingTrainer(StreamCheckpoints):
    """The day/pass loop of the module docstring for one model (see :func:`train_days`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        make_dataset: Callable[[list[str]], Iterable[Mapping[str, Any]]],
        config: StreamingConfig,
        *,
        on_pass: Callable[[PassResult], None] | None = None,
        prefetch: Callable[[Mapping[str, Any]], None] | None = None,
        out: TextIO | None = None,
    ) -> None:
        """``make_dataset(files)``: a dataset over this trainer's files of one pass, ready to
        iterate (loaded, for an InMemoryDataset); it is iterated twice with progressive
        validation. ``on_pass``: called on every trainer after each pass. ``prefetch``: called
        with the next training batch before the current one trains (e.g. ``lambda b:
        emb.prefetch(ids of b)``: async modes pull its rows during this step). ``out``: where the
        per-pass lines go (default stderr on trainer 0)."""
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.make_dataset, self.config, self.on_pass = make_dataset, config, on_pass
        self.prefetch = prefetch
        self.out = out if out is not None else (sys.stderr if _is_rank0() else None)
        self.checkpoint_dir = config.checkpoint_dir
        self.auto = ps_runtime._require(
            "train_days()"
        ).auto_checkpoint  # None: no --ps_checkpoint_dir
        if self.auto is not None and config.checkpoint_dir:
            raise ConfigError(
                f"checkpoint_dir={config.checkpoint_dir!r} and fleetrun's --ps_checkpoint_dir "
                f"({self.auto.cfg.dir}) would both restore the servers: under fleetrun leave "
                "checkpoint_dir empty (the loop cuts the job's checkpoints at its pass boundaries)",
                key="checkpoint_dir",
            )
        self.cut_step = -1  # step of the last automatic checkpoint (cuts get increasing steps)
        self._publisher: threading.Thread | None = None  # trainer 0: record after its cut commits
        self._publish_error: BaseException | None = None
        self.last_pass: dict[str, Any] = {}
        self.resumed_at: tuple[str, str] | None = None  # (day, pass) of the cut resumed from

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> list[PassResult]:
        """Train every pass not yet in the donefile; returns this run's passes."""
        cfg = self.config
        plan = _Plan(
            list_passes(cfg),
            _from_rank0(lambda: [r.__dict__ for r in read_donefile(cfg.output_dir)]),
        )
        plan.records = [DoneRecord(**r) for r in plan.records]  # type: ignore[arg-type]
        resumed = self._resume_cut(plan)
        if plan.records and not cfg.resume and not resumed:
            raise ConfigError(
                f"{cfg.output_dir} already has a donefile with {len(plan.records)} "
                "record(s): pass resume=True to continue, or a new output_dir",
                key="resume",
            )
        if plan.records and not resumed:
            self._restore(plan.records)
        if self.auto is not None and not resumed:
            self._cut(plan.records, "start")  # a failure in the first pass recovers from here
        done = {(r.day, r.pass_id) for r in plan.records}
        if self.resumed_at is not None:  # a cut after a pass with no save (save_delta=False)
            order = [(d, p) for d, passes in plan.days for p in passes]
            if self.resumed_at in order:
                done.update(order[: order.index(self.resumed_at) + 1])
        results: list[PassResult] = []
        for day, passes in plan.days:
            for pass_id in passes:
                if (day, pass_id) in done or (day, BASE_PASS) in done:
                    continue
                if cfg.max_passes is not None and len(results) >= cfg.max_passes:
                    self._published()
                    return results
                result = self._pass(day, pass_id, plan.records)
                results.append(result)
                if self.on_pass is not None:
                    self.on_pass(result)
            if (day, BASE_PASS) not in done:
                self._end_day(day, plan.records)
        self._published()
        return results

    def _pass(self, day: str, pass_id: str, records: list[DoneRecord]) -> PassResult:
        cfg = self.config
        t0 = time.perf_counter()
        files = sorted(glob.glob(os.path.join(cfg.data_root, day, pass_id, cfg.file_pattern)))
        if not files:
            raise ConfigError(
                f"pass folder {os.path.join(cfg.data_root, day, pass_id)!r} has no "
                f"files matching {cfg.file_pattern!r}",
                key="file_pattern",
            )
        from fleet.util import get_file_shard

        mine = get_file_shard(files)
        dataset: Iterable[Mapping[str, Any]] = self.make_dataset(mine) if mine else []
        pv_auc = self.evaluate(dataset) if cfg.progressive_validation else math.nan
        batches = dataset if self.prefetch is None else _lookahead(dataset, self.prefetch)
        stats = train_from_dataset(
            self.model,
            self.optimizer,
            batches,
            self.loss_fn,
            label=cfg.label,
            print_period=cfg.print_period,
            out=self.out,
            thread_num=getattr(dataset, "thread_num", None),  # the dataset's training threads
        )
        release = getattr(dataset, "release_memory", None)
        if release is not None:
            release()
        examples = int(metrics.sum(stats.examples))
        train_s = float(metrics.max(stats.seconds))
        self.last_pass = {
            "day": day,
            "pass": pass_id,
            "examples": examples,
            "progressive_auc": pv_auc,
            "train_auc": stats.auc,
        }
        path = ""
        if cfg.save_delta:
            path = os.path.join(cfg.output_dir, day, f"delta-{pass_id}")
            ps_runtime.save_persistables(path, mode=1)
            self._record(DoneRecord(day, pass_id, path, "delta"), records)
        elif self.auto is not None:
            self._cut(records, "pass", day, pass_id)
        result = PassResult(
            day,
            pass_id,
            examples,
            pv_auc,
            stats.auc,
            train_s,
            float(metrics.max(time.perf_counter() - t0)),
            path,
        )
        if self.out is not None:
            self.out.write(
                f"[online] day {day} pass {pass_id}: progressive auc {result.progressive_auc:.5f} "
                f"(before training), train auc {result.train_auc:.5f}, {examples} examples, "
                f"{result.examples_per_second:.0f} ex/s, pass {result.pass_seconds:.1f} s"
                + (f", delta {path}" if path else "")
                + "\n"
            )
            self.out.flush()
        return result

    def _end_day(self, day: str, records: list[DoneRecord]) -> None:
        cfg = self.config
        ps_runtime.end_day()
        removed = 0
        if cfg.shrink_unseen_days is not None:
            removed = int(metrics.sum(ps_runtime.shrink(cfg.shrink_unseen_days)))
        path = os.path.join(cfg.output_dir, day, "base")
        ps_runtime.save_persistables(path, mode=0)
        self._record(DoneRecord(day, BASE_PASS, path, "base"), records)
        if self.out is not None:
            self.out.write(
                f"[online] day {day} done: end_day, shrink removed {removed} rows, base {path}\n"
            )
            self.out.flush()

    def evaluate(self, dataset: Iterable[Mapping[str, Any]]) -> float:
        """AUC of the current model on ``dataset`` over every trainer (nothing is pushed)."""
        state = metrics.AucState()
        label = self.config.label
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for batch in dataset:
                    if label not in batch:
                        raise ConfigError(
                            f"the batch has no slot {label!r} (slots: {sorted(batch)})", key="label"
                        )
                    output = self.model({k: v for k, v in batch.items() if k != label})
                    scores = positive_scores(output, output_is_logits=True)
                    if scores is not None:  # else neither one score nor two per example
                        state.update(scores, batch[label].reshape(-1))
        finally:
            self.model.train(was_training)
        try:
            return state.auc()
        except ConfigError:  # one class missing everywhere
            return math.nan


def train_days(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    make_dataset: Callable[[list[str]], Iterable[Mapping[str, Any]]],
    config: StreamingConfig | None = None,
    **options: Any,
) -> list[PassResult]:
    """Run the day/pass loop (module docstring); every trainer calls it after
    ``fleet.init_worker()``. ``options``: :class:`StreamingConfig` fields (``data_root=``,
    ``output_dir=``, ...) when ``config`` is not given. Returns this run's passes."""
    if config is None:
        config = StreamingConfig(**options)
    elif options:
        raise ConfigError(
            f"give either config or its fields, not both (got {sorted(options)})", key="config"
        )
    return StreamingTrainer(model, optimizer, loss_fn, make_dataset, config).run()


__all__ = [
    "PassResult",
    "StreamingConfig",
    "StreamingTrainer",
    "list_passes",
    "load_model",
    "save_cache_model",
    "train_days",
]
