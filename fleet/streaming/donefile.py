"""The day/pass loop's donefile (``output_dir/donefile.txt``): one tab-separated line per
complete save, ``day  pass  path  kind``, as Paddle's ``FleetUtil`` donefiles (a day's base has
pass ``-1``). Trainer 0 writes it (:mod:`fleet.streaming.loop`); under fleetrun's automatic
checkpoints it is reconciled with the checkpoint a recovered job resumes from
(:func:`reconcile_donefile`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from collective.errors import FleetError

logger = logging.getLogger(__name__)

DONEFILE = "donefile.txt"
"""Name of the donefile in ``output_dir``."""
BASE_PASS = "-1"
"""The pass column of a base record (Paddle's donefiles use -1 for a day's base)."""


@dataclass(frozen=True)
class DoneRecord:
    """One line of the donefile: a save that is complete."""

    day: str
    pass_id: str
    """The pass folder's name, or :data:`BASE_PASS` for a day's base."""
    path: str
    kind: str
    """``delta`` or ``base``."""

    def line(self) -> str:
        return f"{self.day}\t{self.pass_id}\t{self.path}\t{self.kind}\n"


def read_donefile(output_dir: str) -> list[DoneRecord]:
    """The records of ``output_dir/donefile.txt`` ([] when absent); ValueError naming the line
    for a malformed one."""
    path = os.path.join(output_dir, DONEFILE)
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 4 or parts[3] not in ("delta", "base"):
                raise FleetError(
                    f"{path}:{number}: expected 'day<TAB>pass<TAB>path<TAB>delta|base', "
                    f"got {line.rstrip()!r}"
                )
            records.append(DoneRecord(*parts))
    return records


def append_donefile(output_dir: str, record: DoneRecord) -> None:
    """Append one record, durably (the file is only ever appended to)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, DONEFILE), "a", encoding="utf-8") as f:
        f.write(record.line())
        f.flush()
        os.fsync(f.fileno())


def write_donefile(output_dir: str, records: list[DoneRecord]) -> None:
    """Replace the donefile with ``records`` (temp file, fsync, rename)."""
    path = os.path.join(output_dir, DONEFILE)
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
        f.writelines(r.line() for r in records)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


def reconcile_donefile(output_dir: str, count: int, last: list[str] | None) -> list[DoneRecord]:
    """The donefile made to agree with a checkpoint that holds ``count`` records, the last one
    ``last``: a missing last record is appended (the job died between the cut and the append);
    records after it are dropped (the checkpoint chosen is older: a newer one was partial or
    corrupt), with a warning naming them. Returns the records kept."""
    records = read_donefile(output_dir)
    want = DoneRecord(*last) if last else None
    path = os.path.join(output_dir, DONEFILE)
    if len(records) < count - 1 or (
        want is not None and len(records) >= count and records[count - 1] != want
    ):
        raise FleetError(
            f"{path} does not match the job's checkpoint: it holds {len(records)} "
            f"record(s), the checkpoint {count} ending with {want}; was output_dir "
            "or the donefile changed? Use a new --ps_checkpoint_dir (or output_dir)"
        )
    if len(records) > count:
        logger.warning(
            "%s: dropping %d record(s) after the checkpoint's last (%s); their "
            "passes are trained again: %s",
            path,
            len(records) - count,
            want,
            [(r.day, r.pass_id, r.kind) for r in records[count:]],
        )
        write_donefile(output_dir, records[:count])
    elif want is not None and len(records) == count - 1:
        append_donefile(output_dir, want)
        records.append(want)
    return records[:count]


__all__ = [
    "BASE_PASS",
    "DONEFILE",
    "DoneRecord",
    "append_donefile",
    "read_donefile",
    "reconcile_donefile",
    "write_donefile",
]
