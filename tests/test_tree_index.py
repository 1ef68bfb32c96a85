"""fleet.data.TreeIndex, LayerWiseSampler and beam_search: tree invariants, save/load, given
codes, sampling, exact beam search, bad input, and the TDM example on a small tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from collective.errors import ConfigError, FleetError
from fleet.data import LayerWiseSampler, TreeIndex, UnknownItemError, beam_search
from fleet.data.errors import DataSourceError

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


def make_tree(n: int = 300, branch: int = 3, dim: int = 6, seed: int = 0) -> TreeIndex:
    rng = np.random.default_rng(seed)
    ids = rng.choice(10**9, size=n, replace=False).astype(np.int64) - 5 * 10**8
    emb = rng.normal(size=(n, dim)).astype(np.float32)
    return TreeIndex.build(ids, emb, branch=branch, seed=seed)


def leaves_under(tree: TreeIndex) -> dict[int, int]:
    """Number of leaves under every node, computed by walking up from each leaf."""
    counts: dict[int, int] = {}
    _, codes = tree.get_all_items()
    for c in codes.tolist():
        while True:
            counts[c] = counts.get(c, 0) + 1
            if c == 0:
                break
            c = (c - 1) // tree.branch()
    return counts


@pytest.mark.parametrize("n,branch", [(1, 2), (2, 2), (5, 2), (300, 3), (1000, 4), (64, 4)])
def test_structure_invariants(n: int, branch: int) -> None:
    tree = make_tree(n, branch)
    ids, codes = tree.get_all_items()
    k, h = tree.branch(), tree.height()
    assert k == branch and len(tree) == n
    assert h == 1 + int(np.ceil(np.log(n) / np.log(k) - 1e-9)) if n > 1 else h == 1
    # every item one leaf, all leaves on the last layer
    assert np.unique(codes).size == n
    assert set(tree.level_of(codes).tolist()) == {h - 1}
    assert np.array_equal(np.sort(tree.get_layer_codes(h - 1)), np.sort(codes))
    # the nodes are exactly the leaves' ancestors
    counts = leaves_under(tree)
    assert sorted(counts) == tree.node_codes.tolist() == sorted(tree.node_codes.tolist())
    assert tree.total_node_nums() == len(counts)
    assert sum(tree.get_layer_codes(lv).size for lv in range(h)) == tree.total_node_nums()
    # balanced: siblings' leaf counts differ by at most one
    for c in tree.node_codes.tolist():
        kids = tree.get_children_codes(c) if tree.level_of(c) < h - 1 else np.zeros(0)
        assert np.array_equal(kids, [x for x in range(k * c + 1, k * c + k + 1) if x in counts])
        sizes = [counts[x] for x in kids.tolist()]
        if sizes:
            assert max(sizes) - min(sizes + [0] * (k - len(sizes))) <= 1
    # ancestors chain to the root
    for item in ids[:20].tolist():
        path = tree.get_travel_codes(item)
        assert path[-1] == 0 and path.size == h
        assert np.array_equal(path[1:], (path[:-1] - 1) // k)
        for lv in range(h):
            assert tree.get_ancestor_codes(np.array([item]), lv)[0] == path[h - 1 - lv]
        assert tree.get_nodes(path[:1])[0] == item
    if h > 1:
        assert np.array_equal(
            tree.get_travel_codes(ids[0], start_level=1), tree.get_travel_codes(ids[0])[:-1]
        )
        with pytest.raises(UnknownItemError, match="not leaves"):
            tree.get_nodes(tree.get_layer_codes(0))
    assert tree.emb_size() == 6 and tree.node_emb.shape == (tree.total_node_nums(), 6)


def test_vectorised_lookups_and_descendants() -> None:
    tree = make_tree(500, 2)
    ids, codes = tree.get_all_items()
    lv = 3
    anc = tree.get_ancestor_codes(ids, lv)
    assert set(anc.tolist()) == set(tree.get_layer_codes(lv).tolist())
    # descendants of a layer-3 node on the leaf layer are exactly its items' leaves
    node = int(anc[0])
    below = tree.get_children_codes(node, tree.height() - 1)
    assert np.array_equal(below, np.sort(codes[anc == node]))
    assert tree.get_pi_relation(ids[:3], lv) == dict(zip(ids[:3].tolist(), anc[:3].tolist()))
    assert tree.get_travel_path(int(codes[0]), 0) == tree.get_travel_codes(ids[0])[:-1].tolist()
    # internal node embeddings are the mean of the items under them
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(500, 6)).astype(np.float32)
    rows = np.searchsorted(tree.node_codes, node)
    mine = np.isin(codes, below)
    assert tree.node_emb.shape[0] == tree.total_node_nums()
    ids2 = np.arange(500, dtype=np.int64)
    t2 = TreeIndex.build(ids2, emb, branch=2)
    c2 = t2.get_all_items()[1]
    n2 = int(t2.get_ancestor_codes(ids2[:1], 2)[0])
    r2 = t2.node_positions(np.array([n2]))[0]
    under = t2.get_ancestor_codes(ids2, 2) == n2
    np.testing.assert_allclose(t2.node_emb[r2], emb[under].mean(0), rtol=1e-5, atol=1e-6)
    assert rows >= 0 and mine.sum() == below.size and c2.size == 500


def test_build_is_deterministic_and_clusters() -> None:
    a, b = make_tree(400, 2, seed=5), make_tree(400, 2, seed=5)
    assert np.array_equal(a.get_all_items()[1], b.get_all_items()[1])
    assert np.array_equal(a.node_emb, b.node_emb)
    # planted clusters end up under distinct layer-2 nodes
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(4, 8)) * 20
    emb = np.repeat(centres, 64, axis=0) + rng.normal(size=(256, 8))
    ids = np.arange(256, dtype=np.int64)
    tree = TreeIndex.build(ids, emb, branch=2, seed=0)
    anc = tree.get_ancestor_codes(ids, 2).reshape(4, 64)
    assert all(np.unique(row).size == 1 for row in anc) and np.unique(anc).size == 4


def test_save_load_round_trip(tmp_path: Path) -> None:
    tree = make_tree(257, 3)
    path = tmp_path / "tree.npz"
    tree.save(path)
    back = TreeIndex.load(path)
    for f in ("height", "branch", "total_node_nums", "emb_size"):
        assert getattr(back, f)() == getattr(tree, f)()
    for x, y in zip(back.get_all_items(), tree.get_all_items()):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert back.node_emb.tobytes() == tree.node_emb.tobytes()
    assert back.name == tree.name
    given = TreeIndex.from_codes([7, 8], [1, 2], branch=2)
    given.save(tmp_path / "g.npz")
    assert TreeIndex.load(tmp_path / "g.npz").emb_size() == 0


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(DataSourceError, match="does not exist"):
        TreeIndex.load(tmp_path / "missing.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file at all")
    with pytest.raises(DataSourceError, match="not a tree index"):
        TreeIndex.load(junk)
    good = tmp_path / "tree.npz"
    make_tree(50, 2).save(good)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataSourceError, match="cut.npz"):
        TreeIndex.load(cut)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, x=np.arange(3))
    with pytest.raises(DataSourceError, match="not a tree index"):
        TreeIndex.load(foreign)
    npy = tmp_path / "a.npy"
    np.save(npy, np.arange(3))
    with pytest.raises(DataSourceError, match="not a tree index"):
        TreeIndex.load(npy)
    old = tmp_path / "old.npz"
    with np.load(good) as z:
        data = {k: z[k] for k in z.files}
    np.savez(old, **{**data, "version": np.array(99)})
    with pytest.raises(DataSourceError, match="version 99"):
        TreeIndex.load(old)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **{**data, "codes": data["codes"][::-1][:-1]})
    with pytest.raises(DataSourceError, match="corrupt"):
        TreeIndex.load(bad)


def test_from_codes() -> None:
    # branch 2, height 3: leaves 3..6; item 10 at 3, 11 at 4, 12 at 6 (5 absent)
    tree = TreeIndex.from_codes(np.array([10, 11, 12], np.int64), np.array([3, 4, 6]), branch=2)
    assert tree.height() == 3 and tree.total_node_nums() == 6
    assert tree.get_layer_codes(1).tolist() == [1, 2]
    assert tree.get_children_codes(2).tolist() == [6]
    assert tree.get_children_codes(0, 2).tolist() == [3, 4, 6]
    assert tree.get_travel_codes(12).tolist() == [6, 2, 0]
    assert tree.get_ancestor_codes(np.array([10, 11, 12]), 1).tolist() == [1, 1, 2]
    assert tree.get_nodes([3, 6]).tolist() == [10, 12]
    # branch 3 layers start at 0, 1, 4, 13
    t3 = TreeIndex.from_codes(np.arange(4, dtype=np.int64), [4, 5, 12, 7], branch=3)
    assert t3.height() == 3 and t3.get_layer_codes(1).tolist() == [1, 2, 3]
    assert t3.get_children_codes(1).tolist() == [4, 5] and t3.get_children_codes(3).tolist() == [12]


def test_bad_input() -> None:
    ids = np.arange(10, dtype=np.int64)
    emb = np.zeros((10, 4), np.float32)
    with pytest.raises(ConfigError, match="branch must be an integer >= 2, got 1"):
        TreeIndex.build(ids, emb, branch=1)
    with pytest.raises(ConfigError, match="int64, got dtype float64"):
        TreeIndex.build(ids.astype(np.float64), emb)
    with pytest.raises(ConfigError, match=r"duplicate item ids \[3\]"):
        TreeIndex.build(np.array([1, 3, 3, 4] + list(range(5, 11))), emb)
    with pytest.raises(ConfigError, match=r"\[10, dim\].*got shape \(9, 4\)"):
        TreeIndex.build(ids, emb[:9])
    with pytest.raises(ConfigError, match="same|last layer"):
        TreeIndex.from_codes([1, 2], [1, 3], branch=2)
    with pytest.raises(ConfigError, match="share a leaf"):
        TreeIndex.from_codes([1, 2], [3, 3], branch=2)
    with pytest.raises(ConfigError, match="negative"):
        TreeIndex.from_codes([1, 2], [-1, 3], branch=2)
    tree = TreeIndex.build(ids, emb + np.arange(10)[:, None], branch=2)
    with pytest.raises(UnknownItemError, match=r"item ids \[99\].*not in tree") as e:
        tree.get_ancestor_codes(np.array([1, 99]), 1)
    assert isinstance(e.value, FleetError) and e.value.values.tolist() == [99]
    with pytest.raises(UnknownItemError):
        tree.get_travel_codes(-5)
    with pytest.raises(ConfigError, match=r"level 7 is out of range.*0 \(root\) \.\. 4"):
        tree.get_layer_codes(7)
    with pytest.raises(ConfigError, match="level -1"):
        tree.get_ancestor_codes(ids, -1)
    with pytest.raises(UnknownItemError, match="code 999"):
        tree.get_children_codes(999)
    with pytest.raises(ConfigError, match="start_sample_layer 0"):
        LayerWiseSampler(tree, [1], start_sample_layer=0)
    with pytest.raises(ConfigError, match="at most one count per layer"):
        LayerWiseSampler(tree, [1] * 9)


def test_layerwise_sampler() -> None:
    tree = make_tree(200, 2)
    ids, _ = tree.get_all_items()
    counts = [1, 2, 3, 4, 5]  # layers 2..6; the layers below take 1
    full = counts + [1] * (tree.height() - 2 - len(counts))
    s = LayerWiseSampler(tree, counts, start_sample_layer=2, seed=7)
    items = ids[[5, 9, 5, 100]]
    users = np.array([0, 1, 2, 3])
    out = s.sample(items, users)
    per = s.rows_per_item
    assert s.layer_sample_counts == full and per == sum(c + 1 for c in full) and len(out) == 4 * per
    assert out.user_idx.dtype == torch.int64 and out.label.dtype == torch.float32
    assert out.user_idx.tolist() == np.repeat(users, per).tolist()
    codes = out.node_code.numpy().reshape(4, per)
    labels = out.label.numpy().reshape(4, per)
    levels = out.level.numpy().reshape(4, per)
    assert (tree.level_of(codes) == levels).all()
    for row, item in enumerate(items):
        for lv, c in zip(range(2, tree.height()), full):
            sel = levels[row] == lv
            assert sel.sum() == c + 1
            truth = tree.get_ancestor_codes(np.array([item]), lv)[0]
            assert codes[row, sel][0] == truth and labels[row, sel][0] == 1
            negs = codes[row, sel][1:]
            assert (negs != truth).all() and (labels[row, sel][1:] == 0).all()
            assert np.isin(negs, tree.get_layer_codes(lv)).all()
        # leaf layer first, then upwards
        assert levels[row, 0] == tree.height() - 1 and levels[row, -1] == 2
    again = LayerWiseSampler(tree, counts, start_sample_layer=2, seed=7).sample(items, users)
    assert torch.equal(again.node_code, out.node_code)
    other = LayerWiseSampler(tree, counts, start_sample_layer=2, seed=8).sample(items, users)
    assert not torch.equal(other.node_code, out.node_code)
    # negatives are uniform over the layer without the positive
    big = LayerWiseSampler(tree, [200], start_sample_layer=tree.height() - 2, seed=0)
    lv = tree.height() - 2
    got = big.sample(np.repeat(ids[:1], 50))
    neg = got.node_code[(got.level == lv) & (got.label == 0)].numpy()
    layer = tree.get_layer_codes(lv)
    freq = np.array([(neg == c).sum() for c in layer])
    truth = tree.get_ancestor_codes(ids[:1], lv)[0]
    assert freq[layer == truth][0] == 0
    expected = neg.size / (layer.size - 1)
    chi2 = (((freq - expected) ** 2) / expected)[layer != truth].sum()
    assert chi2 < layer.size * 2  # dof ~ layer size; a loose bound


def test_paddle_layerwise_rows() -> None:
    tree = make_tree(64, 2)
    ids, _ = tree.get_all_items()
    tree.init_layerwise_sampler([1, 1, 2], start_sample_layer=4, seed=0)
    user = ids[[[1, 2], [3, 4]]]
    rows = tree.layerwise_sample(user, ids[[10, 20]], with_hierarchy=True)
    per = (1 + 1) + (1 + 1) + (2 + 1)
    assert rows.shape == (2 * per, 4) and rows.dtype == np.int64
    # leaf layer rows keep the raw user features; layer 4 rows carry their ancestors
    assert tree.height() == 7  # layers 4, 5, 6 take 1, 1, 2 negatives; rows start at 6
    assert (rows[:3, :2] == user[0]).all()
    assert (rows[3:5, :2] == tree.get_ancestor_codes(user[0], 5)).all()
    assert (rows[5:per, :2] == tree.get_ancestor_codes(user[0], 4)).all()
    assert rows[:per, 3].tolist() == [1, 0, 0, 1, 0, 1, 0]
    assert rows[0, 2] == tree.get_ancestor_codes(ids[[10]], 6)[0] and rows[0, 3] == 1
    plain = tree.layerwise_sample(user, ids[[10, 20]])
    assert (plain[:, :2] == np.repeat(user, per, axis=0)).all()
    with pytest.raises(ConfigError, match="init_layerwise_sampler"):
        make_tree(8, 2).layerwise_sample(user, ids[[10, 20]])


def test_beam_search_exact() -> None:
    tree = make_tree(300, 3, dim=5, seed=2)
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.normal(size=(6, 5)).astype(np.float32))
    leaves = tree.get_layer_codes(tree.height() - 1)
    leaf_scores = (q @ torch.from_numpy(tree.node_emb[tree.node_positions(leaves)]).T).numpy()
    # max-heap scores: a node scores the best of its leaves
    best = np.full((6, tree.total_node_nums()), -np.inf, np.float32)
    for col, code in enumerate(leaves.tolist()):
        while True:
            r = tree.node_positions([code])[0]
            best[:, r] = np.maximum(best[:, r], leaf_scores[:, col])
            if code == 0:
                break
            code = (code - 1) // tree.branch()
    best_t = torch.from_numpy(best)

    def score(codes: torch.Tensor) -> torch.Tensor:
        pos = torch.from_numpy(tree.node_positions(codes.numpy()))
        return best_t.gather(1, pos)

    truth = tree.get_nodes(leaves[np.argsort(-leaf_scores, axis=1, kind="stable")[:, :10]])
    wide = beam_search(tree, score, 6, beam_size=leaves.size, topk=10)
    assert np.array_equal(wide.item_ids, truth) and wide.scorings == 6 * leaves.size
    narrow = beam_search(tree, score, 6, beam_size=10, topk=10)
    assert np.array_equal(narrow.item_ids, truth) and narrow.scorings < wide.scorings
    more = beam_search(tree, score, 6, beam_size=3, topk=400)
    found = more.leaf_codes >= 0
    # three beam nodes on the last internal layer hold fewer than 400 leaves
    assert (found.sum(1) >= 3).all() and not found.all() and (more.item_ids[~found] == 0).all()
    assert (np.sort(found, axis=1)[:, ::-1] == found).all()  # found entries come first
    assert (found.sum(1) == more.scores.isfinite().sum(1).numpy()).all()
    with pytest.raises(ConfigError, match="beam_size"):
        beam_search(tree, score, 6, beam_size=0, topk=1)


@pytest.mark.timeout(300)
def test_tdm_example_small(tmp_path: Path) -> None:
    out = tmp_path / "tdm.json"
    args = ["--items", "1024", "--clusters", "16", "--users", "300", "--beam", "16"]
    proc = subprocess.run(
        [sys.executable, "examples/tdm/train_tdm.py", *args, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["recall_brute"] > 0.2
    assert res["recall_ratio"] >= 0.8, res
    assert res["scorings_brute"] == 1024 and res["cost_ratio"] < 0.25
