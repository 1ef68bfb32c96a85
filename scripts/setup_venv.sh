#!/usr/bin/env bash
# Create or refresh .venv and install fleetrun (editable) with the given extras.
# torch is pinned through constraints.txt (2.13.0, CPU build); pyproject declares the range.
# Usage: scripts/setup_venv.sh [EXTRAS]      e.g. scripts/setup_venv.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"fleetrun needs Python >= 3.10, found {sys.version.split()[0]}; set PYTHON=python3.11")
PY
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
SPEC="."
if [ -n "${1:-}" ]; then SPEC=".[$1]"; fi
echo "[setup] installing fleetrun $SPEC (torch pinned by constraints.txt)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e "$SPEC" \
    2> >(grep -v -e "^WARNING: Location" -e "BuildBackendWarning" >&2 || true)
