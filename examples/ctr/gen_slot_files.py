"""Write the synthetic Criteo-like CTR data (:mod:`examples.ctr.data`) as slot files.

::

    python examples/ctr/gen_slot_files.py --out_dir data/ctr_slots --num_files 4 \\
        --lines_per_file 250000 --format multislot [--gzip] [--seed 0] [--start_index 0]

File ``k`` (``part-0000k``, ``.gz`` with ``--gzip``) holds examples
``start_index + k * lines_per_file ..`` of the generator's dataset for ``--seed``, one per line,
so the files of one seed hold exactly the examples ``generate(CTRDataConfig(seed=...), n,
start_index)`` makes (the trainers' in-memory data), except that dense values are rounded to
:data:`~examples.ctr.slots.DENSE_DECIMALS` decimals. Two formats (layout:
:mod:`examples.ctr.slots`):

* ``paddlerec``: ``click:0 dense_feature:0.05 ... 1:371155 ... 26:26223`` (PaddleRec's Criteo
  lines), read through ``pipe_command="python examples/ctr/reader.py"``;
* ``multislot``: the MultiSlot text that reader prints for those lines, byte for byte (checked
  against Paddle's own generator by ``bench/check_reader_compat.py``), read with
  ``pipe_command="cat"``.

Ids are the generator's raw 64-bit ids written as signed decimal int64 (negative ones
included; Paddle's parser reads them as the same 64 bits of a uint64 feasign).

``--days 20261120,20261121 --passes 3`` writes the day/pass layout of online training
(``examples/ctr/online.py``, ``fleet.train_days``): ``out_dir/<day>/<pass>/part-0000k`` with
passes ``00`` .. , each pass ``--num_files`` files; the passes hold consecutive examples of the
one dataset (day 0 pass 0 first), so a stream of D days x P passes is examples
``start_index .. start_index + D * P * num_files * lines_per_file``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.ctr.data import CTRBatch, CTRDataConfig, generate
from examples.ctr.slots import DENSE_DECIMALS, DENSE_SLOT, LABEL_SLOT, NUM_DENSE, NUM_SPARSE

_CHUNK = 65536  # examples generated and formatted at once (bounds memory to ~100 MB)


def _columns(batch: CTRBatch) -> Iterator[tuple[int, list[int], list[float]]]:
    """(label, ids, rounded dense) per example, as Python ints / floats."""
    if batch.sparse_ids.shape[1] != NUM_SPARSE or batch.dense.shape[1] != NUM_DENSE:
        raise ValueError(
            f"the slot files hold {NUM_SPARSE} sparse slots and {NUM_DENSE} dense values, got a "
            f"batch of {batch.sparse_ids.shape[1]} and {batch.dense.shape[1]}: use the default "
            "CTRDataConfig sizes"
        )
    dense = np.round(batch.dense.astype(np.float64), DENSE_DECIMALS).tolist()
    return zip(batch.labels.astype(np.int64).tolist(), batch.sparse_ids.tolist(), dense)


def format_paddlerec(batch: CTRBatch) -> list[str]:
    """PaddleRec lines (with ``\\n``) of ``batch``: label, the dense values, then the ids."""
    ids_prefix = [f"{i}:" for i in range(1, NUM_SPARSE + 1)]
    dense_prefix = f" {DENSE_SLOT}:"
    return [
        f"{LABEL_SLOT}:{label}{dense_prefix}"
        + dense_prefix.join(map(repr, dense))
        + " "
        + " ".join([p + str(i) for p, i in zip(ids_prefix, ids)])
        + "\n"
        for label, ids, dense in _columns(batch)
    ]


def format_multislot(batch: CTRBatch) -> list[str]:
    """MultiSlot lines (with ``\\n``) of ``batch``, slots in
    :data:`~examples.ctr.slots.SLOT_ORDER`: ``1 <label>``, ``1 <id>`` x 26, ``13 <dense> x 13``."""
    return [
        f"1 {label} 1 " + " 1 ".join(map(str, ids)) + f" {NUM_DENSE} " + " ".join(map(repr, dense))
        + "\n"
        for label, ids, dense in _columns(batch)
    ]  # fmt: skip


FORMATS: dict[str, Callable[[CTRBatch], list[str]]] = {
    "paddlerec": format_paddlerec,
    "multislot": format_multislot,
}


@dataclass(frozen=True)
class SlotFiles:
    """Which files to write: two equal values write identical files."""

    num_files: int = 4
    """Files to write (>= 1)."""
    lines_per_file: int = 250_000
    """Examples per file, one a line (>= 1)."""
    format: str = "multislot"
    """``multislot`` or ``paddlerec`` (:data:`FORMATS`)."""
    seed: int = 0
    """Seed of the generated dataset (``CTRDataConfig.seed``)."""
    gzip: bool = False
    """gzip each file (its name then ends in ``.gz``)."""
    start_index: int = 0
    """Global index of the first example of file 0."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(
                f"SlotFiles.format must be one of {sorted(FORMATS)}, got {self.format!r}"
            )
        for name in ("num_files", "lines_per_file"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(
                    f"SlotFiles.{name} must be an int >= 1, got {getattr(self, name)!r}"
                )

    def paths(self, out_dir: str) -> list[str]:
        """``out_dir/part-00000`` .. (``.gz`` suffixed with :attr:`gzip`: the suffix is what
        tells a dataset to decompress, Paddle's and ours)."""
        suffix = ".gz" if self.gzip else ""
        return [os.path.join(out_dir, f"part-{i:05d}{suffix}") for i in range(self.num_files)]


def write_files(out_dir: str, spec: SlotFiles) -> list[str]:
    """Write the files of ``spec`` into ``out_dir``; returns their paths."""
    config = CTRDataConfig(seed=spec.seed)
    formatter = FORMATS[spec.format]
    os.makedirs(out_dir, exist_ok=True)
    paths = spec.paths(out_dir)
    for index, path in enumerate(paths):
        first = spec.start_index + index * spec.lines_per_file
        tmp = path + ".tmp"  # a reader never sees a half-written file under the final name
        with gzip.open(tmp, "wt", compresslevel=6) if spec.gzip else open(tmp, "w") as f:
            for lo in range(0, spec.lines_per_file, _CHUNK):
                count = min(_CHUNK, spec.lines_per_file - lo)
                f.writelines(formatter(generate(config, count, first + lo)))
        os.replace(tmp, path)
    return paths


def ensure_files(out_dir: str, spec: SlotFiles) -> list[str]:
    """:func:`write_files`, unless ``out_dir`` already holds the files of ``spec`` (its
    ``manifest.json`` says so): then their paths, writing nothing."""
    manifest_path = os.path.join(out_dir, "manifest.json")
    paths = spec.paths(out_dir)
    if os.path.exists(manifest_path) and all(os.path.exists(p) for p in paths):
        with open(manifest_path) as f:
            if json.load(f) == asdict(spec):
                return paths
    paths = write_files(out_dir, spec)
    with open(manifest_path, "w") as f:
        json.dump(asdict(spec), f)
    return paths


def write_day_pass_files(out_dir: str, spec: SlotFiles, days: list[str], passes: int) -> list[str]:
    """The day/pass layout (module docstring): ``out_dir/<day>/<pass:02d>/`` holds the files of
    ``spec`` shifted to that pass's examples. Returns every path written."""
    if not days or passes < 1:
        raise ValueError(
            f"need at least one day and passes >= 1, got days={days!r} passes={passes!r}"
        )
    per_pass = spec.num_files * spec.lines_per_file
    paths: list[str] = []
    for d, day in enumerate(days):
        for p in range(passes):
            first = spec.start_index + (d * passes + p) * per_pass
            pass_spec = SlotFiles(spec.num_files, spec.lines_per_file, spec.format, spec.seed,
                                  spec.gzip, first)  # fmt: skip
            paths += write_files(os.path.join(out_dir, day, f"{p:02d}"), pass_spec)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", required=True, help="directory to write the files into")
    p.add_argument("--num_files", type=int, default=4)
    p.add_argument("--lines_per_file", type=int, default=250_000, help="examples per file")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated dataset")
    p.add_argument("--start_index", type=int, default=0, help="global index of the first example")
    p.add_argument("--format", choices=sorted(FORMATS), default="multislot")
    p.add_argument("--gzip", action="store_true", help="gzip each file (name ends in .gz)")
    p.add_argument(
        "--days",
        default="",
        help="comma-separated day folders (e.g. 20261120,20261121): day/pass layout",
    )
    p.add_argument("--passes", type=int, default=1, help="pass folders per day (with --days)")
    args = p.parse_args(argv)
    spec = SlotFiles(args.num_files, args.lines_per_file, args.format, args.seed, args.gzip,
                     args.start_index)  # fmt: skip
    if args.days:
        days = [d for d in args.days.split(",") if d]
        print("\n".join(write_day_pass_files(args.out_dir, spec, days, args.passes)))
        return
    print("\n".join(write_files(args.out_dir, spec)))


if __name__ == "__main__":
    main()
