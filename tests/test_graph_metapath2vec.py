"""The metapath2vec example end to end under fleetrun (2 servers + 2 trainers, real processes):
walks along author-paper-venue-paper-author cross the servers and the author embeddings separate
the planted communities nearly as well as the true one-hot features; plus the generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_fleetrun

from examples.graph.hetero import HeteroConfig, generate


@pytest.mark.timeout(30)
def test_hetero_graph_is_deterministic_and_planted() -> None:
    cfg = HeteroConfig(authors=1000, seed=5)
    a, b = generate(cfg), generate(cfg)
    for (s1, d1), (s2, d2) in zip(a.edges().values(), b.edges().values()):
        np.testing.assert_array_equal(s1, s2)
        np.testing.assert_array_equal(d1, d2)
    authors, papers = a.author_paper
    assert np.unique(authors).shape[0] == 1000  # every author wrote a paper: no dead walk ends
    assert np.unique(a.nodes).shape[0] == a.nodes.shape[0]  # ids distinct across node types
    assert np.array_equal(a.paper_venue[0], a.papers)  # one venue per paper
    assert np.array_equal(np.unique(papers), a.papers)  # every paper has authors
    assert np.intersect1d(a.train, a.test).shape[0] == 0


@pytest.mark.timeout(300)
def test_metapath2vec_under_fleetrun_separates_communities(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    r = run_fleetrun(
        "--server_num", "2", "--worker_num", "2", "--log_dir", str(tmp_path / "log"),
        "examples/graph/metapath2vec_ps.py", "--authors", "1000", "--walk_length", "12",
        "--p_intra", "0.9", "--seed", "3", "--json", str(out), cwd=REPO, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["trainers"] == 2 and res["servers"] == 2
    assert res["full_length_walks"] == res["walks"] == 4000  # the metapath never dead-ends
    assert res["acc_onehot"] == 1.0
    assert res["ratio"] >= 0.9, res
