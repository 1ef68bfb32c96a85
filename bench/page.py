"""The benchmarks page's tables, generated from the latest result files and the notes.

:func:`render` returns Markdown: per area, one table row per claim (ours, the peer, the ratio,
the goal, whether it is met, which run the figure is from and the command that reproduces it),
then the notes of that area's benchmarks (``bench/notes/<name>.md``: why a figure is what it
is). A benchmark without a result file still gets its rows, marked "not measured by
``python -m bench run`` yet". A full run's result is preferred to a quick run's.

Imports neither torch nor the benchmark scripts: the MkDocs hook calls it at build time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.registry import AREAS, BENCHMARKS, REQUIREMENTS, Benchmark

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
NOTES = REPO / "bench" / "notes"
MARKER = "<!-- benchmarks:tables -->"

HEADER = (
    "| Claim | Ours | Peer / limit | Ratio | Goal | Met | Measured | Reproduce |\n"
    "|---|---|---|---|---|---|---|---|"
)


def load_result(results_dir: Path, name: str) -> dict[str, Any] | None:
    """The result to show for ``name``: a full run's ok result, else a quick run's ok result,
    else whichever file exists (skipped or failed), else None."""
    found = []
    for suffix in ("", ".quick"):
        path = Path(results_dir) / f"{name}{suffix}.json"
        if path.exists():
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError) as err:
                found.append({"status": "failed", "reason": f"unreadable {path.name}: {err}"})
    for r in found:
        if r.get("status") == "ok":
            return r
    return found[0] if found else None


def num(v: float) -> str:
    """A number with about three significant digits, without exponents for usual sizes."""
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a == 0:
        return "0"
    return f"{v:.3g}"


def ratio_text(ratio: float | None) -> str:
    """A ratio with three decimals (three significant digits from 10 up)."""
    if ratio is None:
        return "—"
    return f"{ratio:.3f}" if abs(ratio) < 10 else num(ratio)


def value(stats: dict[str, Any] | None, unit: str | None) -> str:
    """``median unit [min .. max] (n)`` of a figure's side."""
    if not stats:
        return "—"
    if unit == "bool":
        return "yes" if stats["median"] else "**no**"
    if unit == "AUC":
        text = f"AUC {stats['median']:.4f}"
        if stats.get("n", 0) > 1:
            text += f" [{stats['min']:.4f} .. {stats['max']:.4f}] (n={stats['n']})"
        return text
    sep = "" if unit == "x" else " "
    shown = "" if unit in (None, "share") else unit
    text = f"{num(stats['median'])}{sep}{shown}".rstrip()
    if stats.get("n", 0) > 1:
        text += f" [{num(stats['min'])} .. {num(stats['max'])}] (n={stats['n']})"
    return text


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def met_text(claim: dict[str, Any], mode: str) -> str:
    """yes / **no** / — (informational) / not judged (quick sizes)."""
    if claim["met"] is True:
        return "yes"
    if claim["met"] is False:
        return "**no**"
    if claim.get("figure") and not claim.get("judged") and claim["goal"] != "informational":
        return f"not judged ({mode} sizes)"
    return "—"


def reproduce(bench: Benchmark, quick: bool) -> str:
    """The command that reproduces a row."""
    return f"`python -m bench run --only {bench.name}{' --quick' if quick else ''}`"


def bench_rows(bench: Benchmark, result: dict[str, Any] | None) -> list[str]:
    """The table rows of one benchmark."""
    if result is None or not result.get("claims"):
        status = (result or {}).get("status")
        why = (
            f"{status}: {(result or {}).get('reason') or ''}"
            if status in ("skipped", "failed")
            else "not measured by `python -m bench run` yet"
        )
        if bench.requires and status is None:
            why += "; needs " + "; ".join(REQUIREMENTS[r] for r in bench.requires)
        return [
            f"| {cell(c.label)} | {cell(why)} | {cell(c.peer)} | — | {cell(c.goal_description())}"
            f" | — | — | {reproduce(bench, False)} |"
            for c in bench.claims
        ]
    quick = result.get("mode") == "quick"
    date = str(result.get("date", ""))[:10]
    rows = []
    for c in result["claims"]:
        if c.get("figure") is None:
            if result.get("status") != "ok":
                ours = f"{result['status']}: {(result.get('reason') or '').splitlines()[0]}"
            else:
                req = next((x.requires for x in bench.claims if x.id == c["claim"]), "")
                ours = (
                    f"not measured: needs {REQUIREMENTS[req]}"
                    if req
                    else f"not measured by this {result.get('mode')} run"
                )
            rows.append(
                f"| {cell(c['label'])} | {cell(ours)} | {cell(c['peer_name'])} | — | "
                f"{cell(c['goal'])} | — | {result.get('mode')}, {date} | "
                f"{reproduce(bench, quick)} |"
            )
            continue
        peer = value(c["peer"], c["unit"])
        peer = f"{peer}<br>{c['peer_name']}" if c.get("peer") else c["peer_name"]
        ratio = ratio_text(c.get("ratio"))
        rows.append(
            f"| {cell(c['label'])} | {cell(value(c['ours'], c['unit']))} | {cell(peer)} | "
            f"{ratio} | {cell(c['goal'])} | {met_text(c, result.get('mode', ''))} | "
            f"{result.get('mode')}, {date} | {reproduce(bench, quick)} |"
        )
    return rows


def machines(results: list[dict[str, Any]]) -> str:
    """The machines the shown results come from, in one sentence."""
    seen: dict[str, list[str]] = {}
    loads: list[float] = []
    for r in results:
        m = r.get("machine") or {}
        if not m:
            continue
        loads += [m[k][0] for k in ("load_before", "load_after") if m.get(k)]
        key = (
            f"{m.get('cores')} cores ({m.get('cpu_model')}), Python {m.get('python')}, "
            f"torch {m.get('torch')}"
        )
        seen.setdefault(key, []).append(str(r.get("date", ""))[:10])
    if not seen:
        return "No results yet: run `python -m bench run --quick`."
    parts = [
        f"{k}, {min(v)}" + (f" to {max(v)}" if max(v) != min(v) else "") for k, v in seen.items()
    ]
    text = "Measured on " + "; ".join(parts) + "."
    if loads:
        text += (
            f" The 1-minute load average was {min(loads):.1f} to {max(loads):.1f} at the starts "
            "and ends of these runs."
        )
    return text


def notes(bench: Benchmark, notes_dir: Path) -> str:
    """The benchmark's notes, or an empty string."""
    path = Path(notes_dir) / f"{bench.name}.md"
    return path.read_text().strip() if path.exists() else ""


def render(results_dir: Path = RESULTS, notes_dir: Path = NOTES) -> str:
    """The generated part of the benchmarks page."""
    shown: list[dict[str, Any]] = []
    out: list[str] = []
    for area, heading in AREAS.items():
        benches = [b for b in BENCHMARKS if b.area == area]
        if not benches:
            continue
        out += [f"## {heading}", "", HEADER]
        for b in benches:
            result = load_result(results_dir, b.name)
            if result is not None and result.get("status") == "ok":
                shown.append(result)
            out += bench_rows(b, result)
        out.append("")
        slow = [b for b in benches if b.quick_args is None]
        if slow:
            out += [
                "Not in `--quick`: " + "; ".join(f"`{b.name}` ({b.not_quick})" for b in slow) + ".",
                "",
            ]
        for b in benches:
            text = notes(b, notes_dir)
            cmds = f"Full: `{' '.join(['python', b.script, *b.full_args])}`"
            if b.quick_args is not None:
                cmds += f"; quick: `{' '.join(['python', b.script, *b.quick_args])}`"
            out += [f"### {b.title}", "", f"{cmds}.", ""]
            if text:
                out += [text, ""]
    return "\n".join([machines(shown), "", *out])


def replace_marker(markdown: str, results_dir: Path = RESULTS, notes_dir: Path = NOTES) -> str:
    """``markdown`` with :data:`MARKER` replaced by :func:`render`'s tables."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render(results_dir, notes_dir))
