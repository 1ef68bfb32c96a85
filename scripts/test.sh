#!/usr/bin/env bash
# The test suite: installs the test extras into .venv, checks the import contracts and ruff, then
# runs pytest (every test has a timeout). Tests marked `slow` (benchmark-like runs and the
# further variants of a capability another test already covers) are left out unless
# FLEET_TESTS=all; a `-m` among the arguments replaces that selection.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/test_launcher_env.py -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
export PYTHONDONTWRITEBYTECODE=1
# The import contracts of pyproject.toml (layers, no torch in the launcher's start): a broken
# contract fails the run before any test. Import cycles are tests/test_layout.py's.
echo "[test] lint-imports (import contracts in pyproject.toml)"
if ! contracts=$(.venv/bin/lint-imports --no-cache 2>&1); then
    echo "$contracts" >&2
    echo "[test] import contracts broken (see above)" >&2
    exit 1
fi
echo "$contracts" | sed -n '/^Contracts:/,$p'
# Lint (rules in pyproject.toml [tool.ruff]): findings or unformatted files fail the run.
echo "[test] ruff check, ruff format --check"
.venv/bin/ruff check --quiet . || { echo "[test] ruff check failed (fix, or ruff check --fix)" >&2; exit 1; }
.venv/bin/ruff format --check --quiet . || { echo "[test] unformatted files (run .venv/bin/ruff format)" >&2; exit 1; }
select=(-m "not slow")
if [ "${FLEET_TESTS:-}" = all ]; then
    select=()
fi
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "${select[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "[test] pytest collected no tests (exit 5): nothing matched the selection" >&2
    exit 0
fi
exit "$rc"
