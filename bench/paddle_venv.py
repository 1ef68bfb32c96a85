"""Where the benchmarks find PaddlePaddle: the bench-only virtualenv ``bench/.venv-paddle``
(made by ``bench/setup_paddle_venv.sh``), never the project's venv.

The Paddle side of a benchmark runs in a subprocess of that venv's Python with the repository on
``PYTHONPATH`` (for ``examples.ctr`` and the worker scripts, which import neither torch nor
fleet), and times itself inside the subprocess.
"""

from __future__ import annotations

import os

from common import REPO, bench_env

DEFAULT_PADDLE_PYTHON = os.path.join(REPO, "bench", ".venv-paddle", "bin", "python")
SETUP_HINT = "run bench/setup_paddle_venv.sh to measure PaddlePaddle's column"


def find_paddle_python(path: str | None = None) -> str | None:
    """The Paddle venv's interpreter (``path``, else $FLEET_BENCH_PADDLE_PYTHON, else the
    default), or None when it is not there."""
    path = path or os.environ.get("FLEET_BENCH_PADDLE_PYTHON") or DEFAULT_PADDLE_PYTHON
    return path if os.access(path, os.X_OK) else None


def paddle_env() -> dict[str, str]:
    """:func:`common.bench_env` plus the repository on PYTHONPATH and Paddle's legacy static
    graph (``train_from_dataset`` and LoD slots need it in 3.3; PIR marks every slot dense)."""
    env = bench_env()
    env["PYTHONPATH"] = REPO
    env["FLAGS_enable_pir_api"] = "0"
    env["GLOG_minloglevel"] = "2"  # Paddle's INFO lines on stderr
    return env
