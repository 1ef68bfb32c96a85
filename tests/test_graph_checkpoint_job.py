"""Graph tables in job checkpoints and in Save / Load: one cut with the sparse and dense tables,
verified by the same manifests (size and CRC-32 of every graph file), loaded under another
number of servers (2 -> 3, 3 -> 1), and replaced as a whole by a load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_graph_table import graph_cluster

from ps_server import Adagrad, PSClient, PSServer, Uniform
from ps_server.checkpoint import read_checkpoint, series
from ps_server.config import GraphTableConfig
from ps_server.graph_client import GraphClient
from ps_server.rpc.status import PSDataLossError

CFG = GraphTableConfig(
    "g",
    node_types=["a", "b"],
    edge_types=[("ab", "a", "b"), ("ba", "b", "a")],
    features={"a": {"v": ("float32", 3), "k": ("int64", 2)}},
    num_shards=12,
)
KEYS = np.arange(0, 500, dtype=np.int64) * 1_000_003


def _graph(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(-(2**40), 2**40, 400)
    nodes = np.unique(src)
    return {
        "src": src,
        "dst": rng.integers(0, 200, 400),
        "w": rng.random(400).astype(np.float32),
        "nodes": nodes,
        "v": rng.standard_normal((nodes.shape[0], 3)).astype(np.float32),
        "k": rng.integers(-(2**63), 2**63 - 1, (nodes.shape[0], 2)),
    }


def _fill(client, ps: PSClient, g: dict[str, np.ndarray]) -> None:
    client.create_graph_table(CFG)
    client.add_edges("g", g["src"], g["dst"], "ab", weight=g["w"])
    client.add_edges("g", g["dst"], g["src"], "ba")
    client.add_nodes("g", g["nodes"], "a", {"v": g["v"], "k": g["k"]})
    ps.create_table("emb", 4, Adagrad(0.1), Uniform(-0.1, 0.1), num_shards=8)
    ps.push_sparse("emb", KEYS, np.ones((KEYS.size, 4), np.float32))


def _answers(client, ps: PSClient, g: dict[str, np.ndarray]) -> tuple:
    """Every edge (with weight and id), every feature, the degrees, the sparse rows."""
    out = []
    for etype, nodes in (("ab", g["nodes"]), ("ba", np.unique(g["dst"]))):
        v, o, w, e = client.sample_neighbors(
            "g", nodes, 100_000, etype, return_weights=True, return_eids=True
        )
        src = np.repeat(nodes, np.diff(o))
        out.append(sorted(zip(src.tolist(), v.tolist(), w.tolist(), e.tolist())))
        out.append(client.degree("g", nodes, etype).tolist())
    feats = client.node_features("g", g["nodes"], node_type="a")
    out += [feats["v"].tobytes(), feats["k"].tobytes()]
    out.append(ps.pull_sparse("emb", KEYS).tobytes())
    return tuple(out)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 3), (3, 1)])
def test_job_checkpoint_holds_graph_tables(saved_by: int, loaded_by: int, tmp_path: Path) -> None:
    g = _graph(saved_by)
    root = tmp_path / "ckpts"
    with graph_cluster(saved_by, checkpoint_root=str(tmp_path)) as (servers, client):
        ps = PSClient([s.endpoint for s in servers])
        try:
            _fill(client, ps, g)
            before = _answers(client, ps, g)
            record = ps.checkpoint(str(root), 7, trainer_states={0: {"offset": 3}})
            # the graph changes after the cut: the checkpoint keeps the cut
            client.add_edges("g", [1], [2], "ab")
        finally:
            ps.close()
    assert record.graph_tables == {"g": {"nodes": g["nodes"].shape[0], "edges": 800}}
    info = read_checkpoint(root / "ckpt-000007")
    assert info.graph_tables["g"].parts == saved_by
    assert info.graph_tables["g"].config == CFG
    graph_files = sorted(f for f in info.files or {} if f.startswith("graphs/g/"))
    assert graph_files == [
        "graphs/g/config.json",
        *[f"graphs/g/part-{i:05d}-of-{saved_by:05d}.npz" for i in range(saved_by)],
    ]
    top = json.loads((root / "ckpt-000007" / "checkpoint.json").read_text())
    assert top["graph_tables"]["g"]["edges"] == 800
    series.verify(root / "ckpt-000007")  # every graph file's CRC-32 too

    with graph_cluster(loaded_by, checkpoint_root=str(tmp_path)) as (servers, client):
        ps = PSClient([s.endpoint for s in servers])
        try:
            chosen = ps.load_latest(str(root)).chosen
            assert chosen is not None and chosen.step == 7
            assert _answers(client, ps, g) == before
            # the edge-id counter goes on after the saved ids
            client.add_edges("g", [5], [6], "ab")
            _, _, eid = client.sample_neighbors("g", [5], 5, "ab", return_eids=True)
            assert eid.tolist() == [800]
        finally:
            ps.close()


@pytest.mark.timeout(120)
def test_save_load_and_corruption(tmp_path: Path) -> None:
    """Save / Load (``fleet.save_persistables`` / ``init_server(dirname)``) carry the graph
    tables; a load replaces a graph table as a whole; a corrupt graph part is refused before
    any table changes."""
    g = _graph(5)
    with graph_cluster(2, checkpoint_root=str(tmp_path)) as (servers, client):
        ps = PSClient([s.endpoint for s in servers])
        try:
            _fill(client, ps, g)
            before = _answers(client, ps, g)
            ps.save("saved", mode="all")
            client.add_edges("g", [1], [2], "ab")
            client.remove_nodes("g", g["nodes"][:10], "a")
            ps.load("saved")
            assert _answers(client, ps, g) == before
            assert client.degree("g", [1], "ab").tolist() == [0]  # the later edge is gone
        finally:
            ps.close()
    # a server started on the checkpoint (init_server(dirname), python -m ps_server --load)
    server = PSServer(grace_s=1.0)
    server.load_checkpoint(str(tmp_path / "saved"))
    server.start()
    client = GraphClient([server.endpoint], timeout_s=20)
    ps = PSClient([server.endpoint])
    try:
        assert _answers(client, ps, g) == before
    finally:
        ps.close()
        client.close()
        server.stop()
    part = tmp_path / "saved" / "graphs" / "g" / "part-00001-of-00002.npz"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x10
    part.write_bytes(bytes(data))
    with graph_cluster(2, checkpoint_root=str(tmp_path)) as (servers, client):
        ps = PSClient([s.endpoint for s in servers])
        try:
            _fill(client, ps, _graph(6))
            other = _answers(client, ps, _graph(6))
            with pytest.raises(PSDataLossError, match="part-00001-of-00002.npz"):
                ps.load("saved")
            assert _answers(client, ps, _graph(6)) == other  # nothing changed
        finally:
            ps.close()
