"""MkDocs hook: the benchmarks page's tables, generated at build time from the latest results.

``docs/benchmarks.md`` holds the marker ``<!-- benchmarks:tables -->``; this hook replaces it
with the tables :func:`bench.page.render` builds from ``bench/results/*.json`` and the notes in
``bench/notes/``. A benchmark without a result gets its rows marked "not measured by
``python -m bench run`` yet" and the command that measures it. Imports no torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import page as bench_page  # noqa: E402 - the repository root is on sys.path first

PAGE = "benchmarks.md"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the marker of the benchmarks page with the generated tables."""
    if page.file.src_uri != PAGE:
        return markdown
    return bench_page.replace_marker(markdown)


def on_config(config: Any) -> Any:
    """Rebuild the page on ``mkdocs serve`` when a result or a note changes."""
    watch = config.get("watch")
    if isinstance(watch, list):
        for path in (bench_page.RESULTS, bench_page.NOTES):
            if path.is_dir() and str(path) not in watch:
                watch.append(str(path))
    return config
