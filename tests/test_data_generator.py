"""fleet.data's data generators: Paddle's MultiSlot output byte for byte (against Paddle's own
generator source when the bench's Paddle venv has it), Paddle's checks and messages, batches,
and a reader written for Paddle (only its import changed) run as a dataset's pipe_command."""

from __future__ import annotations

import importlib.util
import io
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, SCRIPTS

from fleet.data import InMemoryDataset, MultiSlotDataGenerator, MultiSlotStringDataGenerator, Slot

_GENERATOR_PATH = "site-packages/paddle/distributed/fleet/data_generator/data_generator.py"
PADDLE_GENERATOR = next(
    iter(sorted((REPO / "bench" / ".venv-paddle").glob(f"lib/python3*/{_GENERATOR_PATH}"))), None
)


def make(base: type, samples: list, batch_fn=None) -> object:
    class Gen(base):  # type: ignore[misc, valid-type]
        def generate_sample(self, line):
            def local_iter():
                yield from (samples if line is None else [samples[int(line)]])

            return local_iter

        if batch_fn is not None:
            generate_batch = batch_fn

    return Gen()


def run(gen, monkeypatch, stdin: str | None = None) -> str:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    if stdin is None:
        gen.run_from_memory()
    else:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        gen.run_from_stdin()
    return out.getvalue()


@pytest.mark.timeout(30)
def test_multislot_text_is_paddles(monkeypatch) -> None:
    samples = [
        [("words", [1926, 8, 17]), ("label", [1])],
        (("words", [-5]), ("label", [0.5])),
        zip(["words", "label"], [[2**63 + 1], [1e-05]]),
    ]
    assert run(make(MultiSlotDataGenerator, samples), monkeypatch) == (
        "3 1926 8 17 1 1\n1 -5 1 0.5\n1 9223372036854775809 1 1e-05\n"
    )
    gen = make(MultiSlotDataGenerator, [[("a", [1]), ("b", [2.5, 3])], [("a", [4]), ("b", [5])]])
    assert run(gen, monkeypatch, stdin="0\n1\n") == "1 1 2 2.5 3\n1 4 1 5\n"
    assert gen._proto_info == [("a", "uint64"), ("b", "float")]
    strings = make(MultiSlotStringDataGenerator, [[("w", ["1926", "08"]), ("l", ["x"])]])
    assert run(strings, monkeypatch) == "2 1926 08 1 x\n"
    # numpy scalars are numbers here (Paddle refuses them)
    assert (
        run(make(MultiSlotDataGenerator, [[("a", [np.int64(3), np.float32(0.5)])]]), monkeypatch)
        == "2 3 0.5\n"
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "samples,message",
    [
        (
            [[("a", [1])], [("a", [1]), ("b", [2])]],
            "the complete field set of two given line are inconsistent.",
        ),
        (
            [[("a", [1])], [("b", [1])]],
            "the field name of two given line are not match: require<a>, get<b>.",
        ),
        (
            [[("a", [])]],
            "the elements of each field can not be empty, you need padding it in process().",
        ),
        ([[("a", (1,))]], "must be in list type"),
        ([[(1, [1])]], "must be in str type"),
        ([[("a", ["1"])]], "the type of element<class 'str'> must be in int or float"),
        ([[("a", [True])]], "the type of element<class 'bool'> must be in int or float"),
        (["a 1"], "the output of process() must be in list or tuple type"),
    ],
)
def test_paddles_checks_and_messages(samples, message, monkeypatch) -> None:
    with pytest.raises(ValueError) as info:
        run(make(MultiSlotDataGenerator, samples), monkeypatch)
    assert message in str(info.value)


@pytest.mark.timeout(30)
def test_generate_batch_pads_a_batch(monkeypatch) -> None:
    def pad(self, samples):
        def local_iter():
            width = max(len(s[0][1]) for s in samples)
            for s in samples:
                yield [("ids", s[0][1] + [0] * (width - len(s[0][1])))]

        return local_iter

    samples = [[("ids", [1])], [("ids", [2, 3])], [("ids", [4, 5, 6])], None, [("ids", [7])]]
    gen = make(MultiSlotDataGenerator, samples, pad)
    gen.set_batch(2)
    assert run(gen, monkeypatch) == "2 1 0\n2 2 3\n3 4 5 6\n3 7 0 0\n"


@pytest.mark.skipif(
    PADDLE_GENERATOR is None, reason="no bench/.venv-paddle (bench/setup_paddle_venv.sh)"
)
@pytest.mark.timeout(60)
def test_same_bytes_as_paddles_generator_on_random_samples(monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("paddle_data_generator", PADDLE_GENERATOR)
    paddle_dg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paddle_dg)  # pure Python: no paddle import
    rng = random.Random(0)
    names = ["click", "a", "b", "dense"]
    samples = []
    for _ in range(300):
        samples.append(
            [
                (
                    n,
                    [
                        rng.choice(
                            [
                                rng.randint(-(2**63), 2**64 - 1),
                                rng.random() * 10 ** rng.randint(-8, 8),
                                rng.randint(0, 9),
                            ]
                        )
                        for _ in range(rng.randint(1, 4))
                    ],
                )
                for n in names
            ]
        )
    for ours, theirs in [
        (MultiSlotDataGenerator, paddle_dg.MultiSlotDataGenerator),
        (MultiSlotStringDataGenerator, paddle_dg.MultiSlotStringDataGenerator),
    ]:
        data = (
            samples
            if ours is MultiSlotDataGenerator
            else [[(n, [str(v) for v in vals]) for n, vals in s] for s in samples]
        )
        assert run(make(ours, data), monkeypatch) == run(make(theirs, data), monkeypatch)


@pytest.mark.timeout(60)
def test_a_paddle_reader_runs_as_pipe_command(tmp_path: Path) -> None:
    raw = tmp_path / "raw.csv"
    rows = [(i % 2, [i, i + 1][: i % 3], [i / 4, -i]) for i in range(40)]
    text = "".join(
        f"{lab},{';'.join(map(str, ids))},{';'.join(map(str, d))}\n" for lab, ids, d in rows
    )
    raw.write_text(text + "skip,,\n")
    ds = InMemoryDataset()
    ds.init(
        batch_size=16,
        thread_num=2,
        use_var=[
            Slot("label", dense=True),
            Slot("ids"),
            Slot("dense", dtype="float32", dense=True, dim=2),
        ],
        pipe_command=f"{sys.executable} {SCRIPTS / 'data_reader.py'}",
    )
    ds.set_filelist([str(raw)])
    ds.load_into_memory()
    got = []
    for b in ds:
        v, o = b["ids"].values.tolist(), b["ids"].offsets.tolist()
        got += [
            (int(b["label"][k, 0]), v[o[k] : o[k + 1]], b["dense"][k].tolist())
            for k in range(b.batch_size)
        ]
    assert got == [(lab, ids or [0], [float(np.float32(x)) for x in d]) for lab, ids, d in rows]
