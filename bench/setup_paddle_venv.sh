#!/usr/bin/env bash
# Create or refresh bench/.venv-paddle: PaddlePaddle 3.3.1 (CPU, from PyPI) + numpy, the peer that
# bench/bench_data_load.py and bench/check_reader_compat.py measure against. Bench-only: never a
# dependency of fleetrun, gitignored, and nothing of the project is installed into it (the
# benches run the project's files there with PYTHONPATH). About 900 MB on disk.
# Usage: bench/setup_paddle_venv.sh          (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
PADDLE_VERSION="${PADDLE_VERSION:-3.3.1}"
"$PYTHON" - <<'PY'
import sys
if not (3, 9) <= sys.version_info[:2] <= (3, 13):
    sys.exit(f"paddlepaddle wheels need Python 3.9-3.13, found {sys.version.split()[0]}; set PYTHON=")
PY
if [ ! -x .venv-paddle/bin/python ]; then
    echo "[setup-paddle] creating bench/.venv-paddle with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv-paddle
fi
echo "[setup-paddle] installing paddlepaddle==$PADDLE_VERSION (CPU) and numpy"
.venv-paddle/bin/python -m pip install --quiet --disable-pip-version-check \
    "paddlepaddle==$PADDLE_VERSION" numpy \
    2> >(grep -v -e "^WARNING: Location" >&2 || true)
# the check a bench relies on: the dataset API loads MultiSlot text in one process
.venv-paddle/bin/python - <<'PY' 2> >(grep -v -i -e "warn" >&2 || true)
import os, tempfile
import paddle
paddle.enable_static()
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "a.txt")
    with open(path, "w") as f:
        f.write("1 0 2 -5 7 3 0.5 1e-05 2.0\n1 1 1 9 3 0.25 0.125 1.0\n")
    use_var = [
        paddle.static.data(name="click", shape=[-1, 1], dtype="int64", lod_level=0),
        paddle.static.data(name="ids", shape=[-1, 1], dtype="int64", lod_level=1),
        paddle.static.data(name="dense", shape=[-1, 3], dtype="float32", lod_level=0),
    ]
    ds = paddle.distributed.InMemoryDataset()
    ds.init(batch_size=2, thread_num=1, use_var=use_var, pipe_command="cat")
    ds.set_filelist([path])
    ds.load_into_memory()
    assert ds.get_memory_data_size() == 2, ds.get_memory_data_size()
print(f"[setup-paddle] paddle {paddle.__version__}: InMemoryDataset loads MultiSlot text")
PY
