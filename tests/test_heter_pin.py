"""The CTR heter example's per-role CPU pinning (``--heter_cpus`` and the others), the heter
busy-share benchmark's reading of the heter worker's log, and the runner's record of a
benchmark that skips itself. Fast: no job is launched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench import runner  # noqa: E402
from bench.bench_ps_heter_busy import REST, WAITS, parse_heter_log, shares  # noqa: E402
from bench.spec import Benchmark, claim, ge  # noqa: E402
from collective.errors import ConfigError  # noqa: E402
from examples.ctr.train_heter import parse_args, parse_cpus, role_cpus  # noqa: E402

LOG = """\
2026-01-01 00:00:00 fleet.heter.worker: heter worker 0: trainer 1 stopped
2026-01-01 00:00:00 fleet.heter.worker: heter worker 0: 78 micro-batches, busy 24.12s of the \
27.75s between the first and the last (87%; 30.10s served in all)
2026-01-01 00:00:00 fleet.heter.worker: heter worker 0 phases (s): decode 0.02, wait 100.46, \
forward_backward 22.53, reply 0.21, update 1.38, push 6.28, pull 0.35; 29 forward/backward \
passes, 25 dense pushes, 1 intra-op threads
"""


def test_cpu_lists_and_the_role_mapping() -> None:
    assert parse_cpus("1") == {1}
    assert parse_cpus("0,2-4") == {0, 2, 3, 4}
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(ConfigError, match="not a CPU list"):
            parse_cpus(bad, "--heter_cpus")
    args = parse_args(["--heter_cpus", "1", "--trainer_cpus", "0", "--server_cpus", "0"])
    assert [role_cpus(args, r) for r in ("server", "trainer", "heter")] == [{0}, {0}, {1}]
    assert role_cpus(parse_args([]), "heter") is None  # not pinned by default
    with pytest.raises(ConfigError, match="unknown role"):
        role_cpus(args, "chief")


@pytest.mark.timeout(120)
def test_pin_role_moves_every_thread_of_the_process() -> None:
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import json, os, sys, threading\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from examples.ctr.train_heter import parse_args, pin_role\n"
        "stop = threading.Event()\n"
        "t = threading.Thread(target=stop.wait, daemon=True); t.start()\n"  # a thread started before
        f"got = pin_role(parse_args(['--heter_cpus', '{cpu}']), 'heter')\n"
        "masks = {tid: sorted(os.sched_getaffinity(int(tid)))"
        " for tid in os.listdir('/proc/self/task')}\n"
        "stop.set(); t.join()\n"
        "print(json.dumps([sorted(got), sorted(set(map(tuple, masks.values()))), len(masks)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True
    ).stdout.splitlines()[-1]
    got, masks, threads = json.loads(out)
    assert got == [cpu] and masks == [[cpu]], out  # every thread, not just the caller
    assert threads >= 2, out  # the one started before pin_role, too
    huge = os.cpu_count() or 1
    bad = subprocess.run(
        [
            sys.executable,
            "-c",
            code.replace(f"'--heter_cpus', '{cpu}'", f"'--heter_cpus', '{huge}'"),
        ],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert bad.returncode != 0 and "not among this process's CPUs" in bad.stderr


def test_busy_share_and_its_breakdown_from_the_heter_log() -> None:
    log = parse_heter_log(LOG)
    assert log["micro_batches"] == 78 and log["passes"] == 29
    assert log["busy_s"] == 24.12 and log["span_s"] == 27.75 and log["phase_push"] == 6.28
    s = shares(log)
    assert s["busy"] == pytest.approx(24.12 / 27.75)
    assert s["busy"] + s[REST] == pytest.approx(1.0)
    assert s["forward + backward"] + s["local optimizer step"] == pytest.approx(23.91 / 27.75)
    assert s["dense pushes and pulls (background sender)"] == pytest.approx(6.63 / 27.75)
    assert s[WAITS] > 1  # a micro-batch queued all along
    with pytest.raises(RuntimeError, match="no closing"):
        parse_heter_log("heter worker 0: trainer 0 stopped\n")


def test_runner_records_a_benchmark_that_skips_itself(tmp_path: Path) -> None:
    script = tmp_path / "bench_skips.py"
    script.write_text(
        "import json, sys\n"
        "path = sys.argv[sys.argv.index('--json') + 1]\n"
        "print('skipped: needs 2 CPUs')\n"
        "json.dump({'skipped': 'needs 2 CPUs, has [0]', 'rows': []}, open(path, 'w'))\n"
    )
    bench = Benchmark(
        "ps_heter_busy",
        "ps",
        "t",
        str(script),
        (),
        (),
        (claim("busy", "busy", "^busy", "higher", "1.0", ge(0.8, on="ours")),),
    )
    r = runner.run_one(bench, quick=True, results_dir=tmp_path / "results")
    assert r["status"] == "skipped" and r["reason"] == "needs 2 CPUs, has [0]"
    saved = json.loads((tmp_path / "results" / "ps_heter_busy.quick.json").read_text())
    assert saved["status"] == "skipped" and saved["claims"][0]["figure"] is None
