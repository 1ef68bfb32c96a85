"""The synthetic CTR data (examples/ctr/data.py), the pluggable wide & deep model and the
single-process baseline: determinism and sharding, the id space, Zipf skew, the label rate, a
known Bayes AUC, and a small baseline run that learns."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch
from conftest import REPO

if str(REPO) not in sys.path:  # `examples` is a directory of the repo, not an installed package
    sys.path.insert(0, str(REPO))

from examples.ctr.baseline import TrainConfig, train_baseline
from examples.ctr.data import (
    CTRDataConfig,
    bayes_auc,
    generate,
    roc_auc,
    shard,
    slot_rank_to_id,
)
from examples.ctr.model import HashedEmbedding, WideDeep

CONFIG = CTRDataConfig()


@pytest.mark.timeout(60)
def test_same_seed_and_start_give_the_same_data_and_shards_concatenate() -> None:
    a, b = generate(CONFIG, 5000, 1000), generate(CONFIG, 5000, 1000)
    for field in ("sparse_ids", "dense", "labels", "probs", "ranks"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    other = generate(CTRDataConfig(seed=1), 5000, 1000)
    assert not np.array_equal(a.sparse_ids, other.sparse_ids)
    assert not np.array_equal(a.labels, other.labels)

    whole = generate(CONFIG, 10_001)
    parts = [
        generate(CONFIG, count, start) for start, count in (shard(10_001, r, 3) for r in range(3))
    ]
    for field in ("sparse_ids", "dense", "labels", "probs"):
        assert np.array_equal(
            np.concatenate([getattr(p, field) for p in parts]), getattr(whole, field)
        )
    # an arbitrary window equals the same rows of the whole
    assert np.array_equal(generate(CONFIG, 7, 4321).sparse_ids, whole.sparse_ids[4321:4328])


@pytest.mark.timeout(30)
def test_shard_is_contiguous_and_paddle_like() -> None:
    assert [shard(10, r, 3) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert [shard(2, r, 4) for r in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]
    for bad in ((10, 3, 3), (10, -1, 3), (10, 0, 0), (-1, 0, 1)):
        with pytest.raises(ValueError):
            shard(*bad)


@pytest.mark.timeout(60)
def test_shapes_dtypes_and_the_int64_id_space() -> None:
    batch = generate(CONFIG, 20_000)
    assert batch.sparse_ids.shape == (20_000, 26) and batch.sparse_ids.dtype == np.int64
    assert batch.dense.shape == (20_000, 13) and batch.dense.dtype == np.float32
    assert batch.labels.shape == (20_000,) and batch.labels.dtype == np.float32
    assert set(np.unique(batch.labels).tolist()) == {0.0, 1.0}
    assert np.isfinite(batch.dense).all() and batch.dense.min() >= 0 and batch.dense.max() < 2
    ids = batch.sparse_ids
    # ids spread over the whole signed 64-bit range
    assert ids.min() < -(2**62) and ids.max() > 2**62
    assert 0.4 < (ids < 0).mean() < 0.6
    # an id is the fixed hash of (slot, rank): the same rank in two slots gives two ids
    assert np.array_equal(ids, slot_rank_to_id(np.arange(26)[None, :], batch.ranks))
    assert slot_rank_to_id(0, 0) != slot_rank_to_id(1, 0)
    first_slot_ids = set(np.unique(ids[:, 0]).tolist())
    assert not first_slot_ids & set(np.unique(ids[:, 1]).tolist())


@pytest.mark.timeout(60)
def test_ids_are_zipf_distributed() -> None:
    batch = generate(CONFIG, 50_000)
    ranks = batch.ranks[:, 3]
    pmf = np.arange(1, CONFIG.vocab_size + 1, dtype=np.float64) ** -CONFIG.zipf_exponent
    pmf /= pmf.sum()
    for rank in (0, 1, 9):
        assert (ranks == rank).mean() == pytest.approx(pmf[rank], rel=0.1)
    assert (ranks < 10).mean() == pytest.approx(pmf[:10].sum(), rel=0.05)
    # top ids are frequent, most ids rare: the most common id of a slot is its rank-0 id
    values, counts = np.unique(batch.sparse_ids[:, 3], return_counts=True)
    assert values[counts.argmax()] == slot_rank_to_id(3, 0)
    assert counts.max() > 0.1 * len(batch) and np.median(counts) <= 2
    assert ranks.max() > CONFIG.vocab_size // 2  # the tail is sampled too


@pytest.mark.timeout(60)
def test_label_rate_and_bayes_auc() -> None:
    batch = generate(CONFIG, 50_000)
    assert 0.1 <= batch.labels.mean() <= 0.3
    assert batch.probs.mean() == pytest.approx(CONFIG.target_ctr, abs=0.01)
    assert batch.labels.mean() == pytest.approx(batch.probs.mean(), abs=0.01)
    assert bayes_auc(CONFIG, 50_000) > 0.7
    low_ctr = generate(CTRDataConfig(target_ctr=0.1, seed=3), 20_000)
    assert low_ctr.labels.mean() == pytest.approx(0.1, abs=0.015)


@pytest.mark.timeout(30)
def test_roc_auc_is_exact_with_ties() -> None:
    rng = np.random.default_rng(1)
    scores = np.round(rng.random(400), 1)
    labels = (rng.random(400) < scores).astype(np.float32)
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    brute = ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size
    assert roc_auc(scores, labels) == pytest.approx(brute, abs=1e-12)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_slots", 0),
        ("num_dense", 65),
        ("vocab_size", 0),
        ("zipf_exponent", 0.0),
        ("target_ctr", 1.0),
        ("seed", -1),
        ("num_weighted_ranks", -1),
    ],
)
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"CTRDataConfig.{field}"):
        CTRDataConfig(**{field: value})


class _DictEmbedding(torch.nn.Module):
    """A stand-in for a parameter-server embedding: rows looked up by the raw 64-bit id."""

    def __init__(self, num_slots: int, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.rows: dict[int, torch.Tensor] = {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = [
            self.rows.setdefault(int(i), torch.full((self.dim,), 0.01)) for i in ids.reshape(-1)
        ]
        return torch.stack(flat).reshape(*ids.shape, self.dim)


@pytest.mark.timeout(30)
def test_model_embedding_is_pluggable() -> None:
    batch = generate(CONFIG, 64)
    ids, dense = torch.from_numpy(batch.sparse_ids), torch.from_numpy(batch.dense)
    made: list[tuple[int, int]] = []

    def factory(num_slots: int, dim: int) -> torch.nn.Module:
        made.append((num_slots, dim))
        return _DictEmbedding(num_slots, dim)

    model = WideDeep(embedding_dim=4, hidden_dims=(8,), embedding_factory=factory)
    assert made == [(26, 1), (26, 4)]
    assert model(ids, dense).shape == (64,)
    assert len(model.embedding_modules()[0].rows) == len(np.unique(batch.sparse_ids))
    assert not list(model.sparse_parameters())  # the embedding holds no torch parameters here

    hashed = WideDeep(embedding_dim=4, hidden_dims=(8,))
    assert {id(p) for p in hashed.sparse_parameters()} == {
        id(hashed.wide.table.weight),
        id(hashed.deep.table.weight),
    }
    assert len(list(hashed.dense_parameters())) == 6  # dense linear + 2 MLP layers, w and b
    out = hashed(ids, dense)
    out.sum().backward()
    assert hashed.deep.table.weight.grad.is_sparse


@pytest.mark.timeout(30)
def test_hashed_embedding_maps_negative_ids_into_the_table() -> None:
    emb = HashedEmbedding(2, 3, num_rows=10)
    ids = torch.tensor([[-1, 2**62 + 7], [-(2**63), 2**63 - 1]])
    rows = torch.remainder(ids, 10)
    assert rows.min() >= 0 and rows.max() < 10
    assert torch.equal(emb(ids), emb.table.weight[rows])


@pytest.mark.timeout(60)
def test_baseline_learns_on_a_small_set() -> None:
    start = time.perf_counter()
    report = train_baseline(
        CONFIG, TrainConfig(num_train=20_000, num_test=10_000, hash_rows=1 << 18)
    )
    elapsed = time.perf_counter() - start
    assert report["test_auc"] > 0.65, report
    assert report["test_auc"] < report["bayes_auc"] + 0.01, report
    assert abs(report["test_auc"] - report["test_exact_auc"]) < 0.01
    assert report["train_examples_per_s"] > 0 and report["bayes_auc"] > 0.7
    print(f"baseline on 20k examples: {elapsed:.1f} s, {report}")
