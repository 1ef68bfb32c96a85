"""Binding a process to its share of the host's CPUs (:mod:`collective.cpu_share`): the shares
partition the CPUs, a bad value is refused naming it, and a real process started through the
bootstrap or as ``python -m ps_server`` runs every thread on its share."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from collective.cpu_share import apply_cpu_share, format_cpus, parse_cpu_share, share_of
from collective.errors import ConfigError

CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("ncpus", [1, 2, 3, 8, 13])
def test_shares_partition_the_cpus(ncpus: int) -> None:
    cpus = list(range(100, 100 + ncpus))
    for count in range(1, ncpus + 1):
        parts = [share_of(cpus, i, count) for i in range(count)]
        assert sorted(c for p in parts for c in p) == cpus  # disjoint, every CPU
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert all(p == sorted(p) and p == list(range(p[0], p[0] + len(p))) for p in parts)
    # more shares than CPUs: round robin, one CPU each
    assert [share_of(cpus, i, ncpus + 2)[0] for i in range(ncpus + 2)] == [
        cpus[i % ncpus] for i in range(ncpus + 2)
    ]


@pytest.mark.parametrize("value", ["", "1", "a/2", "2/2", "0/0", "-1/2", "1/2/3"])
def test_a_bad_share_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match="FLEET_PS_CPU_SHARE") as err:
        parse_cpu_share(value)
    assert repr(value) in str(err.value)


def test_format_cpus() -> None:
    assert format_cpus([0, 1, 2, 3, 6]) == "0-3,6"
    assert format_cpus([4]) == "4"
    assert format_cpus([5, 0, 2, 3]) == "0,2-3,5"


def test_no_share_leaves_the_process_alone() -> None:
    env: dict[str, str] = {}
    assert apply_cpu_share(env) is None
    assert sorted(os.sched_getaffinity(0)) == CPUS


_SCRIPT = """
import json, os, sys, threading
threads = {}
def record():
    threads["late"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=record); t.start(); t.join()
print(json.dumps({"main": sorted(os.sched_getaffinity(0)), **threads,
                  "env": os.environ.get("FLEET_PS_CPU_SHARE")}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    env.pop("FLEET_PS_CPU_SHARE", None)
    return {**env, **extra}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", [0, 1])
def test_the_bootstrap_binds_a_worker_to_its_share(tmp_path: Path, index: int) -> None:
    import json

    script = tmp_path / "show.py"
    script.write_text(_SCRIPT)
    r = subprocess.run(
        [sys.executable, "-m", "collective.bootstrap", str(script)],
        env=_env(FLEET_PS_CPU_SHARE=f"{index}/2"),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["main"] == got["late"] == share_of(CPUS, index, 2)
    assert got["env"] is None  # dropped: a process it starts is not bound to a share of it


@pytest.mark.timeout(60)
def test_a_bad_share_fails_the_worker_naming_it(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(_SCRIPT)
    r = subprocess.run(
        [sys.executable, "-m", "collective.bootstrap", str(script)],
        env=_env(FLEET_PS_CPU_SHARE="3/2"),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert r.returncode != 0
    assert "FLEET_PS_CPU_SHARE" in r.stderr and "'3/2'" in r.stderr


def _thread_cpus(pid: int) -> dict[int, str]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        line = next(x for x in text.splitlines() if x.startswith("Cpus_allowed_list:"))
        out[int(tid)] = line.split(":", 1)[1].strip()
    return out


@pytest.mark.timeout(60)
def test_ps_server_cpu_share_binds_every_thread() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ps_server", "--port", "0", "--cpu_share", "1/2",
         "--log_level", "INFO"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving on" in line
        deadline = time.monotonic() + 10
        threads = _thread_cpus(proc.pid)
        while len(threads) < 2 and time.monotonic() < deadline:  # gRPC's threads
            time.sleep(0.05)
            threads = _thread_cpus(proc.pid)
        want = format_cpus(share_of(CPUS, 1, 2))
        assert len(threads) >= 2 and set(threads.values()) == {want}
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert f"bound to CPUs {want}" in err
    assert f"table threads, CPUs {want};" in err  # the serving line


@pytest.mark.timeout(60)
def test_ps_server_refuses_a_bad_share() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ps_server", "--port", "0", "--cpu_share", "two"],
        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=50,
    )  # fmt: skip
    assert r.returncode == 2
    assert "--cpu_share" in r.stderr and "'two'" in r.stderr
