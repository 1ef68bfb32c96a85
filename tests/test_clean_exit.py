"""Clean exit (collective.clean_exit): callback order and idempotency, groups destroyed sub-groups
first, a fleet DP job that exits 0 and leaves nothing behind, and fleetrun's worker bootstrap
behaving exactly like ``python script.py`` / ``python -m module`` (argv, __file__, sys.path[0],
exit codes, tracebacks) while exiting through the same clean path.

Each case runs in a fresh interpreter: shutdown() destroys process-wide state (groups, threads).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from conftest import REPO, SCRIPTS, base_env, run_fleetrun


def _python(
    *args: str, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """``python ARGS`` in a fresh interpreter with the test env."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=str(cwd or REPO),
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _python_code(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return _python("-c", textwrap.dedent(code), timeout=timeout)


@pytest.mark.timeout(60)
def test_callbacks_run_newest_first_once_and_failures_are_named() -> None:
    r = _python_code("""
        import sys
        from collective import register_shutdown, shutdown, unregister_shutdown
        from collective.clean_exit import registered_shutdowns
        from collective.errors import ShutdownError

        calls = []
        for name in ("a", "b", "c"):
            register_shutdown(name, lambda name=name: calls.append(name))
        register_shutdown("a", lambda: calls.append("a2"))  # replaces a, now the newest
        register_shutdown("gone", lambda: calls.append("gone"))
        unregister_shutdown("gone")
        def full() -> None:
            raise OSError("disk full")
        register_shutdown("full", full)
        assert registered_shutdowns() == ["full", "a", "c", "b"], registered_shutdowns()
        try:
            shutdown()
        except ShutdownError as err:
            assert "full: OSError: disk full" in str(err), err
        else:
            raise AssertionError("no ShutdownError")
        assert calls == ["a2", "c", "b"], calls
        shutdown()  # again: nothing left to run
        assert calls == ["a2", "c", "b"] and registered_shutdowns() == []
        assert "torch" not in sys.modules, "clean_exit must not import torch"
        print("OK")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr


@pytest.mark.timeout(90)
def test_shutdown_destroys_subgroups_first_then_the_default_and_joins_gloo() -> None:
    r = _python_code(
        """
        import torch
        import torch.distributed as tdist
        import collective
        from collective.clean_exit import _sample_gloo_threads, shutdown

        collective.init_parallel_env(backend="gloo")
        first, second = collective.new_group([0]), collective.new_group([0])
        out = [torch.zeros(2)]
        tdist.all_gather(out, torch.ones(2))  # the collective of the aborts: tensors held by work
        tdist.all_reduce(torch.ones(2), group=second)
        assert _sample_gloo_threads(), "no gloo worker thread seen in /proc"

        order, destroy = [], tdist.destroy_process_group
        names = {id(None): "default", id(first): "first", id(second): "second"}
        def spy(group=None):
            order.append(names[id(group)])
            destroy(group)
        tdist.destroy_process_group = spy
        del out, first, second
        shutdown()
        assert order == ["second", "first", "default"], order
        assert not tdist.is_initialized()
        assert _sample_gloo_threads() == {}, "gloo threads left after shutdown"
        shutdown()  # idempotent
        collective.init_parallel_env(backend="gloo")  # a new life, then the user destroys it
        tdist.destroy_process_group()  # the script's own destroy (the spy records it) ...
        shutdown()  # ... so shutdown has no group left to destroy
        assert order == ["second", "first", "default", "default"], order
        print("OK")
    """,
        timeout=80,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


@pytest.mark.timeout(150)
def test_fleet_dp_job_exits_zero_and_leaves_no_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_fleetrun(
        "--nproc_per_node",
        "2",
        "--tee",
        "all",
        "--log_dir",
        str(tmp_path / "log"),
        str(SCRIPTS / "fleet_dp.py"),
        "--out",
        str(out),
        timeout=130,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    assert "terminate called" not in r.stdout + r.stderr
    left = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if str(out) in cmdline and p.info["status"] != psutil.STATUS_ZOMBIE:
            left.append((p.pid, cmdline))
    assert not left, f"processes left behind: {left}"


PROBE = """\
import json, sys
print(json.dumps({"argv": sys.argv, "file": __file__, "name": __name__,
                  "path0": sys.path[0], "spec": getattr(__spec__, "name", None)}), flush=True)
if sys.argv[1] == "raise":
    raise ValueError("bad input 42")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["script", "module"])
@pytest.mark.parametrize("arg", ["0", "3", "raise"])
def test_bootstrap_runs_the_program_like_python_does(tmp_path: Path, mode: str, arg: str) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    if mode == "script":
        plain = _python(str(tmp_path / "probe.py"), arg, "x y", cwd=tmp_path)
        boot = _python(
            "-m", "collective.bootstrap", str(tmp_path / "probe.py"), arg, "x y", cwd=tmp_path
        )
    else:
        plain = _python("-m", "probe", arg, "x y", cwd=tmp_path)
        boot = _python("-m", "collective.bootstrap", "-m", "probe", arg, "x y", cwd=tmp_path)
    assert boot.returncode == plain.returncode == (1 if arg == "raise" else int(arg)), boot.stderr
    seen, expected = json.loads(boot.stdout), json.loads(plain.stdout)
    assert seen == expected, (seen, expected)
    if arg == "raise":
        # the same traceback from the user's first frame on (the bootstrap's frames trimmed)
        tail = plain.stderr[plain.stderr.index(f'  File "{tmp_path / "probe.py"}"') :]
        assert boot.stderr.endswith(tail), boot.stderr


@pytest.mark.timeout(60)
def test_bootstrap_exit_runs_scripts_atexit_first_then_shutdown(tmp_path: Path) -> None:
    """A plain torch script: its own atexit handler still has the group; then our exit path
    destroys it; the exit code stays the script's."""
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, os, sys
        import torch, torch.distributed as tdist
        from collective import register_shutdown
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
        tdist.init_process_group("gloo", rank=0, world_size=1)
        def users_handler():
            t = torch.ones(2)
            tdist.all_reduce(t)
            print("user atexit, group up:", tdist.is_initialized(), flush=True)
        atexit.register(users_handler)
        register_shutdown("probe", lambda: print("shutdown callback", flush=True))
        sys.exit(7)
    """)
    )
    from collective.env import find_free_port

    r = _python("-m", "collective.bootstrap", str(script), str(find_free_port()), cwd=tmp_path)
    assert r.returncode == 7, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["user atexit, group up: True", "shutdown callback"], r.stdout
    assert "terminate called" not in r.stderr


@pytest.mark.timeout(60)
def test_a_failing_process_leaves_its_groups_to_its_end() -> None:
    """An uncaught exception skips the exit path: tearing the groups down would break the peers
    while the failing rank still runs, and a peer exiting first would look like the root cause."""
    code = textwrap.dedent("""
        import sys
        from collective.clean_exit import install_atexit, register_shutdown
        install_atexit()
        register_shutdown("marker", lambda: print("SHUTDOWN RAN", flush=True))
        if sys.argv[1] == "fail":
            raise ValueError("boom")
    """)
    ok = _python("-c", code, "ok")
    assert ok.returncode == 0 and "SHUTDOWN RAN" in ok.stdout, ok.stderr
    failed = _python("-c", code, "fail")
    assert failed.returncode == 1 and "SHUTDOWN RAN" not in failed.stdout
    assert "ValueError: boom" in failed.stderr
