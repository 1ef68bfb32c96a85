"""The fused multi-slot lookup of ``DistributedEmbedding`` equals the per-slot path.

``emb([s_0, ..., s_n])`` (one concatenation, one dedup, one pull, one pooling over all bags,
one ``[U, dim]`` gradient) against ``[emb(s) for s in slots]``, on real in-process parameter
servers reached through a sync communicator: the forward values are bit for bit equal, the
gradients recorded for the push and the table rows after one SGD step equal within float32
summation order (a key used by several slots has its gradient summed on the trainer instead of
on the server).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from collective.errors import ConfigError
from fleet.data.batch import SparseBatch
from fleet.ps import embedding as emb_mod
from fleet.ps.communicator import SyncCommunicator
from fleet.ps.embedding import DistributedEmbedding
from fleet.ps.runtime import lookups_from
from ps_server import SGD, Uniform

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster

pytestmark = pytest.mark.timeout(60)

DIM = 4


def _slot(lengths: list[int], vocab: int, rng: np.random.Generator) -> SparseBatch:
    lens = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    values = torch.from_numpy(rng.integers(-vocab, vocab, int(lens.sum())).astype(np.int64))
    return SparseBatch(values, lens, offsets)


def _one_id_slots(num: int, batch: int, rng: np.random.Generator) -> list[SparseBatch]:
    # a small shared vocabulary: keys repeat inside a slot and across slots
    return [_slot([1] * batch, 40, rng) for _ in range(num)]


def _jagged_slots(rng: np.random.Generator) -> dict[str, SparseBatch]:
    return {
        "multi": _slot([3, 0, 1, 5, 2, 0], 30, rng),  # bags of several ids and empty bags
        "one": _slot([1] * 6, 30, rng),
        "none": _slot([0] * 6, 30, rng),  # no id at all in this batch
        "tail": _slot([2, 2, 0, 0, 0, 0], 30, rng),  # empty bags at the end
    }


def _embeddings(tag: str, poolings: list[str]) -> list[DistributedEmbedding]:
    return [
        DistributedEmbedding(
            f"fused_{tag}_{i}",
            DIM,
            optimizer=SGD(0.5),
            initializer=Uniform(-1, 1),
            pooling=p,
            seed=i,
        )
        for i, p in enumerate(poolings)
    ]


def _train_step(embs: list[DistributedEmbedding], slots: Any, fused: bool) -> dict[str, Any]:
    """One forward + backward + sync SGD step on fresh servers; what it produced."""
    with cluster(2) as (_, client):
        comm = SyncCommunicator(client, 1, lambda: None)
        for e in embs:
            client.create_table_from_config(e.table_config())
            comm.add_table(e.table, DIM, 0.5)
        items = _items(slots)
        keys = np.unique(np.concatenate([s.values.numpy() for s in items]))
        init = {e.table: client.pull_sparse(e.table, keys) for e in embs}
        with lookups_from(comm):
            outs = {}
            for e in embs:
                if fused:
                    got = e(slots)
                    outs[e.table] = list(got.values()) if isinstance(slots, dict) else got
                    assert isinstance(got, type(slots))
                else:
                    outs[e.table] = [e(s) for s in items]
            _loss(outs).backward()
        pieces = {t: len(comm.pending[t].keys) for t in comm.pending}
        grads = {t: comm.pending[t].merged(DIM) for t in comm.pending}
        comm.step()
        rows = {e.table: client.pull_sparse(e.table, keys) for e in embs}
        comm.close()
    return {
        "outs": outs,
        "pieces": pieces,
        "grads": grads,
        "rows": rows,
        "init": init,
        "keys": keys,
    }


def _loss(outs: dict[str, list[torch.Tensor]]) -> torch.Tensor:
    """The same weighted sum of every output for every path (fixed random weights)."""
    weights = torch.Generator().manual_seed(7)
    return sum(
        (o * torch.randn(o.shape, generator=weights)).sum() for t in sorted(outs) for o in outs[t]
    )


def _reference(
    embs: list[DistributedEmbedding], slots: Any, init: dict[str, np.ndarray], keys: np.ndarray
) -> tuple[dict[str, list[torch.Tensor]], dict[str, np.ndarray]]:
    """Outputs and row gradients from plain autograd through ``F.embedding_bag`` per slot."""
    rows = {e.table: torch.tensor(init[e.table], requires_grad=True) for e in embs}
    outs = {
        e.table: [
            torch.nn.functional.embedding_bag(
                torch.from_numpy(np.searchsorted(keys, s.values.numpy())),
                rows[e.table],
                s.offsets[:-1],
                mode=e.pooling,
            )
            for s in _items(slots)
        ]
        for e in embs
    }
    _loss(outs).backward()
    return outs, {t: r.grad.numpy() for t, r in rows.items()}


def _per_key(keys: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uniq, inv = np.unique(keys, return_inverse=True)
    out = np.zeros((uniq.shape[0], grads.shape[1]), np.float64)
    np.add.at(out, inv.reshape(-1), grads.astype(np.float64))
    return uniq, out


def _assert_equal_paths(embs: list[DistributedEmbedding], slots: Any) -> dict[str, Any]:
    fused = _train_step(embs, slots, fused=True)
    per_slot = _train_step(embs, slots, fused=False)
    ref_outs, ref_grads = _reference(embs, slots, fused["init"], fused["keys"])
    n = len(slots)
    for e in embs:
        t = e.table
        for a, b in zip(fused["outs"][t], per_slot["outs"][t]):
            assert torch.equal(a, b)  # the same rows summed per bag in the same order
        assert [o.shape for o in fused["outs"][t]] == [(s.batch_size, DIM) for s in _items(slots)]
        assert fused["pieces"].get(t, 0) <= 1  # one [U, dim] gradient per table and step
        assert per_slot["pieces"].get(t, 0) <= n
        fk, fg = fused["grads"][t]
        order = np.argsort(fk, kind="stable")  # pushed in the order the keys first occur
        fk, fg = fk[order], fg[order]
        assert np.array_equal(fk, np.unique(fk))  # one row per unique key
        pk, pg = _per_key(*per_slot["grads"][t])
        np.testing.assert_array_equal(fk, pk)
        np.testing.assert_allclose(fg, pg, rtol=1e-5, atol=1e-6)  # summation order only
        np.testing.assert_allclose(fused["rows"][t], per_slot["rows"][t], rtol=1e-5, atol=1e-6)
        for a, r in zip(fused["outs"][t], ref_outs[t]):
            torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(fk, fused["keys"])
        np.testing.assert_allclose(fg, ref_grads[t], rtol=1e-5, atol=1e-6)
        expect = fused["init"][t] - 0.5 * ref_grads[t]  # one SGD(0.5) step
        np.testing.assert_allclose(fused["rows"][t], expect, rtol=1e-5, atol=1e-6)
    return fused


def _items(slots: Any) -> list[Any]:
    return list(slots.values()) if isinstance(slots, dict) else list(slots)


def test_one_id_slots_list_equal_per_slot() -> None:
    """Paddle's CTR shape, smaller: many one-id slots sharing keys, a list in, a list out."""
    slots = _one_id_slots(26, 32, np.random.default_rng(0))
    fused = _assert_equal_paths(_embeddings("one_id", ["sum"]), slots)
    rows = fused["rows"]["fused_one_id_0"]
    assert np.abs(rows).max() > 0  # the step moved rows: gradients reached the servers


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_jagged_slots_dict_with_empty_bags_equal_per_slot(pooling: str) -> None:
    slots = _jagged_slots(np.random.default_rng(1))
    fused = _assert_equal_paths(_embeddings(f"jagged_{pooling}", [pooling]), slots)
    outs = dict(zip(slots, fused["outs"][f"fused_jagged_{pooling}_0"]))
    assert torch.equal(outs["none"], torch.zeros(6, DIM))  # a slot without ids pools to zeros
    assert torch.equal(outs["multi"][1], torch.zeros(DIM))  # an empty bag too
    assert torch.equal(outs["tail"][2:], torch.zeros(4, DIM))


def test_several_tables_read_the_same_slots() -> None:
    """Wide & deep: two tables (sum and mean) over the same slots, one layout for both."""
    rng = np.random.default_rng(2)
    slots = _one_id_slots(5, 16, rng) + list(_jagged_slots(rng).values())
    _assert_equal_paths(_embeddings("tables", ["sum", "mean"]), slots)


def test_fused_forward_matches_embedding_bag_on_the_pulled_rows() -> None:
    rng = np.random.default_rng(3)
    slots = _jagged_slots(rng)
    (emb,) = _embeddings("reference", ["mean"])
    with cluster(1) as (_, client):
        comm = SyncCommunicator(client, 1, lambda: None)
        client.create_table_from_config(emb.table_config())
        comm.add_table(emb.table, DIM, 0.5)
        with lookups_from(comm), torch.no_grad():
            out = emb(slots)
            for name, s in slots.items():
                rows = torch.from_numpy(client.pull_sparse(emb.table, s.values.numpy()))
                ids = torch.arange(s.values.shape[0])
                ref = torch.nn.functional.embedding_bag(ids, rows, s.offsets[:-1], mode="mean")
                torch.testing.assert_close(out[name], ref, rtol=1e-6, atol=1e-7)
        comm.close()


def test_layout_built_once_per_batch_and_rebuilt_after_a_change() -> None:
    rng = np.random.default_rng(4)
    slots = _one_id_slots(3, 8, rng)
    first = emb_mod._KEYED.get(slots, "t", "list")
    assert emb_mod._KEYED.get(list(slots), "u", "list") is first  # another table, same batch
    slots[1].values[0] += 1  # in place: the version counter moves
    again = emb_mod._KEYED.get(slots, "t", "list")
    assert again is not first
    assert sorted(again.keys.tolist()) == np.unique(torch.cat([s.values for s in slots])).tolist()


@pytest.fixture(scope="module")
def errors_emb() -> DistributedEmbedding:
    return _embeddings("errors", ["sum"])[0]


@pytest.mark.parametrize(
    ("slot", "words"),
    [
        (SimpleNamespace(values=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 3])), None),
        (SimpleNamespace(values=torch.tensor([1, 2, 3]), offsets=torch.tensor([1, 3])), "from 0"),
        (SimpleNamespace(values=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 2])), "len"),
        (
            SimpleNamespace(values=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 3, 1, 3])),
            "non-decreasing",
        ),
        (SimpleNamespace(values=torch.tensor([1.0]), offsets=torch.tensor([0, 1])), "int64 ids"),
        (
            SimpleNamespace(values=torch.tensor([1]), offsets=torch.tensor([0.0, 1.0])),
            "1-D int64 [B+1]",
        ),
        ("not a slot", "expected a sparse slot"),
    ],
)
def test_bad_slots_are_named(
    errors_emb: DistributedEmbedding, slot: Any, words: str | None
) -> None:
    """Errors come before any pull and name the slot; a good slot is accepted."""
    emb = errors_emb
    good = SimpleNamespace(values=torch.tensor([5]), offsets=torch.tensor([0, 1]))
    if words is None:
        emb_mod._KEYED.get([good, slot], emb.table, "list")
        return
    with pytest.raises(ConfigError) as err:
        emb([good, slot])
    text = str(err.value)
    assert words in text and ("item 1" in text or "slot 1" in text), text
