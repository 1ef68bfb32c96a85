"""Paddle's data generators: user code turning raw lines into MultiSlot text, run as a dataset's
``pipe_command`` (``pipe_command="python reader.py"``).

A reader written for Paddle runs unchanged but for its import
(``import paddle.distributed.fleet as dg`` -> ``import fleet.data as dg``)::

    import fleet.data as dg

    class Reader(dg.MultiSlotDataGenerator):
        def generate_sample(self, line):
            def local_iter():
                fields = line.split()
                yield [("click", [int(fields[0])]), ("ids", [int(x) for x in fields[1:]])]
            return local_iter

    if __name__ == "__main__":
        Reader().run_from_stdin()

It writes the same bytes as Paddle's ``paddle/distributed/fleet/data_generator/data_generator.py``
(``bench/check_reader_compat.py`` compares them): per sample one line, for each slot in the
order of the first sample ``<count> <v1> .. <v_count>``, values as ``str()`` writes them. The
same checks as Paddle, with Paddle's messages: the sample is a list or tuple (or a zip) of
``(name, list)`` pairs; every later sample has the same slot names in the same order; a value is
an int or a float; **an empty value list is an error** -- Paddle does not pad it ("you need
padding it in process()"), neither do we. Where we differ: numpy integer / float scalars are
accepted as ints / floats (Paddle refuses them), and ``bool`` is refused (Paddle writes
``True``, which no parser reads back). This module imports neither torch nor numpy, so a reader
process starts fast.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

Sample = Any
"""What ``generate_sample``'s iterator yields: ``[(slot name, [values...]), ...]``."""


class DataGenerator:
    """Base class of the generators (Paddle's ``DataGenerator``): subclass one of
    :class:`MultiSlotDataGenerator` / :class:`MultiSlotStringDataGenerator` and implement
    :meth:`generate_sample` (and optionally :meth:`generate_batch`)."""

    def __init__(self) -> None:
        self._proto_info: list[tuple[str, str]] | None = None
        self.batch_size_ = 32

    def set_batch(self, batch_size: int) -> None:
        """Samples handed to :meth:`generate_batch` at once (default 32)."""
        self.batch_size_ = batch_size

    def _write_batches(self, samples: Iterable[Sample], out: Any) -> None:
        batch: list[Sample] = []
        for sample in samples:
            if sample is None:
                continue
            batch.append(sample)
            if len(batch) == self.batch_size_:
                for s in self.generate_batch(batch)():
                    out.write(self._gen_str(s))
                batch = []
        if batch:
            for s in self.generate_batch(batch)():
                out.write(self._gen_str(s))

    def run_from_memory(self) -> None:
        """Write the samples of ``generate_sample(None)`` to stdout (debugging, benchmarks)."""
        self._write_batches(self.generate_sample(None)(), sys.stdout)

    def run_from_stdin(self) -> None:
        """Read lines from stdin, write the MultiSlot text of their samples to stdout."""

        def samples() -> Iterator[Sample]:
            for line in sys.stdin:
                yield from self.generate_sample(line)()

        self._write_batches(samples(), sys.stdout)

    def _gen_str(self, line: Sample) -> str:
        raise NotImplementedError("pls use MultiSlotDataGenerator or PairWiseDataGenerator")

    def generate_sample(self, line: str | None) -> Callable[[], Iterable[Sample]]:
        """Override: return a function whose iterator yields the samples of ``line`` (None in
        :meth:`run_from_memory`), each ``[(name, [values...]), ...]``; a ``None`` sample is
        dropped."""
        raise NotImplementedError(
            "Please rewrite this function to return a list or tuple: "
            + "[(name, [feasign, ...]), ...] or ((name, [feasign, ...]), ...)"
        )

    def generate_batch(self, samples: list[Sample]) -> Callable[[], Iterable[Sample]]:
        """Override to process ``set_batch`` samples at once (padding, ...); default: as is."""

        def local_iter() -> Iterator[Sample]:
            yield from samples

        return local_iter


def _as_pairs(line: Sample, example: str) -> list | tuple:
    if isinstance(line, zip):
        line = list(line)
    if not isinstance(line, (list, tuple)):
        raise ValueError(  # noqa: TRY004 - Paddle's error type and message
            "the output of process() must be in list or tuple type" + example
        )
    return line


def _check_pair(name: Any, elements: Any) -> None:
    # Paddle's error types and messages (TRY004 would want TypeError)
    if not isinstance(name, str):
        raise ValueError(f"name{type(name)} must be in str type")  # noqa: TRY004
    if not isinstance(elements, list):
        raise ValueError(f"elements{type(elements)} must be in list type")  # noqa: TRY004
    if not elements:
        raise ValueError(
            "the elements of each field can not be empty, you need padding it in process()."
        )


class MultiSlotStringDataGenerator(DataGenerator):
    """Samples of strings: ``[(name, ["1926", "08"]), ...]`` -> ``2 1926 08 ...`` (no checks on
    the strings, as Paddle)."""

    def _gen_str(self, line: Sample) -> str:
        line = _as_pairs(line, "Examples: [('words', ['1926', '08', '17']), ('label', ['1'])]")
        parts = []
        for _name, elements in line:
            parts.append(" ".join([str(len(elements)), *elements]))
        return " ".join(parts) + "\n"


class MultiSlotDataGenerator(DataGenerator):
    """Samples of numbers: ``[(name, [1926, 8]), ("label", [1])]`` -> ``2 1926 8 1 1``; a slot
    holding a float anywhere is a float slot (Paddle's proto info, kept in ``_proto_info``)."""

    def _gen_str(self, line: Sample) -> str:
        line = _as_pairs(line, "Example: [('words', [1926, 08, 17]), ('label', [1])]")
        first = self._proto_info is None
        if first:
            self._proto_info = []
        elif len(line) != len(self._proto_info):  # type: ignore[arg-type]
            raise ValueError("the complete field set of two given line are inconsistent.")
        info = self._proto_info
        assert info is not None
        parts = []
        for index, (name, elements) in enumerate(line):
            _check_pair(name, elements)
            if first:
                info.append((name, "uint64"))
            elif name != info[index][0]:
                raise ValueError(
                    f"the field name of two given line are not match: "
                    f"require<{info[index][0]}>, get<{name}>."
                )
            words = [str(len(elements))]
            for elem in elements:
                if isinstance(elem, bool) or not isinstance(elem, (numbers.Integral, numbers.Real)):
                    raise ValueError(  # noqa: TRY004 - Paddle's type and message
                        f"the type of element{type(elem)} must be in int or float"
                    )
                if not isinstance(elem, numbers.Integral):
                    info[index] = (name, "float")
                words.append(str(elem))
            parts.append(" ".join(words))
        return " ".join(parts) + "\n"


__all__ = ["DataGenerator", "MultiSlotDataGenerator", "MultiSlotStringDataGenerator"]
