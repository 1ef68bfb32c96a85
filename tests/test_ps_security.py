"""The parameter server admits only its job: the token on every RPC (missing or wrong →
UNAUTHENTICATED and nothing changes, health checks stay open), the shared-memory attach behind
the same check, the refusal to serve without a token on a non-loopback address, TLS and mutual
TLS, and Save / Load paths confined to the checkpoint roots. Real servers on 127.0.0.1, port 0."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from collective.errors import ConfigError
from ps_server import PSClient, PSServer
from ps_server.checkpoint.roots import confine, resolve_roots
from ps_server.errors import CheckpointPathError
from ps_server.rpc.auth import METADATA_KEY, check_bind_allowed, is_loopback
from ps_server.rpc.proto import ps_pb2, ps_pb2_grpc
from ps_server.rpc.status import (
    PSPermissionDeniedError,
    PSUnauthenticatedError,
    PSUnavailableError,
)
from ps_server.rpc.tls import TLSConfig

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from pki import make_test_pki
from ps_cluster import cluster, start_server_process, stop_process, wait_exit

TOKEN = "job-token-0123456789abcdef"
DIM = 4
KEYS = np.arange(40, dtype=np.int64)


def _refusals(op: str, cause: str) -> float:
    return (
        REGISTRY.get_sample_value("fleet_ps_auth_failures_total", {"op": op, "cause": cause}) or 0.0
    )


def _snapshot(client: PSClient, directory: Path) -> dict[str, Any]:
    """Every table's contents, as the bytes of the shard files of a full save (reading rows
    through pulls would count them, and add the rows of keys not seen yet)."""
    client.save(str(directory))
    files = {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*.bin"))
    }
    manifest = json.loads((directory / "manifest.server-0.json").read_text())
    assert files
    return {"files": files, "tables": {n: t["config"] for n, t in manifest["tables"].items()}}


def _every_rpc(tmp_path: Path) -> dict[str, tuple[Callable[..., Any], Any]]:
    """One well-formed request per RPC of the service (each would change or read state)."""
    return {
        "CreateTable": (
            "CreateTable",
            ps_pb2.CreateTableRequest(
                config_json=json.dumps({"kind": "sparse", "name": "new", "dim": 2})
            ),
        ),
        "ListTables": ("ListTables", ps_pb2.ListTablesRequest()),
        "PullSparse": (
            "PullSparse",
            ps_pb2.PullSparseRequest(table="emb", keys=np.arange(1000, 1010).tobytes()),
        ),
        "PushSparse": (
            "PushSparse",
            ps_pb2.PushSparseRequest(
                table="emb",
                keys=KEYS.tobytes(),
                grads=np.ones((40, DIM), np.float32).tobytes(),
                mode=ps_pb2.PUSH_MODE_APPLY,
            ),
        ),
        "InitDense": (
            "InitDense",
            ps_pb2.InitDenseRequest(table="d", name="v", values=np.ones(3, np.float32).tobytes()),
        ),
        "PullDense": ("PullDense", ps_pb2.PullDenseRequest(table="d", name="w")),
        "PushDense": (
            "PushDense",
            ps_pb2.PushDenseRequest(
                table="d",
                name="w",
                grad=np.ones(6, np.float32).tobytes(),
                mode=ps_pb2.PUSH_MODE_APPLY,
            ),
        ),
        "PushStep": (
            "PushStep",
            ps_pb2.PushStepRequest(
                sparse=[
                    ps_pb2.PushSparseRequest(
                        table="emb",
                        keys=KEYS[:1].tobytes(),
                        grads=np.ones(DIM, np.float32).tobytes(),
                        mode=ps_pb2.PUSH_MODE_APPLY,
                    )
                ]
            ),
        ),
        "Save": ("Save", ps_pb2.SaveRequest(dir=str(tmp_path / "stolen"))),
        "Load": ("Load", ps_pb2.LoadRequest(dir=str(tmp_path / "ck"))),
        "CheckpointBegin": (
            "CheckpointBegin",
            ps_pb2.CheckpointBeginRequest(
                root=str(tmp_path / "jobck"), name="ckpt-000001", kind="checkpoint"
            ),
        ),
        "CheckpointWait": (
            "CheckpointWait",
            ps_pb2.CheckpointWaitRequest(root=str(tmp_path / "jobck"), name="ckpt-000001"),
        ),
        "CheckpointCommit": (
            "CheckpointCommit",
            ps_pb2.CheckpointCommitRequest(
                root=str(tmp_path / "jobck"), name="ckpt-000001", num_servers=1, keep=1
            ),
        ),
        "ListCheckpoints": ("ListCheckpoints", ps_pb2.ListCheckpointsRequest(root=str(tmp_path))),
        "Shrink": ("Shrink", ps_pb2.ShrinkRequest(table="emb", unseen_days=0)),
        "EndDay": ("EndDay", ps_pb2.EndDayRequest()),
        "Barrier": ("Barrier", ps_pb2.BarrierRequest(name="b", count=2, timeout_s=1)),
        "ShmAttach": (
            "ShmAttach",
            ps_pb2.ShmAttachRequest(segment="fleetps_" + "0" * 32, token=b"x" * 16),
        ),
        "ShmDetach": ("ShmDetach", ps_pb2.ShmDetachRequest(segment="fleetps_" + "0" * 32)),
        "Stats": ("Stats", ps_pb2.StatsRequest()),
        "Stop": ("Stop", ps_pb2.StopRequest()),
    }


@pytest.mark.timeout(60)
def test_calls_without_the_job_token_are_refused_and_change_nothing(tmp_path: Path) -> None:
    with cluster(
        1, token=TOKEN, checkpoint_root=str(tmp_path), client_kw={"timeout_s": 20, "token": TOKEN}
    ) as (servers, client):
        client.create_table("emb", DIM, num_shards=4)
        client.create_dense_table("d", num_shards=2)
        client.init_dense("d", "w", np.arange(6, dtype=np.float32))
        client.push_sparse("emb", KEYS, np.full((40, DIM), 0.5, np.float32))
        client.save(str(tmp_path / "ck"))
        before = _snapshot(client, tmp_path / "before")
        channel = grpc.insecure_channel(client.endpoints[0])
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        rpcs = _every_rpc(tmp_path)
        assert set(rpcs) == {
            m.name for m in ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods
        }
        for cause, metadata in (
            ("missing_token", None),
            ("wrong_token", ((METADATA_KEY, "not-" + TOKEN),)),
            ("wrong_token", ((METADATA_KEY, TOKEN[:-1]),)),
        ):
            for op, (method, request) in rpcs.items():
                seen = _refusals(op, cause)
                with pytest.raises(grpc.RpcError) as info:
                    getattr(stub, method)(request, timeout=10, metadata=metadata)
                assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED, (op, info.value)
                assert "token" in info.value.details() and TOKEN not in info.value.details()
                assert _refusals(op, cause) == seen + 1, (op, cause)
        # a made-up method is refused the same way (not UNIMPLEMENTED), counted as op "unknown"
        made_up = channel.unary_unary("/fleetrun.ps.v1.ParameterServer/DropEverything")
        with pytest.raises(grpc.RpcError) as info:
            made_up(b"\x00garbage", timeout=10)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert _refusals("unknown", "missing_token") >= 1
        channel.close()
        # the same through PSClient: typed errors, never retried
        for bad in (
            PSClient(client.endpoints, retries=0),
            PSClient(client.endpoints, token="x" * 20),
        ):
            with bad:
                bad.wait_ready(10)  # health checks stay open
                with pytest.raises(PSUnauthenticatedError, match="UNAUTHENTICATED"):
                    bad.stop_servers()
        assert _snapshot(client, tmp_path / "after") == before
        assert not (tmp_path / "stolen").exists()
        assert servers[0].wait(0.1) is False  # still serving
        errors = client.stats()[0]["errors"]
        assert errors["Stop:UNAUTHENTICATED"] == 5 and errors["unknown:UNAUTHENTICATED"] == 1
        client.stop_servers()  # the right token works for every RPC (stop last)
        assert servers[0].wait(10)


@pytest.mark.timeout(60)
def test_shared_memory_attach_needs_the_token(tmp_path: Path) -> None:
    keys = np.arange(20_000, dtype=np.int64)  # ~0.8 MB of rows: above the shm threshold
    with cluster(1, token=TOKEN, client_kw={"timeout_s": 20, "token": TOKEN, "shm": True}) as (
        servers,
        client,
    ):
        client.create_table("emb", 8, num_shards=4)
        want = client.pull_sparse("emb", keys)
        assert len(servers[0].state.shm) == 1  # the job's client attached a segment
        with PSClient(client.endpoints, retries=0, shm=True, token="y" * 20) as stranger:
            stranger._configs["emb"] = client.table_config("emb")  # skip the refused lookup
            with pytest.raises(PSUnauthenticatedError, match="ShmAttach"):
                stranger.pull_sparse("emb", keys)
        assert len(servers[0].state.shm) == 1
        np.testing.assert_array_equal(client.pull_sparse("emb", keys), want)


def test_loopback_and_the_bind_rule() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.5", "example.org", ""):
        assert not is_loopback(host), host
    check_bind_allowed("0.0.0.0", has_token=True, insecure=False)
    check_bind_allowed("0.0.0.0", has_token=False, insecure=True)
    with pytest.raises(ConfigError, match="--insecure"):
        check_bind_allowed("10.0.0.5", has_token=False, insecure=False)


@pytest.mark.timeout(60)
def test_server_without_token_refuses_a_non_loopback_address_before_binding(tmp_path: Path) -> None:
    server = PSServer(host="0.0.0.0", token=None, insecure=False)
    with pytest.raises(ConfigError, match=r"without a token.*--insecure"):
        server.start()
    assert server._server is None  # refused before any socket was bound
    with pytest.raises(AssertionError, match=r"(?s)exit 2\).*--insecure"):
        start_server_process("--host", "0.0.0.0", "--port", "0")
    # --insecure lifts the rule (shown on loopback: no test binds every interface)
    proc, endpoint = start_server_process("--host", "127.0.0.1", "--port", "0", "--insecure")
    try:
        with PSClient([endpoint], timeout_s=10) as client:
            assert client.stats()[0]["server_index"] == 0
    finally:
        stop_process(proc)


@pytest.mark.timeout(60)
def test_token_file_flag_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc, endpoint = start_server_process("--port", "0", "--token_file", str(token_file))
    try:
        with (
            PSClient([endpoint], timeout_s=10, retries=0) as anon,
            pytest.raises(PSUnauthenticatedError),
        ):
            anon.stats()
        monkeypatch.setenv("FLEET_PS_TOKEN", TOKEN)  # PSClient's default: the job's env
        with PSClient([endpoint], timeout_s=10) as client:
            client.stop_servers()
        assert wait_exit(proc) == 0
        _, err = proc.communicate()
        assert TOKEN not in err and "job token required" in err
    finally:
        stop_process(proc)
    with pytest.raises(AssertionError, match=r"(?s)exit 2\).*token_file"):
        start_server_process("--port", "0", "--token_file", str(tmp_path / "missing"))


# -- TLS ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_test_pki(tmp_path_factory.mktemp("pki"))


def _tls_server(pki: dict[str, Any], mutual: bool) -> PSServer:
    s = pki["server"]
    server = PSServer(
        token=TOKEN, tls=TLSConfig(cert=s.cert, key=s.key, ca=s.ca if mutual else None)
    )
    server.start()
    return server


@pytest.mark.timeout(60)
def test_tls_channel(pki: dict[str, Any]) -> None:
    server = _tls_server(pki, mutual=False)
    ep = f"127.0.0.1:{server.port}"
    try:
        with PSClient([ep], token=TOKEN, tls_ca=pki["server"].ca, timeout_s=10) as client:
            client.create_table("emb", DIM, num_shards=2)
            assert client.pull_sparse("emb", KEYS).shape == (40, DIM)
        with PSClient(
            [ep], token=TOKEN, tls_ca=pki["server"].ca, tls_server_name="localhost", timeout_s=10
        ) as by_name:
            assert by_name.stats()
        with (
            PSClient([ep], token=TOKEN, retries=0, timeout_s=5) as plain,
            pytest.raises(PSUnavailableError),
        ):
            plain.stats()  # a plain-text client cannot talk to a TLS server
    finally:
        server.stop(0.5)


@pytest.mark.timeout(60)
def test_mutual_tls_needs_a_client_certificate_from_the_ca(pki: dict[str, Any]) -> None:
    server = _tls_server(pki, mutual=True)
    ep, ca = f"127.0.0.1:{server.port}", pki["server"].ca
    try:
        c = pki["client"]
        with PSClient(
            [ep], token=TOKEN, tls_ca=ca, tls_cert=c.cert, tls_key=c.key, timeout_s=10
        ) as ok:
            ok.create_table("emb", DIM, num_shards=2)
            assert ok.pull_sparse("emb", KEYS).shape == (40, DIM)
        rogue = pki["rogue_client"]
        for kw in ({}, {"tls_cert": rogue.cert, "tls_key": rogue.key}):
            with PSClient([ep], token=TOKEN, tls_ca=ca, retries=0, timeout_s=5, **kw) as refused:
                with pytest.raises(PSUnavailableError):
                    refused.stats()
        assert server.state.requests["Stats"] == 0  # the handshake failed: no call reached us
    finally:
        server.stop(0.5)


@pytest.mark.timeout(60)
def test_tls_flags_of_python_m_ps_server(pki: dict[str, Any], tmp_path: Path) -> None:
    s, c = pki["server"], pki["client"]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    proc, ep = start_server_process(
        "--port",
        "0",
        "--token_file",
        str(token_file),
        "--tls_cert",
        s.cert,
        "--tls_key",
        s.key,
        "--tls_ca",
        s.ca,
    )
    try:
        env = {"FLEET_PS_TLS_CA": s.ca, "FLEET_PS_TLS_CERT": c.cert, "FLEET_PS_TLS_KEY": c.key}
        assert TLSConfig.resolve(environ=env) == TLSConfig(cert=c.cert, key=c.key, ca=s.ca)
        with PSClient(
            [ep], token=TOKEN, tls_ca=s.ca, tls_cert=c.cert, tls_key=c.key, timeout_s=10
        ) as client:
            client.stop_servers()
        assert wait_exit(proc) == 0
        assert "mutual TLS" in proc.communicate()[1]
    finally:
        stop_process(proc)
    with pytest.raises(ConfigError, match="tls_key"):
        TLSConfig(cert=s.cert)


# -- checkpoint roots -----------------------------------------------------------------------------
def test_confine_resolves_relative_dotdot_and_symlinks(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    roots = resolve_roots(str(root))
    assert confine("ck", roots) == str(root / "ck")
    assert confine(str(root / "a" / ".." / "b"), roots) == str(root / "b")
    for bad in (str(outside / "ck"), "../outside/ck", "link/ck", str(root / "link"), "/etc"):
        with pytest.raises(CheckpointPathError, match="--checkpoint_root"):
            confine(bad, roots)
    two = resolve_roots(f"{root}{os.pathsep}{outside}")
    assert confine(str(outside / "ck"), two) == str(outside / "ck")
    assert resolve_roots(environ={"FLEET_PS_CHECKPOINT_ROOT": str(outside)}) == (str(outside),)
    assert resolve_roots(environ={}) == (os.path.realpath(os.getcwd()),)


@pytest.mark.timeout(60)
def test_save_and_load_paths_are_confined_to_the_checkpoint_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    with cluster(1, checkpoint_root=str(root)) as (_, client):
        client.create_table("emb", DIM, num_shards=2)
        client.push_sparse("emb", KEYS, np.ones((40, DIM), np.float32))
        client.save("ck")  # relative: under the root
        assert (root / "ck" / "manifest.server-0.json").is_file()
        client.save(str(root / "abs"))
        for bad in (str(outside / "ck"), "../outside/ck", "escape/ck", str(root / "escape")):
            with pytest.raises(
                PSPermissionDeniedError, match=rf"PERMISSION_DENIED.*{root}.*--checkpoint_root"
            ):
                client.save(bad)
            with pytest.raises(PSPermissionDeniedError):
                client.load(bad)
        assert list(outside.iterdir()) == []
        assert client.load("ck") == {"emb": 40}
