"""`python -m bench`: the registry covers every script, result files keep their schema, the
runner records failures and skips without stopping, and the benchmarks page renders from a
results folder (with and without results). Fast: no benchmark is actually run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import page, registry, runner  # noqa: E402
from bench.registry import Benchmark, Claim, ge, le  # noqa: E402

STATS_KEYS = {"median", "min", "max", "n"}
RESULT_KEYS = {
    "schema",
    "benchmark",
    "title",
    "area",
    "date",
    "mode",
    "command",
    "commit",
    "dirty",
    "machine",
    "status",
    "reason",
    "wall_s",
    "figures",
    "claims",
}


def validate_result(r: dict) -> list[str]:
    """What is wrong with a result file (empty when it keeps the schema)."""
    errors = [f"missing {k}" for k in RESULT_KEYS - set(r)]
    if errors:
        return errors
    if r["schema"] != runner.SCHEMA_VERSION:
        errors.append(f"schema {r['schema']}")
    if r["benchmark"] not in registry.BY_NAME:
        errors.append(f"unknown benchmark {r['benchmark']}")
    if r["mode"] not in ("quick", "full"):
        errors.append(f"mode {r['mode']}")
    if r["status"] not in ("ok", "skipped", "failed"):
        errors.append(f"status {r['status']}")
    if r["status"] != "ok" and not r["reason"]:
        errors.append("a skip or failure without a reason")
    if not re.fullmatch(r"[0-9a-f]{40}|unknown", r["commit"]):
        errors.append(f"commit {r['commit']}")
    m = r["machine"]
    for k in ("cores", "cpu_model", "python", "torch"):
        if k not in m:
            errors.append(f"machine lacks {k}")
    if r["status"] == "ok":
        for k in ("load_before", "load_after"):
            if len(m.get(k, [])) != 3:
                errors.append(f"machine {k} is not the 3 load averages")
    for f in r["figures"]:
        for side in ("ours", "peer"):
            if f[side] is not None and set(f[side]) != STATS_KEYS:
                errors.append(f"figure {f['label']!r} {side} keys {sorted(f[side])}")
        if f["ours"] and f["ours"]["min"] > f["ours"]["median"] + 1e-12:
            errors.append(f"figure {f['label']!r}: min above the median")
    for c in r["claims"]:
        for k in ("claim", "label", "ours", "peer", "ratio", "goal", "met", "better"):
            if k not in c:
                errors.append(f"claim lacks {k}")
    return errors


def test_every_script_is_registered_or_a_helper():
    scripts = {f"bench/{p.name}" for p in (REPO / "bench").glob("bench_*.py")}
    registered = {b.script for b in registry.BENCHMARKS}
    left = scripts - registered - set(registry.HELPERS)
    assert not left, f"register these in bench/catalog_*.py or list them in HELPERS: {left}"
    for path in registered | set(registry.HELPERS):
        assert (REPO / path).exists(), path
    assert not registered & set(registry.HELPERS)


def test_registry_entries_are_consistent():
    names = [b.name for b in registry.BENCHMARKS]
    assert len(names) == len(set(names))
    for b in registry.BENCHMARKS:
        assert b.area in registry.AREAS, b.name
        assert b.claims, b.name
        assert set(b.requires) <= set(registry.REQUIREMENTS), b.name
        if b.quick_args is None:
            assert b.not_quick, f"{b.name}: say why it has no quick mode"
        else:
            reps = list(b.quick_args)
            if "--reps" in reps:
                assert int(reps[reps.index("--reps") + 1]) >= 5, b.name
        ids = [c.id for c in b.claims]
        assert len(ids) == len(set(ids)), b.name
        for c in b.claims:
            re.compile(c.figure)
            assert c.better in ("lower", "higher"), (b.name, c.id)
            assert not c.requires or c.requires in registry.REQUIREMENTS
            for g in c.goals:
                assert g.on in ("ratio", "ours", "absdiff") and g.op in ("<=", ">="), (b.name, c.id)
        assert (REPO / "bench" / "notes" / f"{b.name}.md").exists(), f"notes for {b.name}"


def test_scripts_without_report_json_have_an_extractor():
    from bench import extract

    for b in registry.BENCHMARKS:
        text = (REPO / b.script).read_text()
        assert "--json" in text, f"{b.script} takes no --json"
        if b.extract is extract.report_rows:
            assert "json_path=" in text, (
                f"{b.name}: its JSON is not report()'s; give it an extractor"
            )


def test_goals_and_claims():
    assert le(1.1).holds(None, None, 1.05) is True
    assert ge(0.5).holds(None, None, 0.4) is False
    assert le(0.01, "absdiff").holds(0.765, 0.766, None) is True
    assert le(2.0, "ours").holds(None, 1.0, 0.5) is None
    bench = registry.get("launch")
    fig = {
        "label": "rank death to launcher exit",
        "unit": "s",
        "ours": {"median": 0.3, "min": 0.2, "max": 0.9, "n": 5},
        "peer": {"median": 0.6, "min": 0.5, "max": 1.5, "n": 5},
        "ratio": 0.5,
    }
    claims = runner.claims_of(bench, [fig], quick=False)
    assert [c["met"] for c in claims] == [None, True]  # launch-to-exit missing: not judged
    assert claims[0]["figure"] is None
    with pytest.raises(KeyError, match="python -m bench list"):
        registry.get("nope")


def _fake_bench(tmp_path: Path, body: str, **kw) -> Benchmark:
    script = tmp_path / "bench_fake.py"
    script.write_text(body)
    return Benchmark(
        "launch",
        "launcher",
        "fake",
        str(script),
        (),
        (),
        (
            Claim("c", "fake claim", "^row", "lower", "peer", (le(1.0),)),
            Claim("d", "absent claim", "^nothing", "lower", "peer", (le(1.0),)),
        ),
        **kw,
    )


REPORT = """
import json, sys
path = sys.argv[sys.argv.index("--json") + 1]
row = {"label": "row one", "ours": {"median": 1.0, "min": 0.9, "max": 1.2, "n": 5},
       "peer": {"median": 2.0, "min": 1.8, "max": 2.5, "n": 5}, "ratio": 0.5}
json.dump({"title": "t", "unit": "s", "rows": [row]}, open(path, "w"))
"""


def test_runner_writes_a_valid_result_and_keeps_ok_over_failures(tmp_path):
    ok = _fake_bench(tmp_path, REPORT)
    r = runner.run_one(ok, quick=True, results_dir=tmp_path / "results")
    assert r["status"] == "ok", r["reason"]
    path = tmp_path / "results" / "launch.quick.json"
    saved = json.loads(path.read_text())
    assert validate_result(saved) == []
    assert saved["claims"][0]["met"] is True and saved["claims"][0]["ratio"] == 0.5
    assert saved["claims"][1]["figure"] is None

    bad = _fake_bench(tmp_path, "import sys; print('boom'); sys.exit(3)")
    r = runner.run_one(bad, quick=True, results_dir=tmp_path / "results")
    assert r["status"] == "failed" and "exit 3" in r["reason"] and "boom" in r["reason"]
    assert "kept" in r and json.loads(path.read_text())["status"] == "ok"

    slow = _fake_bench(tmp_path, "import time; time.sleep(30)")
    r = runner.run_one(slow, quick=False, results_dir=tmp_path / "results", timeout=1)
    assert r["status"] == "failed" and "timed out" in r["reason"]
    assert validate_result(json.loads((tmp_path / "results" / "launch.json").read_text())) == []


def test_refresh_recomputes_claims_from_the_kept_json(tmp_path):
    path = tmp_path / "allreduce.quick.json"
    raw = {
        "results": {
            "4": {
                "reps": 5,
                "busbw_gbs": {
                    "ours": {"median": 1.0, "min": 0.9, "max": 1.1},
                    "torch": {"median": 1.0, "min": 0.9, "max": 1.2},
                },
            }
        }
    }
    result = {"benchmark": "allreduce", "mode": "quick", "raw": raw, "figures": [], "claims": []}
    path.write_text(json.dumps(result))
    assert runner.refresh(tmp_path) == [path.name]
    claims = json.loads(path.read_text())["claims"]
    assert [(c["figure"], c["ratio"], c["met"]) for c in claims] == [
        ("bus bandwidth, 4 MiB", 1.0, True)
    ]


def test_runner_skips_a_benchmark_without_its_requirement(tmp_path, monkeypatch):
    bench = _fake_bench(tmp_path, REPORT, requires=("paddle26",))
    monkeypatch.setattr(runner, "has_requirement", lambda name: False)
    r = runner.run_one(bench, quick=False, results_dir=tmp_path)
    assert r["status"] == "skipped" and "setup_paddle26_venv.sh" in r["reason"]
    assert validate_result(json.loads((tmp_path / "launch.json").read_text())) == []
    assert "launch" in runner.summary_table([r])


def test_committed_results_keep_the_schema():
    for path in sorted((REPO / "bench" / "results").glob("*.json")):
        r = json.loads(path.read_text())
        assert validate_result(r) == [], path.name
        assert path.name == f"{r['benchmark']}{'.quick' if r['mode'] == 'quick' else ''}.json"


def test_page_renders_without_results(tmp_path):
    md = page.render(tmp_path)
    assert "No results yet" in md
    for area in registry.AREAS.values():
        assert f"## {area}" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and "Claim" not in ln]
    assert len(rows) == sum(len(b.claims) for b in registry.BENCHMARKS)
    assert all("not measured by `python -m bench run` yet" in ln for ln in rows)
    assert "`python -m bench run --only ps_paddle`" in md
    assert "session" not in md.lower()


def test_page_renders_a_result_and_prefers_full_runs(tmp_path):
    bench = _fake_bench(tmp_path, REPORT)
    runner.run_one(bench, quick=True, results_dir=tmp_path)
    md = page.render(tmp_path)
    line = next(ln for ln in md.splitlines() if "fake claim" in ln)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1].startswith("1 s [0.9 .. 1.2] (n=5)")
    assert cells[3] == "0.500" and cells[5] == "yes" and cells[6].startswith("quick, ")
    assert "--only launch --quick" in cells[7]
    assert "not measured by this quick run" in md  # the claim without a figure
    full = json.loads((tmp_path / "launch.quick.json").read_text())
    full["mode"] = "full"
    full["claims"][0]["ours"]["median"] = 1.5
    (tmp_path / "launch.json").write_text(json.dumps(full))
    line = next(ln for ln in page.render(tmp_path).splitlines() if "fake claim" in ln)
    assert "| 1.5 s" in line and "full, " in line


def test_page_marker_and_docs_hook(tmp_path):
    assert page.replace_marker("no marker") == "no marker"
    out = page.replace_marker(f"# B\n\n{page.MARKER}\n", results_dir=tmp_path)
    assert page.MARKER not in out and "## Launcher" in out
    assert page.MARKER in (REPO / "docs" / "benchmarks.md").read_text()
    hook = REPO / "scripts" / "docs_hooks" / "benchmarks.py"
    code = (
        "import sys, runpy, types; m = runpy.run_path(sys.argv[1]);"
        "p = types.SimpleNamespace(file=types.SimpleNamespace(src_uri='benchmarks.md'));"
        "out = m['on_page_markdown']('x <!-- benchmarks:tables -->', p, {}, None);"
        "assert '## Launcher' in out; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code, str(hook)], check=True, cwd=REPO)


def test_cli_list_and_usage_errors():
    out = subprocess.run(
        [sys.executable, "-m", "bench", "list"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    for b in registry.BENCHMARKS:
        assert b.name in out
    r = subprocess.run(
        [sys.executable, "-m", "bench", "run", "--quick", "--only", "ps_chaos"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode != 0 and "no quick mode" in (r.stdout + r.stderr)
    r = subprocess.run(
        [sys.executable, "-m", "bench", "run", "--quick", "--list"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    assert "import: python bench/bench_import.py" in r.stdout and "ps_chaos" not in r.stdout
