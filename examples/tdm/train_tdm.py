"""Tree-based deep retrieval (TDM) on generated data: ``python examples/tdm/train_tdm.py``.

Items have content embeddings in planted clusters; each user has an interest point in the same
space and interacts with items near it (some of those pairs are held out); the user's features
are a noisy view of that point. The script

1. builds a :class:`fleet.data.TreeIndex` over the items from their embeddings (balanced k-means);
2. trains a scorer ``score(user, node) = query(user) . emb[node] + bias[node]`` (a linear query
   tower, one ``nn.Embedding`` row per tree node) on rows of :class:`fleet.data.LayerWiseSampler`:
   on every layer the item's ancestor is a positive and other nodes of the layer are negatives;
3. retrieves the top 50 items per user by :func:`fleet.data.beam_search` over the tree, and by
   brute force (every leaf scored with the same model), and prints one JSON line::

    {"recall_tree": ..., "recall_brute": ..., "recall_ratio": ..., "overlap": ...,
     "scorings_tree": ..., "scorings_brute": ..., "cost_ratio": ..., ...}

``recall`` is the share of held-out (user, item) pairs found in the user's top 50;
``overlap`` the share of brute force's top 50 that the tree search also returns; ``scorings``
the (user, node) scores computed per user.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fleet.data.tree_index import TreeIndex  # noqa: E402
from fleet.data.tree_sampler import LayerWiseSampler, beam_search  # noqa: E402


@dataclass
class TDMConfig:
    """Sizes of the generated data, the tree, training and retrieval."""

    items: int = 16384
    clusters: int = 64
    dim: int = 16
    users: int = 2000
    pairs_per_user: int = 15
    held_out: int = 5
    interest_pool: int = 100
    branch: int = 4
    negatives: int = 8  # per layer, on the leaf layer; fewer above (see layer_counts)
    hidden: int = 32
    epochs: int = 2
    batch: int = 1024
    lr: float = 0.02
    beam: int = 64
    topk: int = 50
    seed: int = 0
    threads: int = 1  # torch threads


@dataclass
class TDMData:
    """Generated items and users: ids, item embeddings, user features, train/test pairs."""

    item_ids: np.ndarray
    item_emb: np.ndarray
    user_feat: np.ndarray
    train_users: np.ndarray
    train_items: np.ndarray
    test_items: np.ndarray  # [users, held_out] item ids


def generate(cfg: TDMConfig) -> TDMData:
    """Clustered items, users with an interest point, pairs drawn from the items near it."""
    rng = np.random.default_rng(cfg.seed)
    centres = rng.normal(size=(cfg.clusters, cfg.dim)) * 2.0
    cluster = rng.integers(cfg.clusters, size=cfg.items)
    item_emb = (centres[cluster] + rng.normal(size=(cfg.items, cfg.dim))).astype(np.float32)
    item_ids = rng.permutation(cfg.items).astype(np.int64) * 7919 + 1_000_003  # arbitrary ids
    anchor = rng.integers(cfg.items, size=cfg.users)
    interest = item_emb[anchor] + 0.3 * rng.normal(size=(cfg.users, cfg.dim)).astype(np.float32)
    user_feat = (interest + 0.1 * rng.normal(size=interest.shape)).astype(np.float32)
    items_t = torch.from_numpy(item_emb)
    pools = []
    for lo in range(0, cfg.users, 1024):
        d = torch.cdist(torch.from_numpy(interest[lo : lo + 1024]), items_t)
        pools.append(d.topk(cfg.interest_pool, largest=False).indices.numpy())
    pool = np.concatenate(pools)
    pick = np.argsort(rng.random((cfg.users, cfg.interest_pool)), axis=1)[:, : cfg.pairs_per_user]
    chosen = item_ids[np.take_along_axis(pool, pick, axis=1)]
    n_train = cfg.pairs_per_user - cfg.held_out
    return TDMData(
        item_ids,
        item_emb,
        user_feat,
        np.repeat(np.arange(cfg.users), n_train),
        chosen[:, :n_train].reshape(-1),
        chosen[:, n_train:],
    )


class TDMModel(nn.Module):
    """``score(user, node) = query(features) . node(node) + bias[node]`` with
    ``node(n) = content([e, |e|^2]) + emb[n]`` where ``e = tree.node_emb[n]``: a content tower
    over the tree's node embeddings (the mean item embedding under each node) plus a learned
    row per node. Rows are
    :meth:`TreeIndex.node_positions` of codes."""

    def __init__(self, tree: TreeIndex, feat_dim: int, hidden: int) -> None:
        super().__init__()
        self.tree = tree
        self.query = nn.Linear(feat_dim, hidden)
        content = torch.from_numpy(tree.node_emb)
        # [emb, |emb|^2]: with the query's bias, a dot product can express -|user - node|^2.
        content = torch.cat([content, content.square().sum(1, keepdim=True)], 1)
        self.register_buffer("node_content", content)
        self.content = nn.Linear(tree.emb_size() + 1, hidden, bias=False)
        self.emb = nn.Embedding(tree.total_node_nums(), hidden)
        self.bias = nn.Embedding(tree.total_node_nums(), 1)
        nn.init.normal_(self.emb.weight, std=0.01)
        nn.init.zeros_(self.bias.weight)

    def rows(self, codes: torch.Tensor) -> torch.Tensor:
        """Embedding rows of node codes."""
        return torch.from_numpy(self.tree.node_positions(codes.numpy()))

    def node(self, pos: torch.Tensor) -> torch.Tensor:
        """Node vectors of embedding rows."""
        return self.content(self.node_content[pos]) + self.emb(pos)

    def forward(self, feats: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Scores of row-aligned (features, code) pairs."""
        pos = self.rows(codes)
        return (self.query(feats) * self.node(pos)).sum(-1) + self.bias(pos).squeeze(-1)

    def score_grid(self, queries: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """``[Q, C]`` scores of each query (``[Q, hidden]``) against its row of codes."""
        pos = self.rows(codes)
        return torch.einsum("qh,qch->qc", queries, self.node(pos)) + self.bias(pos).squeeze(-1)


def layer_counts(cfg: TDMConfig, tree: TreeIndex) -> list[int]:
    """Negatives per layer 1 .. leaf: up to ``cfg.negatives``, at most half the layer."""
    return [
        max(1, min(cfg.negatives, tree.get_layer_codes(level).size // 2))
        for level in range(1, tree.height())
    ]


def train(cfg: TDMConfig, data: TDMData, tree: TreeIndex) -> TDMModel:
    """Layer-wise sampled training with binary cross-entropy (Adam)."""
    torch.manual_seed(cfg.seed)
    model = TDMModel(tree, cfg.dim, cfg.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sampler = LayerWiseSampler(tree, layer_counts(cfg, tree), start_sample_layer=1, seed=cfg.seed)
    feats = torch.from_numpy(data.user_feat)
    rng = np.random.default_rng(cfg.seed + 1)
    n = data.train_items.size
    for _ in range(cfg.epochs):
        order = rng.permutation(n)
        for lo in range(0, n, cfg.batch):
            idx = order[lo : lo + cfg.batch]
            rows = sampler.sample(data.train_items[idx], data.train_users[idx])
            logits = model(feats[rows.user_idx], rows.node_code)
            loss = F.binary_cross_entropy_with_logits(logits, rows.label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model


@torch.no_grad()
def evaluate(cfg: TDMConfig, data: TDMData, tree: TreeIndex, model: TDMModel) -> dict:
    """Recall@topk of beam search and of brute force on the held-out pairs, and their cost."""
    queries_all = model.query(torch.from_numpy(data.user_feat))
    leaves = torch.from_numpy(tree.get_layer_codes(tree.height() - 1))
    leaf_ids = tree.get_nodes(leaves.numpy())
    leaf_pos = model.rows(leaves)
    leaf_emb, leaf_bias = model.node(leaf_pos), model.bias(leaf_pos).squeeze(-1)
    hit_tree = hit_brute = overlap = 0
    scorings = 0
    for lo in range(0, cfg.users, 512):
        q = queries_all[lo : lo + 512]
        found = beam_search(
            tree, lambda codes, q=q: model.score_grid(q, codes), len(q), cfg.beam, cfg.topk
        )
        scorings += found.scorings
        brute = leaf_ids[(q @ leaf_emb.T + leaf_bias).topk(cfg.topk, dim=1).indices.numpy()]
        test = data.test_items[lo : lo + 512]
        hit_tree += sum(np.isin(t, f).sum() for t, f in zip(test, found.item_ids))
        hit_brute += sum(np.isin(t, b).sum() for t, b in zip(test, brute))
        overlap += sum(np.isin(b, f).sum() for b, f in zip(brute, found.item_ids))
    pairs = data.test_items.size
    recall_tree, recall_brute = hit_tree / pairs, hit_brute / pairs
    per_user_tree = scorings / cfg.users
    return {
        "recall_tree": recall_tree,
        "recall_brute": recall_brute,
        "recall_ratio": recall_tree / recall_brute if recall_brute else float("nan"),
        "overlap": overlap / (cfg.users * cfg.topk),
        "scorings_tree": per_user_tree,
        "scorings_brute": float(leaves.numel()),
        "cost_ratio": per_user_tree / leaves.numel(),
    }


def run(cfg: TDMConfig, other_beams: tuple[int, ...] = ()) -> dict:
    """Generate, build the tree, train, evaluate; the result dict (with timings).
    ``other_beams``: also evaluate these beam widths (``out["beams"][width]``)."""
    t0 = time.perf_counter()
    data = generate(cfg)
    t1 = time.perf_counter()
    tree = TreeIndex.build(data.item_ids, data.item_emb, branch=cfg.branch, seed=cfg.seed)
    t2 = time.perf_counter()
    model = train(cfg, data, tree)
    t3 = time.perf_counter()
    out = evaluate(cfg, data, tree, model)
    t4 = time.perf_counter()
    out["beams"] = {b: evaluate(replace(cfg, beam=b), data, tree, model) for b in other_beams}
    out.update(
        height=tree.height(),
        nodes=tree.total_node_nums(),
        generate_s=t1 - t0,
        build_s=t2 - t1,
        train_s=t3 - t2,
        eval_s=t4 - t3,
        config=asdict(cfg),
    )
    return out


def parse_args(argv: list[str] | None = None) -> TDMConfig:
    """Every :class:`TDMConfig` field as a ``--flag``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in asdict(TDMConfig()).items():
        p.add_argument(f"--{name}", type=type(value), default=value)
    p.add_argument("--json", default="", help="also write the result to this file")
    args = vars(p.parse_args(argv))
    path = args.pop("json")
    cfg = TDMConfig(**args)
    cfg.json = path  # type: ignore[attr-defined]
    return cfg


def main(argv: list[str] | None = None) -> None:
    """Run and print the JSON result line."""
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    out = run(cfg)
    line = json.dumps(out)
    print(line)
    if cfg.json:  # type: ignore[attr-defined]
        with open(cfg.json, "w", encoding="utf-8") as f:  # type: ignore[attr-defined]
            f.write(line + "\n")


if __name__ == "__main__":
    main()
