"""Every tracked file speaks of the software, not of how it was developed.

No file in the repository refers to development history: work sittings ("session 3"), who ran
what ("the lead", "the helpers' tests"), or tracker numbers used as references ("issue #17",
"(#15)"). Such notes belong in commit messages, not in code, docs or results. This file is the
one exception: it has to spell the patterns out.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(REPO).as_posix()

# (pattern, what it is): case-insensitive, matched line by line.
PATTERNS: list[tuple[str, str]] = [
    (r"\bsessions? [0-9]+\b", "a development session"),
    (r"\b(this|last|next|previous|earlier|a later) session'?s?\b", "a development session"),
    (r"\bhelpers?'?s? (tests|runs|benchmarks|work)\b", "the developers' helpers"),
    (r"\bthe lead\b", "the lead developer"),
    (r"\bissues? #?[0-9]+\b", "an issue number"),
    (r"(^|[\s(\[])#[0-9]{1,3}\b", "an issue number"),
]
# Binary and generated files are not prose.
SKIP_SUFFIXES = (".png", ".jpg", ".gz", ".so", ".pyc", "_pb2.py", "_pb2_grpc.py", ".json")


def tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30
    ).stdout
    names = [n for n in out.decode().split("\0") if n]
    return [n for n in names if n != THIS and not n.endswith(SKIP_SUFFIXES)]


def find_words(text: str) -> list[tuple[int, str, str]]:
    """(line number, line, what) for every line of ``text`` that matches a pattern."""
    compiled = [(re.compile(p, re.IGNORECASE), what) for p, what in PATTERNS]
    hits = []
    for no, line in enumerate(text.splitlines(), 1):
        for rx, what in compiled:
            if rx.search(line):
                hits.append((no, line.strip(), what))
                break
    return hits


@pytest.mark.timeout(60)
def test_patterns_catch_what_they_mean() -> None:
    bad = ["measured in session 4", "the helpers' tests", "issue #17 item 3", "lifted by #15,"]
    good = ["os.setsid() starts a new session", "a helper function", "color #ffffff", "# 15 steps"]
    assert all(find_words(s) for s in bad)
    assert not any(find_words(s) for s in good)


@pytest.mark.timeout(60)
def test_tracked_files_speak_of_the_software() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    found = []
    for name in tracked_files():
        path = REPO / name
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{no}: {what}: {line[:120]}" for no, line, what in find_words(text)]
    assert not found, (
        "these lines speak of how the project was developed, not of the software; say what "
        "the software does instead (the history belongs in commit messages):\n" + "\n".join(found)
    )
