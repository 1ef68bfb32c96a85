#!/usr/bin/env bash
# Create or refresh bench/.venv-paddle26: PaddlePaddle 2.6.2 (CPU, from PyPI), the last wheel with
# the parameter-server core (3.x dropped it), the peer bench/bench_ps_paddle.py measures against.
# Bench-only: never a dependency of fleetrun, gitignored, nothing of the project installed into
# it (the Paddle-side scripts run with the repository on PYTHONPATH and import neither torch nor
# fleet). Paddle 2.6.2 needs protobuf 3.20 and numpy 1.x; the bench runs it with
# PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python (see bench/bench_ps_paddle_worker.py).
# Usage: bench/setup_paddle26_venv.sh          (PYTHON=python3.10 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
"$PYTHON" - <<'PY'
import sys
if not (3, 8) <= sys.version_info[:2] <= (3, 12):
    sys.exit(f"paddlepaddle 2.6.2 wheels need Python 3.8-3.12, found {sys.version.split()[0]}; set PYTHON=")
PY
if [ ! -x .venv-paddle26/bin/python ]; then
    echo "[setup-paddle26] creating bench/.venv-paddle26 with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv-paddle26
fi
echo "[setup-paddle26] installing paddlepaddle==2.6.2 (CPU), protobuf==3.20.3, numpy<2"
.venv-paddle26/bin/python -m pip install --quiet --disable-pip-version-check \
    "paddlepaddle==2.6.2" "protobuf==3.20.3" "numpy<2" \
    2> >(grep -v -e "^WARNING: Location" >&2 || true)
PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python .venv-paddle26/bin/python - <<'PY' 2> >(grep -v -i -e "warn" >&2 || true)
import paddle
import paddle.distributed.fleet as fleet  # noqa: F401  (the PS API the bench drives)
print(f"[setup-paddle26] paddle {paddle.__version__} with fleet importable")
PY
