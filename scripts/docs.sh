#!/usr/bin/env bash
# The documentation site (MkDocs + Material; the reference is generated from the code).
# Usage:
#   bash scripts/docs.sh                    build into site/ (strict: any warning fails the build)
#   bash scripts/docs.sh serve [--port N]   serve on http://127.0.0.1:N/ (default 8000, or
#                                           $DOCS_PORT), rebuilding on changes; warnings are
#                                           printed but do not stop the server
# Both first create or refresh .venv with the docs extra (scripts/setup_venv.sh docs).
set -euo pipefail
cd "$(dirname "$0")/.."

USAGE="usage: docs.sh [build | serve [--port N]]"
CMD="${1:-build}"
[ $# -gt 0 ] && shift
case "$CMD" in
    build | serve) ;;
    *) echo "docs.sh: unknown command '$CMD' ($USAGE)" >&2; exit 2 ;;
esac
PORT="${DOCS_PORT:-8000}"
while [ $# -gt 0 ]; do
    case "$1" in
        --port) PORT="${2:?--port needs a number}"; shift 2 ;;
        --port=*) PORT="${1#--port=}"; shift ;;
        *) echo "docs.sh: unknown argument '$1' ($USAGE)" >&2; exit 2 ;;
    esac
done

bash scripts/setup_venv.sh docs
export NO_MKDOCS_2_WARNING=1  # Material's banner about its successor, printed on every run

if [ "$CMD" = build ]; then
    echo "[docs] mkdocs build --strict -> site/"
    exec .venv/bin/python -m mkdocs build --strict --site-dir site
fi
echo "[docs] serving on http://127.0.0.1:$PORT/ (Ctrl-C stops)"
exec .venv/bin/python -m mkdocs serve --no-strict --dev-addr "127.0.0.1:$PORT"
