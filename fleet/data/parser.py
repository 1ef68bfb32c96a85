"""MultiSlot text -> :class:`~fleet.data.columns.Columns`, compiled when built, Python otherwise.

The format (Paddle's ``MultiSlotDataFeed``, what ``MultiSlotDataGenerator`` prints): one example
per line; for each slot of ``use_var`` in order ``<count> <v1> .. <v_count>``; tokens separated
by blanks (space, tab, CR, VT, FF). A dense slot's count must equal its ``dim``; a sparse slot's
may be 0 (Paddle refuses 0; its generator never writes it). Blank lines are ignored (Paddle aborts
on them). With Paddle's ``parse_ins_id`` / ``parse_content`` each line starts with ``1 <ins_id>``
/ ``1 <content>`` fields, which are checked and skipped. Numbers: the grammar in
``_parser.c``'s header; int64 ids may be written as uint64 (>= 2^63 keeps the 64 bits, as Paddle's
feasigns); floats round to the nearest double, then to float32.

Why compiled: a plain-Python parse (``str.split`` + ``int()``) of Criteo-shaped lines runs at
~100 k lines/s and builds a Python object per value; the C parser (``_parser.c``) reads the bytes
once, without the GIL, into growable arrays, so the dataset's ``thread_num`` parser threads run on
all cores. :func:`parse_python` is the reference (same grammar, numbers and errors;
``FLEET_DATA_PARSER=python`` forces it; tests/test_data_parser.py compares the two).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from collective.errors import DatasetFormatError
from fleet.data.columns import Columns
from fleet.data.slots import Slot, SlotDtype

try:
    from fleet.data import _parser as _c
except ImportError:  # not built (no C compiler at install time)
    _c = None

COMPILED = _c is not None
"""Whether the compiled parser was built."""
ENABLED = COMPILED and os.environ.get("FLEET_DATA_PARSER", "c").lower() != "python"
"""Whether this process parses with the compiled parser."""

E_COUNT, E_MISSING, E_SHORT, E_NUMBER, E_RANGE, E_DIM, E_TRAILING, E_HEADER = range(1, 9)
ERROR_CODES = {
    E_COUNT: "bad count",
    E_MISSING: "missing slot",
    E_SHORT: "too few values",
    E_NUMBER: "not a number",
    E_RANGE: "id out of range",
    E_DIM: "wrong dense count",
    E_TRAILING: "trailing text",
    E_HEADER: "bad ins_id/content field",
}
"""Error code (shared with ``_parser.c``) -> short name."""

_INT = re.compile(rb"[+-]?[0-9]+")
_FLOAT = re.compile(
    rb"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    rb"|[+-]?(?:inf|infinity|nan)",
    re.IGNORECASE,
)
_INT_MIN, _UINT_MAX = -(1 << 63), (1 << 64) - 1


@dataclass(frozen=True)
class ParseSpec:
    """What a line holds: the slots, and the leading ``1 <token>`` fields to skip."""

    slots: tuple[Slot, ...]
    header_fields: int = 0
    """Paddle's ``parse_ins_id`` + ``parse_content`` (0..2)."""

    @property
    def kinds(self) -> bytes:
        return bytes(s.kind_code for s in self.slots)

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(s.dim for s in self.slots)


@dataclass(frozen=True)
class LineError:
    """The first bad line of a block."""

    line_index: int
    """0-based, among the lines of the block (blank ones counted)."""
    slot_index: int
    """Position in ``use_var``, or -1 (the line as a whole: trailing text, header)."""
    code: int
    """One of :data:`ERROR_CODES`."""
    token: bytes
    line: bytes


@dataclass
class BlockResult:
    """One parsed block of lines."""

    columns: Columns
    """Its examples (none when it stopped at an error)."""
    num_lines: int
    """Lines read (blank ones counted; up to the bad one when it stopped there)."""
    num_skipped: int
    error: LineError | None
    """The bad line that stopped the parse, or (``skip_bad``) the first one skipped."""


def _columns_from_buffers(spec: ParseSpec, n: int, buffers: tuple) -> Columns:
    data: list = []
    for slot, buf in zip(spec.slots, buffers):
        dtype = slot.dtype.numpy  # type: ignore[union-attr]
        if slot.dense:
            data.append(np.frombuffer(buf, dtype=dtype).reshape(n, slot.dim))
        else:
            values = np.frombuffer(buf[0], dtype=dtype)
            offsets = np.empty(n + 1, dtype=np.int64)
            offsets[0] = 0
            np.cumsum(np.frombuffer(buf[1], dtype=np.int64), out=offsets[1:])
            data.append((values, offsets))
    return Columns(spec.slots, data, n)


def parse_block(
    text: bytes | bytearray | memoryview,
    spec: ParseSpec,
    skip_bad: bool = False,
    hints: Sequence[float] | None = None,
    newlines: int = 0,
) -> BlockResult:
    """Parse ``text`` (whole lines). ``hints``: expected values per example of each slot, and
    ``newlines``: the ``\\n`` in ``text`` if known (both size the first allocation; any value
    works). Stops at the first bad line unless ``skip_bad``."""
    if not ENABLED:
        return parse_python(text, spec, skip_bad)
    hint = tuple(float(h) for h in hints) if hints is not None else (1.0,) * len(spec.slots)
    n, lines, skipped, err, buffers = _c.parse(
        text, spec.kinds, spec.dims, spec.header_fields, int(skip_bad), hint, newlines
    )
    error = LineError(*err) if err is not None else None
    return BlockResult(_columns_from_buffers(spec, n, buffers), lines, skipped, error)


def _check_value(tok: bytes, slot: Slot) -> tuple[int, int | float]:
    """(0, value) or (error code, 0)."""
    if slot.dtype is SlotDtype.FLOAT32:
        return (0, float(tok)) if _FLOAT.fullmatch(tok) else (E_NUMBER, 0)
    if not _INT.fullmatch(tok):
        return E_NUMBER, 0
    if len(tok.lstrip(b"+-").lstrip(b"0")) > 20:  # out of range (and int() refuses > 4300)
        return E_RANGE, 0
    v = int(tok)
    if not _INT_MIN <= v <= _UINT_MAX:
        return E_RANGE, 0
    return 0, v - (1 << 64) if v >= 1 << 63 else v


def parse_line(
    tokens: list[bytes], spec: ParseSpec, out: list[list] | None = None
) -> tuple[int, int, bytes, str]:
    """Check (and with ``out``, one list per slot, append) one line's tokens.

    Returns ``(code, slot index, offending token, detail)``; code 0 = fine. ``detail`` says
    what was expected, for the error message.
    """
    pos, n = 0, len(tokens)
    for _ in range(spec.header_fields):
        if pos >= n or tokens[pos] != b"1":
            return E_HEADER, -1, tokens[pos] if pos < n else b"", "expected '1 <token>'"
        if pos + 1 >= n:
            return E_HEADER, -1, b"", "expected '1 <token>', the line ends after '1'"
        pos += 2
    for s, slot in enumerate(spec.slots):
        if pos >= n:
            return E_MISSING, s, b"", f"the line ends after {s} of {len(spec.slots)} slots"
        count_tok = tokens[pos]
        if not count_tok.isdigit():
            return E_COUNT, s, count_tok, "expected the slot's value count, an integer >= 0"
        count = int(count_tok)
        pos += 1
        if slot.dense and count != slot.dim:
            return E_DIM, s, count_tok, f"a dense slot of dim {slot.dim} needs count {slot.dim}"
        values: list = []
        for k in range(count):
            if pos >= n:
                return E_SHORT, s, b"", f"count {count} but the line ends after {k} values"
            code, v = _check_value(tokens[pos], slot)
            if code:
                what = (
                    "a float32 number"
                    if slot.dtype is SlotDtype.FLOAT32
                    else ("an int64 id in [-2^63, 2^64 - 1]" if code == E_RANGE else "an int64 id")
                )
                return code, s, tokens[pos], f"expected {what} (value {k + 1} of {count})"
            values.append(v)
            pos += 1
        if out is not None:
            out[s].append(values)
    if pos < n:
        return (
            E_TRAILING,
            -1,
            tokens[pos],
            f"the line holds more than the {len(spec.slots)} slots of use_var",
        )
    return 0, -1, b"", ""


def _split_lines(text: bytes | bytearray | memoryview) -> list[bytes]:
    data = bytes(text)
    if not data:
        return []
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    return lines


def parse_python(
    text: bytes | bytearray | memoryview, spec: ParseSpec, skip_bad: bool = False
) -> BlockResult:
    """The reference parser: :func:`parse_block` in Python (same results, ~20x slower)."""
    rows: list[list] = [[] for _ in spec.slots]
    lines = _split_lines(text)
    error, skipped = None, 0
    for i, line in enumerate(lines):
        tokens = line.split()
        if not tokens:
            continue
        mark = [len(r) for r in rows]
        code, s, tok, _ = parse_line(tokens, spec, rows)
        if code:
            if error is None:
                error = LineError(i, s, code, tok, line)
            if not skip_bad:
                return BlockResult(Columns.empty(spec.slots), i + 1, 0, error)
            for r, m in zip(rows, mark):
                del r[m:]
            skipped += 1
    n = len(rows[0]) if rows else 0
    data: list = []
    for slot, per_example in zip(spec.slots, rows):
        dtype = slot.dtype.numpy  # type: ignore[union-attr]
        flat = [v for vals in per_example for v in vals]
        with np.errstate(over="ignore"):  # float32 overflow is +-inf, as in C
            values = np.array(flat, dtype=np.float64 if dtype == np.float32 else np.int64)
            values = values.astype(dtype)
        if slot.dense:
            data.append(values.reshape(n, slot.dim))
        else:
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum([len(vals) for vals in per_example], out=offsets[1:])
            data.append((values, offsets))
    return BlockResult(Columns(spec.slots, data, n), len(lines), skipped, error)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_format_error(
    err: LineError, spec: ParseSpec, path: str, first_line: int, on_error_hint: bool = True
) -> DatasetFormatError:
    """A :class:`DatasetFormatError` for ``err`` of a block whose first line is ``first_line``
    (1-based) of ``path``: file, line, slot, the offending text and what was expected."""
    line_no = first_line + err.line_index
    code, s, tok, detail = parse_line(err.line.split(), spec)
    if code != err.code:  # the Python checker disagrees with C: report what C found
        detail = ERROR_CODES.get(err.code, f"error {err.code}")
        s, tok = err.slot_index, err.token
    slot = spec.slots[s].name if 0 <= s < len(spec.slots) else None
    where = f"slot {slot!r} (slot {s + 1} of {len(spec.slots)})" if slot else "the line"
    shown = tok.decode("utf-8", "replace")
    text = f"token {_clip(shown, 60)!r}" if tok else "end of line"
    line_text = _clip(err.line.decode("utf-8", "replace"), 200)
    fix = (
        " Fix the file or the pipe_command, check that use_var lists every slot of the "
        "lines in order, or init(on_error='skip') to skip and count bad lines."
        if on_error_hint
        else ""
    )
    message = (
        f"{path}, line {line_no}: {ERROR_CODES.get(err.code, '?')} in {where} at {text}: "
        f"{detail}. Line: {line_text!r}.{fix}"
    )
    return DatasetFormatError(message, path=path, line=line_no, slot=slot, text=shown or line_text)


__all__ = [
    "COMPILED",
    "ENABLED",
    "ERROR_CODES",
    "BlockResult",
    "LineError",
    "ParseSpec",
    "make_format_error",
    "parse_block",
    "parse_line",
    "parse_python",
]
