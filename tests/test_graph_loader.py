"""fleet.graph.NeighborLoader over real servers: relabelled subgraphs checked against the edge
list, features bit-exact, a GraphSAGE-style layer trained on the batches, errors raised in the
training loop."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_graph_table import graph_cluster

from collective.errors import ConfigError
from fleet.graph import NeighborLoader
from fleet.graph.loader import relabel
from ps_server.config import GraphTableConfig
from ps_server.rpc.status import PSNotFoundError

CFG = GraphTableConfig(
    "sbm",
    edge_types=["e"],
    features={"node": {"x": ("float32", 4), "label": ("int64", 1)}},
    num_shards=8,
)


def _planted(rng: np.random.Generator, n: int = 400, edges: int = 4000):
    """Two communities: edges mostly inside one, features carrying the class."""
    cls = rng.integers(0, 2, n)
    src = rng.integers(0, n, edges)
    same = rng.random(edges) < 0.9
    pool = [np.flatnonzero(cls == c) for c in (0, 1)]
    dst = np.where(
        same,
        [rng.choice(pool[cls[s]]) for s in src],
        [rng.choice(pool[1 - cls[s]]) for s in src],
    )
    x = (rng.standard_normal((n, 4)) + cls[:, None] * 0.5).astype(np.float32)
    return cls, src.astype(np.int64) * 7 - 1000, dst.astype(np.int64) * 7 - 1000, x


def test_relabel_keeps_order_of_first_appearance() -> None:
    n_id, local = relabel(np.array([5, -3]), np.array([9, 5, 9, 2, -3]))
    assert n_id.tolist() == [5, -3, 9, 2]
    assert local.tolist() == [2, 0, 2, 3, 1]


@pytest.mark.timeout(120)
def test_batches_match_the_graph_and_train() -> None:
    rng = np.random.default_rng(0)
    cls, src, dst, x = _planted(rng)
    ids = np.arange(400, dtype=np.int64) * 7 - 1000
    true = set(zip(src.tolist(), dst.tolist()))
    with graph_cluster(2) as (_, client):
        client.create_graph_table(CFG)
        client.add_edges("sbm", src, dst)
        client.add_nodes("sbm", ids, features={"x": x, "label": cls.reshape(-1, 1)})
        deg = dict(zip(ids.tolist(), client.degree("sbm", ids).tolist()))
        loader = NeighborLoader(
            client, "sbm", ids, fanouts=[5, 3], batch_size=64, features=["x"], label="label"
        )
        assert len(loader) == 7
        seen = []
        for batch in loader:
            n_id = batch.n_id.numpy()
            seeds = n_id[: batch.batch_size]
            seen.extend(seeds.tolist())
            assert np.unique(n_id).shape[0] == n_id.shape[0]
            row, col = batch.edge_index.numpy()
            for s, t in zip(n_id[col].tolist(), n_id[row].tolist()):
                assert (s, t) in true  # row 1 sampled row 0 along an edge
            first = np.bincount(col[col < batch.batch_size], minlength=batch.batch_size)
            assert first.tolist() == [min(5, deg[s]) for s in seeds.tolist()]
            pos = ((n_id + 1000) // 7).astype(np.int64)
            np.testing.assert_array_equal(batch.x.numpy().view(np.int32), x[pos].view(np.int32))
            np.testing.assert_array_equal(batch.y.numpy(), cls[pos])
        assert sorted(seen) == sorted(ids.tolist())

        # a GraphSAGE-style mean layer on the batches learns the planted classes
        torch.manual_seed(0)
        lin_self, lin_nb = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
        opt = torch.optim.Adam([*lin_self.parameters(), *lin_nb.parameters()], lr=0.05)

        def forward(batch) -> torch.Tensor:
            row, col = batch.edge_index
            agg = torch.zeros_like(batch.x).index_add_(0, col, batch.x[row])
            cnt = torch.zeros(batch.x.shape[0]).index_add_(0, col, torch.ones(row.shape[0]))
            h = lin_self(batch.x) + lin_nb(agg / cnt.clamp(min=1)[:, None])
            return h[: batch.batch_size]

        train = NeighborLoader(
            client, "sbm", ids, [5, 3], 64, features=["x"], label="label", shuffle=True, seed=1
        )
        for _ in range(8):
            for batch in train:
                loss = torch.nn.functional.cross_entropy(
                    forward(batch), batch.y[: batch.batch_size]
                )
                opt.zero_grad()
                loss.backward()
                opt.step()
        correct = total = 0
        with torch.no_grad():
            for batch in loader:
                pred = forward(batch).argmax(1)
                correct += int((pred == batch.y[: batch.batch_size]).sum())
                total += batch.batch_size
        assert correct / total > 0.8

        # an error on the sampling thread reaches the training loop
        with pytest.raises(PSNotFoundError, match="graph table 'nope'"):
            for _ in NeighborLoader(client, "nope", ids, [5], 64):
                pass

        # three batches sampled at once: every batch, in the seeds' order
        many = NeighborLoader(client, "sbm", ids, [5, 3], 64, num_workers=3, prefetch=4)
        got = [b.n_id[: b.batch_size].tolist() for b in many]
        assert sum(got, []) == ids.tolist()
        for _ in many:  # stopped early: no sampling thread is left behind
            break
        assert not [t for t in threading.enumerate() if t.name.startswith("neighbor-loader")]
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ConfigError, match="num_workers"):
                NeighborLoader(client, "sbm", ids, [5], 64, num_workers=bad)
