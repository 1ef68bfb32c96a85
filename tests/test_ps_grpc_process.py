"""``python -m ps_server`` as a real process: serve, talk, stop (Stop RPC or SIGTERM), exit 0;
the env-contract entry (``--from_env`` / ``serve_from_env``); SIGUSR1 stack dumps; a busy port."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from collective.env import find_free_port
from ps_server import PSClient, SparseTable, SparseTableConfig, Uniform
from ps_server.core.optimizers import Adagrad

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import start_server_process, stop_process, wait_exit


@pytest.mark.timeout(60)
def test_two_server_processes_serve_and_stop_on_rpc(tmp_path: Path) -> None:
    procs = []
    try:
        eps = []
        for i in range(2):
            proc, ep = start_server_process(
                "--port",
                "0",
                "--server_index",
                str(i),
                "--num_servers",
                "2",
                "--max_message_mb",
                "8",
                "--checkpoint_root",
                str(tmp_path),
            )
            procs.append(proc)
            eps.append(ep)
        assert all(ep.startswith("127.0.0.1:") for ep in eps)
        cfg = SparseTableConfig("emb", 8, Adagrad(0.05), Uniform(-0.1, 0.1), num_shards=16)
        ref = SparseTable(cfg)
        with PSClient(eps, max_message_mb=8) as client:
            client.wait_ready(20)
            client.create_table_from_config(cfg)
            keys = np.random.default_rng(0).integers(0, 10_000, 5000)
            grads = np.ones((5000, 8), np.float32)
            client.push_sparse("emb", keys, grads)
            ref.push(keys, grads)
            np.testing.assert_array_equal(client.pull_sparse("emb", keys), ref.pull(keys))
            client.save(str(tmp_path / "ck"))
            client.stop_servers()
        for proc in procs:
            assert wait_exit(proc) == 0
            _, err = proc.communicate()
            assert "stopped" in err
        assert sorted(p.name for p in (tmp_path / "ck").glob("manifest.*.json")) == [
            "manifest.server-0.json",
            "manifest.server-1.json",
        ]
    finally:
        for proc in procs:
            stop_process(proc)


@pytest.mark.timeout(60)
def test_sigterm_is_graceful_and_from_env(tmp_path: Path) -> None:
    port = find_free_port()
    env = {
        "TRAINING_ROLE": "PSERVER",
        "POD_IP": "127.0.0.1",
        "PADDLE_PORT": str(port),
        "PADDLE_PSERVERS_IP_PORT_LIST": f"127.0.0.1:{find_free_port()},127.0.0.1:{port}",
        "PADDLE_TRAINERS_NUM": "1",
    }
    proc, ep = start_server_process("--from_env", env=env)
    try:
        assert ep == f"127.0.0.1:{port}"
        with PSClient([ep]) as client:
            client.wait_ready(20)
            stats = client.stats()[0]
            assert (stats["server_index"], stats["num_servers"]) == (1, 2)
            os.kill(proc.pid, signal.SIGUSR1)  # the threads' stacks to stderr; it keeps serving
            assert client.stats()[0]["server_index"] == 1
        os.killpg(proc.pid, signal.SIGTERM)
        assert wait_exit(proc) == 0
        err = proc.communicate()[1]
        assert "SIGTERM received" in err
        assert "Thread 0x" in err and "serve" in err
    finally:
        stop_process(proc)


@pytest.mark.timeout(30)
def test_busy_port_and_bad_flags_fail_clearly() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(AssertionError, match=r"(?s)exit 1.*cannot listen on 127\.0\.0\.1:\d+"):
            start_server_process("--port", str(port))
    with pytest.raises(AssertionError, match=r"(?s)exit 2.*server_index: must be in \[0, 2\)"):
        start_server_process("--server_index", "2", "--num_servers", "2")
    with pytest.raises(AssertionError, match=r"(?s)exit 2.*table_threads: must be an integer >= 1"):
        start_server_process("--table_threads", "0")


@pytest.mark.timeout(30)
def test_table_threads_default_from_env_and_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLEET_PS_TABLE_THREADS (fleetrun sets it) wins; unset, the usable CPUs up to 8; a bad
    value names the variable."""
    from collective.env import usable_cpus
    from collective.errors import ConfigError
    from ps_server import PSServer
    from ps_server.core import kernels
    from ps_server.server import default_table_threads

    monkeypatch.delenv("FLEET_PS_TABLE_THREADS", raising=False)
    assert default_table_threads() == min(8, usable_cpus()) >= 1
    monkeypatch.setenv("FLEET_PS_TABLE_THREADS", "3")
    assert default_table_threads() == 3
    with PSServer(metrics_port=0) as server:
        assert server.table_threads == 3 and kernels.get_threads() == 3
    kernels.set_threads(1)
    for bad in ("0", "two"):
        monkeypatch.setenv("FLEET_PS_TABLE_THREADS", bad)
        with pytest.raises(ConfigError, match="FLEET_PS_TABLE_THREADS"):
            default_table_threads()


@pytest.mark.timeout(30)
def test_serve_from_env_needs_the_pserver_role(monkeypatch: pytest.MonkeyPatch) -> None:
    from collective.errors import EnvContractError
    from ps_server import serve_from_env

    for k in list(os.environ):
        if k.startswith(("PADDLE_", "TRAINING_ROLE", "POD_IP", "RANK", "WORLD_SIZE")):
            monkeypatch.delenv(k)
    with pytest.raises(EnvContractError, match="TRAINING_ROLE=PSERVER"):
        serve_from_env()
