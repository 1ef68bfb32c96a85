"""Online (day/pass) training on the parameter server: ``fleet.train_days`` and
:class:`StreamingTrainer`.

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
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

import fleet.metrics as metrics
from collective.errors import ConfigError, FleetError
from fleet.base.data_position import DataPosition, tracker
from fleet.ps import recovery, serving
from fleet.ps import runtime as ps_runtime
from fleet.streaming.donefile import (
    BASE_PASS,
    DoneRecord,
    append_donefile,
    read_donefile,
    reconcile_donefile,
)
from fleet.train_loop import train_from_dataset

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamingConfig:
    """What :func:`train_days` streams and where it saves (one per job; every trainer the same)."""

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


def _is_rank0() -> bool:
    return ps_runtime._require("train_days()").env.rank == 0


def _from_rank0(fn: Callable[[], Any]) -> Any:
    """Trainer 0's result of ``fn`` on every trainer (its FleetError raised on every trainer)."""
    st = ps_runtime._require("train_days()")
    return recovery._agree(st.env.rank, recovery._outcome(fn) if st.env.rank == 0 else None)


def _refresh_dense() -> None:
    """After the servers loaded a model: drop cached rows, take the dense values from them."""
    comm = ps_runtime.get_communicator()
    comm.forget_server_values()
    if comm.dense:
        comm._set_dense(comm.pull_dense())
        if hasattr(comm, "set_dense_base"):
            comm.set_dense_base()


def load_model(dirname: str, mode: int = 0) -> dict[str, int]:
    """Paddle's ``fleet.load_model(path, mode)``: every trainer calls it; trainer 0 has every
    server load ``dirname`` (``mode`` 0: a full save replaces the tables; 1: a delta updates
    them, and must follow the model loaded or saved last). Returns rows read per table."""
    if mode not in (0, 1):
        raise ConfigError(f"got {mode!r}; allowed: 0 (a full save), 1 (a delta)", key="mode")
    ps_runtime.get_communicator().flush()
    recovery._gather(None)  # every trainer flushed: nothing reaches the servers after the load

    def load() -> dict[str, int]:
        from ps_server.checkpoint import read_checkpoint

        info = read_checkpoint(dirname)
        want = "all" if mode == 0 else "delta"
        if info.mode != want:
            raise FleetError(
                f"{dirname} holds a {info.mode!r} save; load it with mode="
                f"{0 if info.mode == 'all' else 1}"
            )
        return ps_runtime.get_client().load(dirname)

    rows = _from_rank0(load)
    _refresh_dense()
    return rows


def save_cache_model(
    dirname: str, mode: int = 0, *, min_show: int = 1, model: torch.nn.Module | None = None
) -> Any:
    """Paddle's ``fleet.save_cache_model(dirname, mode=...)``: the rows shown at least
    ``min_show`` times as a read-only serving copy (:func:`fleet.ps.export_serving`; mode 0 all,
    1 only what changed since the previous one). Returns the export's record."""
    if mode not in (0, 1):
        raise ConfigError(f"got {mode!r}; allowed: 0 (all), 1 (delta)", key="mode")
    return serving.export_serving(
        dirname, min_show=min_show, mode="all" if mode == 0 else "delta", model=model
    )


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


class StreamingTrainer:
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
                    state.update(torch.sigmoid(output).reshape(-1), batch[label].reshape(-1))
        finally:
            self.model.train(was_training)
        try:
            return state.auc()
        except ConfigError:  # one class missing everywhere
            return math.nan

    # -- saves, donefile, resume ------------------------------------------------------------------
    def _record(self, record: DoneRecord, records: list[DoneRecord]) -> None:
        """The save is complete on every server: under fleetrun's automatic checkpoints a cut
        holding it is committed first; trainer 0 appends the donefile record; a job checkpoint
        naming it follows when ``checkpoint_dir`` is set."""
        records.append(record)
        if self.auto is not None:  # trainer 0 appends the record once the cut is committed
            self._cut(
                records,
                "day" if record.pass_id == BASE_PASS else "pass",
                record.day,
                record.pass_id,
                publish=record,
            )
        elif _is_rank0():
            append_donefile(self.config.output_dir, record)
        ps_runtime._barrier()
        if self.checkpoint_dir:
            from fleet.ps.recovery import checkpoint

            checkpoint(
                self.checkpoint_dir,
                len(records),
                keep=self.config.checkpoint_keep,
                trainer_state={"records": len(records), "day": record.day, "pass": record.pass_id},
                wait=True,
            )

    def _cut(
        self,
        records: list[DoneRecord],
        phase: str,
        day: str = "",
        pass_id: str = "",
        publish: DoneRecord | None = None,
    ) -> None:
        """One automatic checkpoint of the job at this boundary (every trainer); trainer 0
        appends ``publish`` (the save it follows, None for none) to the donefile once it is
        committed. Raises FleetError when it fails: the caller's trainer exits and fleetrun
        recovers the job from the previous cut."""
        assert self.auto is not None
        self._published()  # the previous cut's record is out (or its failure raised)
        # trainer 0's step names it (trainers' steps differ in async mode; a trainer restarted
        # alone replaying this round gets the same one)
        step = _from_rank0(lambda: max(tracker().step, self.cut_step + 1))
        last = records[-1] if records else None
        state = {
            "data": tracker().position().to_dict(),
            "stream": {
                "records": len(records),
                "record": list(last.__dict__.values()) if last else None,
                "phase": phase,
                "day": day,
                "pass": pass_id,
                "last_pass": self.last_pass,
            },
        }
        try:  # training waits for the snapshot only; the files are written in the background
            pending = recovery.checkpoint(
                self.auto.cfg.dir, step, trainer_state=state, keep=self.auto.cfg.keep
            )
        except FleetError as err:
            self.auto.record_cut(None)
            raise FleetError(
                f"train_days: the automatic checkpoint after {phase} {day} {pass_id} "
                f"failed ({err}); fleetrun recovers the job from the previous one"
            ) from err
        self.cut_step = step
        self.auto.record_cut(step)
        if pending is not None:  # trainer 0: publish the record once the cut is committed
            self._publisher = threading.Thread(
                target=self._publish,
                args=(pending, publish),
                name="fleet-streaming-donefile",
                daemon=True,
            )
            self._publisher.start()

    def _publish(self, pending: Any, record: DoneRecord | None) -> None:
        try:
            pending.result()
            if record is not None:
                append_donefile(self.config.output_dir, record)
        except BaseException as err:  # noqa: BLE001 - raised on the loop's thread by _published
            self._publish_error = err

    def _published(self) -> None:
        """Wait until the last cut is committed and its record appended (trainer 0); raise
        FleetError if it was not (the job then recovers from the previous cut)."""
        if self._publisher is not None:
            self._publisher.join()
            self._publisher = None
        err, self._publish_error = self._publish_error, None
        if err is not None:
            if self.auto is not None:
                self.auto.record_cut(None)
            raise FleetError(
                f"train_days: an automatic checkpoint was not committed ({err}); its "
                "donefile record is not written and fleetrun recovers the job from "
                "the previous one"
            ) from err

    def _resume_cut(self, plan: _Plan) -> bool:
        """Under fleetrun's automatic checkpoints: True when the servers were restored from a
        cut of this loop (at ``distributed_optimizer``); ``plan.records`` becomes the donefile
        reconciled with the cut. False for a fresh start (no checkpoint yet)."""
        auto = self.auto
        if auto is None:
            return False
        auto.interval_cuts = False  # the loop cuts at its boundaries (module docstring)
        # trainer 0 restarted alone would replay the stream redoing its saves, loads and cuts
        # (its side of each agreement is computed again): its death restarts every process
        auto.restart_alone = auto.rank != 0
        if auto.resumed.get("alone"):
            # fleetrun restarted this trainer alone (async/GEO, fleet.base.coordination): its
            # rounds replay, its datasets skip what it trained (its own position); servers untouched
            return False
        # cuts are taken between passes: no pass of this process skips batches
        tracker().resume(DataPosition(0, 0, tracker().step))
        state = auto.resumed_state
        if state is None:
            return False
        stream = state.get("stream") if isinstance(state, dict) else None
        name = auto.resumed.get("checkpoint")
        if not isinstance(stream, dict):
            raise FleetError(
                f"checkpoint {name} of {auto.cfg.dir} was not taken by train_days "
                "(its trainer state has no 'stream'): give this stream its own "
                "--ps_checkpoint_dir"
            )
        self.cut_step = int(auto.resumed.get("step", 0))
        self.last_pass = dict(stream.get("last_pass") or {})
        if stream.get("phase") == "pass":
            self.resumed_at = (str(stream.get("day")), str(stream.get("pass")))
        count, last = int(stream["records"]), stream.get("record")
        output_dir = self.config.output_dir
        kept = _from_rank0(
            lambda: [r.__dict__ for r in reconcile_donefile(output_dir, count, last)]
        )
        plan.records = [DoneRecord(**r) for r in kept]
        if self.out is not None:
            at = self.resumed_at or ((last[0], last[1]) if last else None)
            where = f"after day {at[0]} pass {at[1]}" if at else "at the start"
            self.out.write(
                f"[online] resumed {where} from the job's checkpoint {name} "
                f"({count} record(s), phase {stream.get('phase')})\n"
            )
            self.out.flush()
        return True

    def _restore(self, records: list[DoneRecord]) -> None:
        """Rebuild the model of the donefile's last record on the (fresh) servers."""
        start = 0
        source = "fresh tables"
        if self.checkpoint_dir:
            latest = recovery.load_latest(self.checkpoint_dir)
            if latest.chosen is not None:
                state = latest.chosen.trainer_states.get(0) or latest.chosen.trainer_states.get("0")
                count = int(state["records"]) if isinstance(state, dict) else 0
                if 0 < count <= len(records):
                    start, source = count, f"job checkpoint {latest.chosen.name}"
        last_base = max((i for i, r in enumerate(records) if r.kind == "base"), default=-1)
        if last_base + 1 > start:  # a base newer than the checkpoint replaces everything
            start = last_base + 1
            if last_base >= 0:
                load_model(records[last_base].path, mode=0)
                source = f"base {records[last_base].path}"
        for r in records[start:]:
            load_model(r.path, mode=1)
        last = records[-1]
        if self.out is not None:
            self.out.write(
                f"[online] resumed after day {last.day} pass {last.pass_id}: from "
                f"{source}, {len(records) - start} delta(s) replayed\n"
            )
            self.out.flush()


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
