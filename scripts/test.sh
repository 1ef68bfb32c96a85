#!/usr/bin/env bash
# The test suite: installs the test extras into .venv, then runs pytest (every test has a timeout).
# Extra arguments go to pytest (e.g. scripts/test.sh tests/test_launcher_env.py -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
export PYTHONDONTWRITEBYTECODE=1
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "[test] pytest collected no tests (exit 5): nothing matched the selection" >&2
    exit 0
fi
exit "$rc"
