"""Where the online loop's progress is kept and found again: the donefile record after each
save, a job checkpoint after it (``checkpoint_dir``), fleetrun's automatic checkpoints cut at
pass boundaries (``--ps_checkpoint_dir``, the record published once its cut is committed), and
the resume from them (the donefile reconciled with the cut, or the model rebuilt from the newest
base or checkpoint and the deltas after it). Why and when: :mod:`fleet.streaming.loop`'s
docstring.

:class:`StreamCheckpoints` is the base class of :class:`~fleet.streaming.loop.StreamingTrainer`
holding these methods; the trainer's ``__init__`` sets the state they use.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, TextIO

from collective.errors import FleetError
from fleet.base.data_position import DataPosition, tracker
from fleet.ps import recovery
from fleet.ps import runtime as ps_runtime
from fleet.streaming.config import StreamingConfig, _Plan
from fleet.streaming.donefile import BASE_PASS, DoneRecord, append_donefile, reconcile_donefile
from fleet.streaming.model_io import _from_rank0, _is_rank0, load_model

if TYPE_CHECKING:
    from fleet.ps.auto_checkpoint import AutoCheckpointer


class StreamCheckpoints:
    """Saves, donefile records, job checkpoints and the resume of
    :class:`~fleet.streaming.loop.StreamingTrainer` (its base class)."""

    config: StreamingConfig
    out: TextIO | None
    checkpoint_dir: str
    """Job checkpoints after every save ("" : off; ``StreamingConfig.checkpoint_dir``)."""
    auto: AutoCheckpointer | None
    """fleetrun's automatic checkpointer (None: no ``--ps_checkpoint_dir``)."""
    cut_step: int
    """Step of the last automatic checkpoint (cuts get increasing steps)."""
    last_pass: dict[str, Any]
    """The last pass trained (day, pass, examples, AUCs), kept in the cuts' trainer state."""
    resumed_at: tuple[str, str] | None
    """(day, pass) of the cut resumed from, when it followed a pass with no save."""
    _publisher: threading.Thread | None
    _publish_error: BaseException | None

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
        auto.interval_cuts = False  # the loop cuts at its boundaries (loop.py's docstring)
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


__all__ = ["StreamCheckpoints"]
