"""The graph files a client asks the servers to load are confined to the servers' data roots
(``data_root=``, FLEET_PS_DATA_ROOT; default: the working directory, the checkpoint roots and
the temporary directory): a path outside them, a ``..`` or a symbolic link out of them, a glob
match leaving them and a ``file://`` URL are refused with PERMISSION_DENIED naming the path and
the variable, and nothing is loaded; remote URLs pass."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import fsspec
import pytest
from test_graph_table import graph_cluster

from ps_server.__main__ import build_parser
from ps_server.checkpoint.roots import DATA_ROOT_ENV, local_part, resolve_data_roots
from ps_server.config import GraphTableConfig
from ps_server.rpc.status import PSPermissionDeniedError

CFG = GraphTableConfig("dr", edge_types=["e"], features={"node": {"x": ("float32", 1)}})


@pytest.mark.timeout(60)
def test_graph_files_outside_the_data_roots_are_refused(tmp_path: Path) -> None:
    data, other = tmp_path / "data", tmp_path / "other"
    data.mkdir()
    other.mkdir()
    (data / "e.txt").write_text("1\t2\n2\t3\n")
    (data / "n.txt").write_text("node\t1\tx 0.5\n")
    (other / "e.txt").write_text("5\t6\n")
    (data / "link.txt").symlink_to(other / "e.txt")
    with graph_cluster(2, data_root=str(data)) as (_, client):
        client.create_graph_table(CFG)
        assert client.load_edges("dr", str(data / "e.txt"))["kept"] == 2
        assert client.load_nodes("dr", [str(data / "n.txt")])["kept"] == 1
        for bad, shown in (
            (str(other / "e.txt"), str(other / "e.txt")),
            (str(data / ".." / "other" / "e.txt"), "other"),
            (str(data / "link.txt"), "link.txt"),
            (str(data / "*.txt"), "matched by"),
            ("file://" + str(other / "e.txt"), "file://"),
            ("zip://e.txt::file://" + str(other / "x.zip"), "x.zip"),
            ("/etc/passwd", "/etc/passwd"),
        ):
            with pytest.raises(PSPermissionDeniedError, match=DATA_ROOT_ENV) as err:
                client.load_edges("dr", [str(data / "e.txt"), bad])
            assert shown in str(err.value) and str(data) in str(err.value), bad
        with pytest.raises(PSPermissionDeniedError, match="outside this server's data root"):
            client.load_nodes("dr", str(other / "e.txt"))
        assert client.degree("dr", [1, 2, 5], "e").tolist() == [1, 1, 0]  # nothing more loaded
        fs = fsspec.filesystem("memory")
        fs.pipe("/graph-roots/m.txt", b"7\t8\n")
        try:  # a remote file system's URL is the store's business, not the roots'
            assert client.load_edges("dr", "memory://graph-roots/m.txt")["kept"] == 1
        finally:
            fs.rm("/graph-roots", recursive=True)


@pytest.mark.timeout(60)
def test_default_data_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_ROOT_ENV, raising=False)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    roots = resolve_data_roots(None, (str(ckpt),))
    assert roots == tuple(
        dict.fromkeys(os.path.realpath(p) for p in (os.getcwd(), str(ckpt), tempfile.gettempdir()))
    )
    env = {DATA_ROOT_ENV: f"{tmp_path}{os.pathsep}/srv/graphs"}
    assert resolve_data_roots(None, (str(ckpt),), env) == (str(tmp_path.resolve()), "/srv/graphs")
    assert build_parser().parse_args(["--data_root", "/srv/g"]).data_root == "/srv/g"
    assert local_part("s3://bucket/e.txt") is None and local_part("/a/b") == "/a/b"
    assert local_part("file:///a/b") == "/a/b" and local_part("tar://x::/a.tar") == "/a.tar"
    with graph_cluster(1) as (_, client):  # the default roots: /etc is none of them
        client.create_graph_table(CFG)
        (tmp_path / "e.txt").write_text("1\t2\n")  # under the temporary directory
        assert client.load_edges("dr", str(tmp_path / "e.txt"))["kept"] == 1
        with pytest.raises(PSPermissionDeniedError, match="/etc/passwd"):
            client.load_edges("dr", "/etc/passwd")
