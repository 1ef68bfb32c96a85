"""Check that ``examples/ctr/reader.py`` prints, byte for byte, the MultiSlot text that
``examples/ctr/gen_slot_files.py --format multislot`` writes, under PaddlePaddle's own
``MultiSlotDataGenerator`` (the reader with only its import line swapped, run in
bench/.venv-paddle) and under ours (``fleet.data``, when it has a generator), and that Paddle's
``InMemoryDataset`` loads those files with the right example count.

Run: ``.venv/bin/python bench/check_reader_compat.py [--lines 20000] [--paddle_python P]``.
Exits non-zero on a mismatch, naming the first differing line; a side that cannot run (no Paddle
venv, no fleet.data generator yet) is reported as skipped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import REPO, bench_env
from paddle_venv import SETUP_HINT, find_paddle_python, paddle_env

from examples.ctr.data import CTRDataConfig, generate
from examples.ctr.gen_slot_files import format_multislot, format_paddlerec

READER = os.path.join(REPO, "examples", "ctr", "reader.py")
OUR_IMPORT = "import fleet.data as dg"
PADDLE_IMPORT = "import paddle.distributed.fleet as dg"

PADDLE_LOAD = """
import sys
import paddle
paddle.enable_static()
from examples.ctr.slots import DENSE_SLOT, LABEL_SLOT, NUM_DENSE, SLOT_ORDER
use_var = [paddle.static.data(name=n, shape=[-1, NUM_DENSE if n == DENSE_SLOT else 1],
                              dtype="float32" if n == DENSE_SLOT else "int64",
                              lod_level=0 if n in (LABEL_SLOT, DENSE_SLOT) else 1)
           for n in SLOT_ORDER]
ds = paddle.distributed.InMemoryDataset()
ds.init(batch_size=512, thread_num=2, use_var=use_var, pipe_command=sys.argv[2])
ds.set_filelist([sys.argv[1]])
ds.load_into_memory()
print(ds.get_memory_data_size())
"""


def first_difference(got: bytes, want: bytes) -> str:
    """A message naming the first line where ``got`` and ``want`` differ."""
    g, w = got.splitlines(keepends=True), want.splitlines(keepends=True)
    for i, (a, b) in enumerate(zip(g, w)):
        if a != b:
            return f"line {i + 1} differs:\n  got : {a[:300]!r}\n  want: {b[:300]!r}"
    return (
        f"lengths differ: got {len(g)} lines ({len(got)} bytes), want {len(w)} ({len(want)} bytes)"
    )


def run_reader(python: str, script: str, stdin_path: str, env: dict[str, str]) -> bytes:
    with open(stdin_path, "rb") as f:
        r = subprocess.run(
            [python, script],
            stdin=f,
            capture_output=True,
            env=env,
            cwd=REPO,
            timeout=600,
            check=False,
        )
    if r.returncode != 0:
        raise RuntimeError(
            f"{python} {script} failed ({r.returncode}):\n{r.stderr.decode()[-3000:]}"
        )
    return r.stdout


def check(name: str, got: bytes, want: bytes) -> bool:
    if got == want:
        print(f"[ok]   {name}: {len(want.splitlines())} lines, {len(want)} bytes identical")
        return True
    print(f"[FAIL] {name}: {first_difference(got, want)}")
    return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paddle_python", default=None)
    args = p.parse_args()

    batch = generate(CTRDataConfig(seed=args.seed), args.lines, 0)
    want = "".join(format_multislot(batch)).encode()
    ok = True
    with tempfile.TemporaryDirectory(prefix="reader_compat_") as tmp:
        paddlerec = os.path.join(tmp, "part-paddlerec")
        multislot = os.path.join(tmp, "part-multislot")
        with open(paddlerec, "w") as f:
            f.writelines(format_paddlerec(batch))
        with open(multislot, "wb") as f:
            f.write(want)

        paddle_python = find_paddle_python(args.paddle_python)
        if paddle_python is None:
            print(f"[skip] Paddle: {SETUP_HINT}")
        else:
            with open(READER) as f:
                source = f.read()
            if source.count(OUR_IMPORT) != 1:
                raise SystemExit(f"{READER} must contain {OUR_IMPORT!r} exactly once")
            paddle_reader = os.path.join(tmp, "reader_paddle.py")
            with open(paddle_reader, "w") as f:
                f.write(source.replace(OUR_IMPORT, PADDLE_IMPORT))
            got = run_reader(paddle_python, paddle_reader, paddlerec, paddle_env())
            ok &= check(
                "reader.py under Paddle's MultiSlotDataGenerator == gen_slot_files multislot",
                got,
                want,
            )
            for label, path, pipe in (
                ("multislot files, pipe_command=cat", multislot, "cat"),
                (
                    "paddlerec files, pipe_command=reader.py (Paddle import)",
                    paddlerec,
                    f"{paddle_python} {paddle_reader}",
                ),
            ):
                r = subprocess.run(
                    [paddle_python, "-c", PADDLE_LOAD, path, pipe],
                    capture_output=True,
                    text=True,
                    env=paddle_env(),
                    cwd=REPO,
                    timeout=600,
                    check=False,
                )
                count = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
                if count == str(args.lines):
                    print(f"[ok]   Paddle InMemoryDataset loads {label}: {count} examples")
                else:
                    print(f"[FAIL] Paddle InMemoryDataset, {label}: {count}")
                    ok = False

        try:
            import fleet.data as ours

            has_generator = hasattr(ours, "MultiSlotDataGenerator")
        except ImportError:
            has_generator = False
        if not has_generator:
            print("[skip] ours: fleet.data has no MultiSlotDataGenerator yet")
        else:
            got = run_reader(sys.executable, READER, paddlerec, bench_env())
            ok &= check(
                "reader.py under fleet.data.MultiSlotDataGenerator == gen_slot_files multislot",
                got,
                want,
            )
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
