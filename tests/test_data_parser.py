"""fleet.data's MultiSlot parser: the compiled parser equals the Python reference on random and
edge-case inputs (values, errors, skip counts), Paddle's number forms, each bad-line kind with its
message, and the chunk gathers (compiled vs numpy)."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, base_env

from collective.errors import DatasetFormatError
from fleet.data import Slot, columns, parser
from fleet.data.columns import Columns, _take_numpy, locate, take_column, take_rows
from fleet.data.parser import ParseSpec, make_format_error, parse_python

SLOTS = (
    Slot("label", dense=True),
    Slot("ids"),
    Slot("w", dtype="float32"),
    Slot("dense", dtype="float32", dense=True, dim=3),
    Slot("pair", dense=True, dim=2),
)
SPEC = ParseSpec(SLOTS)
compiled = pytest.mark.skipif(not parser.COMPILED, reason="fleet.data._parser not built")


def parse_c(text: bytes, spec: ParseSpec = SPEC, skip: bool = False) -> parser.BlockResult:
    n, lines, skipped, err, buffers = parser._c.parse(
        text, spec.kinds, spec.dims, spec.header_fields, int(skip), (1.0,) * len(spec.slots)
    )
    error = parser.LineError(*err) if err else None
    return parser.BlockResult(parser._columns_from_buffers(spec, n, buffers), lines, skipped, error)


def assert_same(a: parser.BlockResult, b: parser.BlockResult) -> None:
    assert (a.columns.num_examples, a.num_lines, a.num_skipped) == (
        b.columns.num_examples,
        b.num_lines,
        b.num_skipped,
    )
    assert a.error == b.error
    for x, y in zip(a.columns.data, b.columns.data):
        for u, v in zip(x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)):
            assert u.dtype == v.dtype and u.shape == v.shape
            assert u.tobytes() == v.tobytes() or np.array_equal(u, v, equal_nan=True)


INT_TOKENS = [
    "0",
    "7",
    "-3",
    "+12",
    "007",
    "-0",
    "9223372036854775807",
    "-9223372036854775808",
    "9223372036854775808",
    "18446744073709551615",
    "00000000000000000000000042",
    "123456789012345678",
    "1" * 19,
]
FLOAT_TOKENS = [
    "0",
    "1.5",
    "-2.25",
    ".5",
    "5.",
    "1e3",
    "1E-3",
    "+7",
    "3.4028235e38",
    "1e39",
    "-1e-50",
    "inf",
    "-Infinity",
    "NaN",
    "0.1",
    "123456789.123456789",
    "1.00000000000000000000001",
    "2.5e-310",
    "0.000001",
    "1e22",
    "1e23",
    "9007199254740993",
    "12345678901234567890e-5",
]
BAD_TOKENS = [
    "x",
    "1x",
    "--1",
    "1-",
    "0x10",
    "1e",
    "1e+",
    ".",
    "+",
    "1_000",
    "1.2.3",
    "inff",
    "nana",
    "1,5",
]


def random_line(rng: random.Random) -> bytes:
    parts = [f"1 {rng.choice(INT_TOKENS[:8])}"]
    ids = [rng.choice(INT_TOKENS) for _ in range(rng.randint(0, 4))]
    parts.append(" ".join([str(len(ids)), *ids]))
    ws = [rng.choice(FLOAT_TOKENS) for _ in range(rng.randint(0, 3))]
    parts.append(" ".join([str(len(ws)), *ws]))
    parts.append("3 " + " ".join(rng.choice(FLOAT_TOKENS) for _ in range(3)))
    parts.append("2 " + " ".join(rng.choice(INT_TOKENS) for _ in range(2)))
    line = rng.choice([" ", "\t", "  ", " \r "]).join(parts)
    roll = rng.random()
    if roll < 0.08:  # corrupt one token
        tokens = line.split()
        tokens[rng.randrange(len(tokens))] = rng.choice(BAD_TOKENS + ["99999999999999999999"])
        line = " ".join(tokens)
    elif roll < 0.12:
        line = " ".join(line.split()[: rng.randrange(1, 12)])  # truncated
    elif roll < 0.14:
        line += " 5"  # trailing text
    elif roll < 0.16:
        line = rng.choice(["", "   ", "\t"])  # blank
    return line.encode()


@compiled
@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(6))
def test_compiled_parser_equals_python_on_random_lines(seed: int) -> None:
    rng = random.Random(seed)
    text = b"\n".join(random_line(rng) for _ in range(400)) + rng.choice([b"", b"\n"])
    assert_same(parse_c(text, skip=True), parse_python(text, SPEC, skip_bad=True))
    assert_same(parse_c(text, skip=False), parse_python(text, SPEC, skip_bad=False))


@compiled
@pytest.mark.timeout(30)
def test_number_forms_match_python_float_and_int() -> None:
    spec = ParseSpec((Slot("f", dtype="float32"), Slot("i")))
    for tok in FLOAT_TOKENS:
        r = parse_c(f"1 {tok} 0".encode(), spec)
        assert r.error is None, tok
        with np.errstate(over="ignore"):
            want = np.array([float(tok)], dtype=np.float64).astype(np.float32)
        assert np.array_equal(r.columns.data[0][0], want, equal_nan=True), tok
    for tok in INT_TOKENS:
        r = parse_c(f"0 1 {tok}".encode(), spec)
        v = int(tok)
        assert r.columns.data[1][0].tolist() == [v - (1 << 64) if v >= 1 << 63 else v], tok
    for tok in BAD_TOKENS:
        assert parse_c(f"1 {tok} 0".encode(), spec).error.code == parser.E_NUMBER, tok


@pytest.mark.timeout(30)
def test_layout_of_a_block() -> None:
    text = b"1 1 2 10 11 0 3 0.5 1.5 2.5 2 4 5\n\n1 0 0 1 2.5 3 1 2 3 2 6 7"
    r = parser.parse_block(text, SPEC)
    assert (r.columns.num_examples, r.num_lines, r.error) == (2, 3, None)
    label, (ids, ids_off), (w, w_off), dense, pair = r.columns.data
    assert label.tolist() == [[1], [0]] and label.dtype == np.int64
    assert ids.tolist() == [10, 11] and ids_off.tolist() == [0, 2, 2]
    assert w.dtype == np.float32 and w.tolist() == [2.5] and w_off.tolist() == [0, 0, 1]
    assert dense.shape == (2, 3) and dense.dtype == np.float32
    assert pair.tolist() == [[4, 5], [6, 7]]


@pytest.mark.timeout(30)
def test_ins_id_and_content_fields_are_skipped() -> None:
    spec = ParseSpec((Slot("a"),), header_fields=2)
    r = parser.parse_block(b"1 ins_7 1 some-content 2 3 4\n", spec)
    assert r.error is None and r.columns.data[0][0].tolist() == [3, 4]
    bad = parser.parse_block(b"2 ins_7 1 c 1 3\n", spec)
    assert bad.error.code == parser.E_HEADER


BAD_LINES = [  # (line, code, slot name or None, token in the message, words of the detail)
    (b"x 1 2 0 3 1 2 3 2 1 1", parser.E_COUNT, "label", "x", "value count"),
    (b"1 1 2 10", parser.E_SHORT, "ids", "end of line", "count 2 but the line ends after 1"),
    (b"1 1", parser.E_MISSING, "ids", "end of line", "ends after 1 of 5 slots"),
    (b"1 1 1 abc 0 3 1 2 3 2 1 1", parser.E_NUMBER, "ids", "abc", "an int64 id"),
    (
        b"1 1 1 18446744073709551616 0 3 1 2 3 2 1 1",
        parser.E_RANGE,
        "ids",
        "18446744073709551616",
        "[-2^63, 2^64 - 1]",
    ),
    (b"1 1 0 1 x 3 1 2 3 2 1 1", parser.E_NUMBER, "w", "x", "a float32 number"),
    (b"1 1 0 0 2 1 2 2 1 1", parser.E_DIM, "dense", "2", "dim 3 needs count 3"),
    (b"1 1 0 0 3 1 2 3 2 1 1 junk", parser.E_TRAILING, None, "junk", "more than the 5 slots"),
    (b"1 1.5 0 0 3 1 2 3 2 1 1", parser.E_NUMBER, "label", "1.5", "an int64 id"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("line,code,slot,token,detail", BAD_LINES)
def test_each_bad_line_is_named_with_file_line_slot_and_text(
    line, code, slot, token, detail
) -> None:
    good = b"1 1 0 0 3 1 2 3 2 1 1\n"
    text = good * 3 + line + b"\n" + good
    r = parser.parse_block(text, SPEC)
    assert r.error is not None and r.error.code == code and r.columns.num_examples == 0
    err = make_format_error(r.error, SPEC, "data/part-7", first_line=101)
    assert isinstance(err, DatasetFormatError) and isinstance(err, ValueError)
    assert (err.path, err.line, err.slot) == ("data/part-7", 104, slot)
    msg = str(err)
    assert msg.startswith("data/part-7, line 104: ")
    assert parser.ERROR_CODES[code] in msg and detail in msg
    assert (f"token '{token}'" if token != "end of line" else "end of line") in msg
    assert (f"slot '{slot}'" if slot else "the line") in msg
    assert repr(line.decode()) in msg and "on_error='skip'" in msg
    skipped = parser.parse_block(text, SPEC, skip_bad=True)
    assert (skipped.columns.num_examples, skipped.num_skipped) == (4, 1)
    assert skipped.error.line_index == 3


@pytest.mark.timeout(60)
def test_compiled_module_is_loaded_when_a_compiler_exists() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the numpy path is expected")
    assert parser.COMPILED and columns._c is not None, "pip install -e . did not build _parser"
    code = "import fleet.data.parser as p; print(p.ENABLED)"
    for forced, enabled in (("c", "True"), ("python", "False")):
        env = {**base_env(), "FLEET_DATA_PARSER": forced}
        run = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, text=True,
                             capture_output=True, timeout=50, check=True)  # fmt: skip
        assert run.stdout.strip() == enabled


def _chunks(rng: np.random.Generator, sizes: list[int]) -> list[Columns]:
    out = []
    for n in sizes:
        lengths = rng.integers(0, 4, n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        data = [
            rng.integers(-9, 9, (n, 1)),
            (rng.integers(-1 << 62, 1 << 62, int(offsets[-1])), offsets),
            (rng.random(int(offsets[-1]), dtype=np.float32), offsets.copy()),
            rng.random((n, 3), dtype=np.float32),
            rng.integers(0, 5, (n, 2)),
        ]
        out.append(Columns(SLOTS, data, n))
    return out


@compiled
@pytest.mark.timeout(30)
def test_chunk_gathers_compiled_equal_numpy() -> None:
    rng = np.random.default_rng(0)
    chunks = _chunks(rng, [5, 0, 17, 1, 9])
    idx = rng.permutation(32)[:25]
    chunk, row = locate(chunks, idx)
    for s in range(len(SLOTS)):
        a, b = take_column(chunks, s, chunk, row), _take_numpy(chunks, s, chunk, row)
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert u.dtype == v.dtype and np.array_equal(u, v)
    # against a plain concatenation
    whole = columns.concat_columns(
        SLOTS, [Columns(SLOTS, list(c.data), c.num_examples) for c in chunks]
    )
    taken = take_rows(chunks, idx)
    assert np.array_equal(taken.data[0], whole.data[0][idx])
    values, offsets = whole.data[1]
    want = [values[offsets[i] : offsets[i + 1]].tolist() for i in idx]
    got_v, got_o = taken.data[1]
    assert [got_v[got_o[k] : got_o[k + 1]].tolist() for k in range(len(idx))] == want
    with pytest.raises(IndexError):
        locate(chunks, np.array([32]))
