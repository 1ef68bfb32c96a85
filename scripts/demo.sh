#!/usr/bin/env bash
# The main demo: a real 2-rank data-parallel job on CPU (gloo) under fleetrun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/fleetrun --nproc_per_node 2 --log_dir log/demo examples/dp/train.py "$@"
