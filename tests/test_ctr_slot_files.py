"""The CTR example's slot files (examples/ctr/gen_slot_files.py) and their pipe reader
(examples/ctr/reader.py): line shapes of both formats, the values a plain MultiSlot parse reads
back, and the reader's PaddleRec -> MultiSlot text. Byte-for-byte agreement with PaddlePaddle's
own generator is checked by bench/check_reader_compat.py (it needs the bench-only Paddle venv)."""

from __future__ import annotations

import gzip
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, base_env

if str(REPO) not in sys.path:  # `examples` is a directory of the repo, not an installed package
    sys.path.insert(0, str(REPO))

from examples.ctr.data import CTRDataConfig, generate
from examples.ctr.gen_slot_files import SlotFiles, write_files
from examples.ctr.slots import (
    DENSE_DECIMALS,
    DENSE_SLOT,
    LABEL_SLOT,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_SLOTS,
    parse_paddlerec_line,
)


def parse_multislot(line: str) -> list[list[str]]:
    """Plain MultiSlot parse: ``<count> <values>`` per slot, to the end of the line."""
    tokens, slots, pos = line.split(), [], 0
    while pos < len(tokens):
        n = int(tokens[pos])
        slots.append(tokens[pos + 1 : pos + 1 + n])
        pos += 1 + n
    return slots


@pytest.mark.timeout(60)
def test_multislot_files_hold_the_generated_examples(tmp_path) -> None:
    paths = write_files(str(tmp_path), SlotFiles(num_files=2, lines_per_file=300, seed=3))
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["part-00000", "part-00001"]
    lines = []
    for p in paths:
        with open(p) as f:
            lines += f.readlines()
    assert len(lines) == 600 and all(ln.endswith("\n") for ln in lines)
    slots = [parse_multislot(ln) for ln in lines]
    assert {tuple(len(s) for s in row) for row in slots} == {(1,) * (1 + NUM_SPARSE) + (NUM_DENSE,)}
    batch = generate(CTRDataConfig(seed=3), 600, 0)  # file k holds examples k*300 ..
    assert [int(row[0][0]) for row in slots] == batch.labels.astype(int).tolist()
    ids = np.array([[int(s[0]) for s in row[1 : 1 + NUM_SPARSE]] for row in slots], dtype=np.int64)
    assert np.array_equal(ids, batch.sparse_ids)
    assert (ids < 0).any()  # raw 64-bit ids, signed decimal
    dense = np.array([[float(v) for v in row[-1]] for row in slots], dtype=np.float32)
    np.testing.assert_allclose(dense, batch.dense, atol=0.6 * 10**-DENSE_DECIMALS, rtol=0)


@pytest.mark.timeout(60)
def test_paddlerec_lines_and_gzip(tmp_path) -> None:
    (path,) = write_files(str(tmp_path), SlotFiles(1, 50, "paddlerec", gzip=True))
    assert path.endswith("part-00000.gz")
    with gzip.open(path, "rt") as f:
        lines = f.readlines()
    assert len(lines) == 50
    batch = generate(CTRDataConfig(), 50, 0)
    for line, label, ids in zip(lines, batch.labels, batch.sparse_ids):
        names = [t.split(":", 1)[0] for t in line.split()]
        assert names == [LABEL_SLOT] + [DENSE_SLOT] * NUM_DENSE + list(SPARSE_SLOTS)
        parsed = dict(parse_paddlerec_line(line))
        assert parsed[LABEL_SLOT] == [int(label)]
        assert [parsed[s][0] for s in SPARSE_SLOTS] == ids.tolist()
    # PaddleRec's reader semantics: unknown names ignored, missing slots padded
    parsed = parse_paddlerec_line("click:1 7:42 7:43 extra:9\n")
    assert parsed[0] == (LABEL_SLOT, [1]) and dict(parsed)["7"] == [42, 43]
    assert dict(parsed)["1"] == [0] and parsed[-1] == (DENSE_SLOT, [0.0] * NUM_DENSE)


@pytest.mark.timeout(60)
def test_paddlerec_and_multislot_files_hold_the_same_examples(tmp_path) -> None:
    """What the reader does to a PaddleRec line (Paddle's generator prints ``str`` of each value,
    ``<count>`` first) is what the multislot writer writes."""
    (pr,) = write_files(str(tmp_path / "pr"), SlotFiles(1, 200, "paddlerec", seed=1))
    (ms,) = write_files(str(tmp_path / "ms"), SlotFiles(1, 200, "multislot", seed=1))
    with open(pr) as f_pr, open(ms) as f_ms:
        pairs = list(zip(f_pr, f_ms, strict=True))
    for a, b in pairs:
        text = " ".join(f"{len(v)} " + " ".join(map(str, v)) for _, v in parse_paddlerec_line(a))
        assert text + "\n" == b


@pytest.mark.timeout(60)
def test_reader_converts_a_paddlerec_line_to_multislot_text() -> None:
    data = pytest.importorskip("fleet.data")
    if not hasattr(data, "MultiSlotDataGenerator"):
        pytest.skip("fleet.data has no MultiSlotDataGenerator yet")
    dense = " ".join(f"dense_feature:{v}" for v in [0.5, 1e-05, 0.125] + [0.25] * 10)
    ids = " ".join(f"{i}:{-i if i % 2 else i * 1000}" for i in range(1, 27))
    line = f"click:1 {dense} {ids}\nclick:0 {dense} {ids}\n"
    want_ids = " ".join(f"1 {-i if i % 2 else i * 1000}" for i in range(1, 27))
    want_dense = "13 0.5 1e-05 0.125 " + " ".join(["0.25"] * 10)
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "ctr" / "reader.py")],
        input=line,
        capture_output=True,
        text=True,
        env=base_env(),
        cwd=REPO,
        timeout=50,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"1 1 {want_ids} {want_dense}\n1 0 {want_ids} {want_dense}\n"
