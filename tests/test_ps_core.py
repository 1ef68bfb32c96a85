"""ps_server core, pure: optimizer math against torch.optim, deterministic initializers, configs
and their dict round trip, the registries, routing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

from collective.errors import ConfigError
from ps_server import (
    SGD,
    Adagrad,
    Adam,
    Constant,
    CountFilterEntry,
    DenseTable,
    DenseTableConfig,
    EntryPolicy,
    Initializer,
    Normal,
    OptimizerRule,
    ProbabilityEntry,
    SparseTable,
    SparseTableConfig,
    TruncatedNormal,
    Uniform,
    check_same_config,
    config_from_dict,
    config_to_dict,
    group_by_server,
    shard_of,
    shards_of_server,
)
from ps_server.errors import TableConfigMismatchError

I64 = np.iinfo(np.int64)


def sparse(
    name: str = "emb",
    dim: int = 4,
    optimizer: OptimizerRule | None = None,
    initializer: Initializer | None = None,
    **kw,
) -> SparseTable:
    cfg = SparseTableConfig(name, dim, optimizer or SGD(0.1), initializer or Normal(0.0, 0.5), **kw)
    return SparseTable(cfg)


def torch_opt(rule: OptimizerRule, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if isinstance(rule, SGD):
        return torch.optim.SGD(params, lr=rule.lr)
    if isinstance(rule, Adagrad):
        return torch.optim.Adagrad(
            params,
            lr=rule.lr,
            eps=rule.eps,
            initial_accumulator_value=rule.initial_accumulator_value,
        )
    return torch.optim.Adam(params, lr=rule.lr, betas=rule.betas, eps=rule.eps)


RULES = [
    SGD(0.1),
    Adagrad(0.1, initial_accumulator_value=0.1, eps=1e-6),
    Adagrad(0.05),
    Adam(0.01, betas=(0.9, 0.99), eps=1e-6),
    Adam(0.003),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.TYPE}-{r.lr}")
def test_sparse_rules_match_torch_per_row(rule: OptimizerRule) -> None:
    """Rows pushed unequally often (and with duplicates) follow a torch param per row that steps
    only when its row is pushed — per-row Adam step included."""
    rng = np.random.default_rng(1)
    dim = 5
    table = sparse(dim=dim, optimizer=rule)
    keys = np.array([I64.min, -7, 0, 3, 11, I64.max, 123456789], dtype=np.int64)
    init = table.pull(keys)
    params = [torch.nn.Parameter(torch.from_numpy(init[i].copy())) for i in range(len(keys))]
    opts = [torch_opt(rule, [p]) for p in params]
    probs = np.array([0.9, 0.2, 0.5, 0.7, 0.1, 0.6, 0.35])
    for _step in range(12):
        touched = np.flatnonzero(rng.random(len(keys)) < probs)
        if touched.size == 0:
            continue
        batch = np.concatenate([touched, rng.choice(touched, 2)])  # two duplicated keys
        grads = rng.standard_normal((batch.size, dim)).astype(np.float32)
        table.push(keys[batch], grads)
        for i in touched:
            g = grads[batch == i].sum(axis=0, dtype=np.float32)
            params[i].grad = torch.from_numpy(g)
            opts[i].step()
        want = np.stack([p.detach().numpy() for p in params])
        np.testing.assert_allclose(table.pull(keys), want, atol=1e-6, rtol=0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rule", RULES[:4], ids=lambda r: r.TYPE)
def test_dense_rules_match_torch(rule: OptimizerRule) -> None:
    rng = np.random.default_rng(2)
    table = DenseTable(DenseTableConfig("dense", rule))
    w0 = rng.standard_normal(30).astype(np.float32)
    assert table.init("fc.weight", w0.reshape(5, 6)) is True
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch_opt(rule, [p])
    for _ in range(8):
        g = rng.standard_normal(30).astype(np.float32)
        table.push("fc.weight", g.reshape(5, 6))
        p.grad = torch.from_numpy(g)
        opt.step()
    np.testing.assert_allclose(table.pull("fc.weight"), p.detach().numpy(), atol=1e-6, rtol=0)


@pytest.mark.timeout(30)
def test_weight_bounds_clip_after_update() -> None:
    table = sparse(optimizer=SGD(1.0, weight_bounds=(-0.25, 0.5)), initializer=Constant(0.1))
    keys = np.arange(4, dtype=np.int64)
    grads = np.array([[10, -10, 0.1, 0]] * 4, dtype=np.float32)
    table.push(keys, grads)
    np.testing.assert_allclose(table.pull(keys)[0], [-0.25, 0.5, 0.0, 0.1], atol=1e-7)
    with pytest.raises(ConfigError, match="weight_bounds"):
        Adam(0.1, weight_bounds=(1.0, -1.0))


@pytest.mark.timeout(30)
def test_initial_rows_depend_only_on_table_key_seed() -> None:
    rng = np.random.default_rng(3)
    keys = np.unique(
        np.concatenate(
            [
                rng.integers(I64.min, I64.max, 3000, dtype=np.int64, endpoint=True),
                np.array([I64.min, I64.min + 1, -1, 0, 1, I64.max - 1, I64.max], dtype=np.int64),
            ]
        )
    )
    init = TruncatedNormal(0.0, 0.1)
    reference = sparse(dim=8, initializer=init, seed=7).pull(keys)
    # another order and batching
    other = sparse(dim=8, initializer=init, seed=7)
    perm = rng.permutation(keys.size)
    out = np.empty_like(reference)
    for part in (perm[:1], perm[1:4], perm[4:1000], perm[1000:]):
        out[part] = other.pull(keys[part])
    np.testing.assert_array_equal(out, reference)
    # another shard count, spread over 3 servers
    cfg = SparseTableConfig("emb", 8, SGD(0.1), init, seed=7, num_shards=16)
    servers = [SparseTable.for_server(cfg, s, 3) for s in range(3)]
    out = np.empty_like(reference)
    for s, idx in enumerate(group_by_server(keys, 3, 16)):
        out[idx] = servers[s].pull(keys[idx])
    np.testing.assert_array_equal(out, reference)
    # different seed, different table name: different rows; a row's columns do not depend on dim
    assert (sparse(dim=8, initializer=init, seed=8).pull(keys) != reference).mean() > 0.99
    assert (sparse("emb2", dim=8, initializer=init, seed=7).pull(keys) != reference).mean() > 0.99
    np.testing.assert_array_equal(
        sparse(dim=3, initializer=init, seed=7).pull(keys), reference[:, :3]
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("init", "mean", "std"),
    [
        (Uniform(-0.5, 1.5), 0.5, 2.0 / np.sqrt(12.0)),
        (Normal(1.0, 2.0), 1.0, 2.0),
        (TruncatedNormal(-1.0, 0.5), -1.0, 0.5 * 0.8796),
        (Constant(0.25), 0.25, 0.0),
    ],
    ids=lambda v: getattr(v, "TYPE", ""),
)
def test_initializer_distributions(init: Initializer, mean: float, std: float) -> None:
    keys = np.arange(-20000, 20000, dtype=np.int64)
    x = init.rows("t", 0, keys, 16).astype(np.float64)
    assert x.shape == (40000, 16)
    assert abs(x.mean() - mean) < 0.01 + 0.02 * std
    assert abs(x.std() - std) < 0.02 * std + 1e-9
    if std:
        corr = np.corrcoef(x[:, 0], x[:, 1])[0, 1]
        assert abs(corr) < 0.03
        per_col = x.mean(axis=0)
        assert np.all(np.abs(per_col - mean) < 0.05 * std + 0.02)
    if isinstance(init, TruncatedNormal):
        assert np.abs(x - mean).max() <= 2 * 0.5 + 1e-6
    if isinstance(init, Uniform):
        assert x.min() >= -0.5 and x.max() <= 1.5


# -- configs and registries ----------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_config_dict_round_trip_and_json() -> None:
    cfg = SparseTableConfig(
        "ctr.emb_1",
        16,
        Adam(1e-3, betas=(0.8, 0.9), weight_bounds=(-5, 5)),
        TruncatedNormal(0.0, 0.02),
        entry=CountFilterEntry(3),
        num_shards=32,
        seed=11,
        nonfinite="skip",
        max_capacity=1000,
    )
    d = json.loads(json.dumps(config_to_dict(cfg)))
    assert d["kind"] == "sparse" and d["optimizer"] == {
        "type": "adam",
        "lr": 1e-3,
        "betas": [0.8, 0.9],
        "eps": 1e-8,
        "weight_bounds": [-5.0, 5.0],
    }
    assert config_from_dict(d) == cfg
    dense = DenseTableConfig("dense", {"type": "adagrad", "lr": 0.1})
    assert dense.optimizer == Adagrad(0.1)
    assert config_from_dict(json.loads(json.dumps(config_to_dict(dense)))) == dense
    for obj in (
        SGD(0.5),
        Adagrad(0.1, 0.2, 1e-7),
        Uniform(-1, 1),
        Normal(0, 1),
        Constant(2.0),
        ProbabilityEntry(0.25),
        CountFilterEntry(2),
    ):
        family = type(obj).__mro__[1]
        assert family.from_dict(json.loads(json.dumps(obj.to_dict()))) == obj


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("data", "key", "text"),
    [
        ({"dim": 0}, "dim", "[1, 65536]"),
        ({"name": "a/b"}, "name", "letters"),
        ({"num_shards": 0}, "num_shards", "[1, 65536]"),
        ({"nonfinite": "ignore"}, "nonfinite", "reject"),
        ({"max_capacity": 0}, "max_capacity", ">= 1"),
        ({"optimizer": {"type": "adagrad", "lr": -1}}, "optimizer.lr", ">= 0"),
        ({"optimizer": {"type": "adagard", "lr": 1}}, "optimizer.type", "did you mean 'adagrad'"),
        ({"optimizer": {"lr": 1}}, "optimizer.type", "adagrad, adam, sgd"),
        ({"optimizer": {"type": "sgd"}}, "optimizer.lr", "needs lr"),
        (
            {"optimizer": {"type": "adam", "lr": 1, "betas": [0.9, 1.0]}},
            "optimizer.betas",
            "[0, 1)",
        ),
        (
            {"initializer": {"type": "uniform", "low": 1, "high": 0}},
            "initializer.high",
            "low <= high",
        ),
        ({"entry": {"type": "count_filter", "n": 0}}, "entry.n", ">= 1"),
        ({"entry": {"type": "probability", "p": 1.5}}, "entry.p", "[0, 1]"),
        ({"dimm": 3}, "dimm", "did you mean 'dim'"),
    ],
)
def test_config_errors_name_the_field(data: dict, key: str, text: str) -> None:
    base = {
        "name": "emb",
        "dim": 8,
        "optimizer": {"type": "sgd", "lr": 0.1},
        "initializer": {"type": "constant"},
    }
    with pytest.raises(ConfigError) as info:
        SparseTableConfig.from_dict({**base, **data})
    assert info.value.key == key, str(info.value)
    assert text in str(info.value)


@pytest.mark.timeout(30)
def test_second_create_with_other_config_shows_both() -> None:
    a = SparseTableConfig("emb", 8, Adagrad(0.1), Uniform())
    check_same_config(a, SparseTableConfig("emb", 8, Adagrad(0.1), Uniform(-0.01, 0.01)))
    with pytest.raises(TableConfigMismatchError) as info:
        check_same_config(a, SparseTableConfig("emb", 16, Adagrad(0.2), Uniform()))
    msg = str(info.value)
    assert "dim: 8 (existing) != 16 (requested)" in msg
    assert "optimizer.lr: 0.1 (existing) != 0.2 (requested)" in msg
    assert "existing:" in msg and "requested:" in msg and "'lr': 0.2" in msg


@OptimizerRule.register
@dataclass(frozen=True)
class SignSGD(OptimizerRule):
    """A rule defined outside ps_server: registered by subclassing + decorator."""

    TYPE: ClassVar[str] = "test_sign_sgd"
    lr: float

    def apply(self, weights, state, grads, rows_meta) -> None:
        weights -= np.float32(self.lr) * np.sign(grads)


@EntryPolicy.register
@dataclass(frozen=True)
class EvenKeys(EntryPolicy):
    TYPE: ClassVar[str] = "test_even_keys"

    def admit(self, keys, counts, rng):
        return keys % 2 == 0


@pytest.mark.timeout(30)
def test_new_rules_by_subclass_and_register() -> None:
    cfg = SparseTableConfig.from_dict(
        {
            "name": "emb",
            "dim": 2,
            "optimizer": {"type": "test_sign_sgd", "lr": 0.5},
            "initializer": {"type": "constant", "value": 1.0},
            "entry": {"type": "test_even_keys"},
        }
    )
    table = SparseTable(cfg)
    keys = np.arange(4, dtype=np.int64)
    stats = table.push(keys, np.array([[1, -1]] * 4, dtype=np.float32))
    assert (stats.created, stats.filtered, table.num_rows) == (2, 2, 2)
    np.testing.assert_array_equal(table.pull(keys), [[0.5, 1.5], [1, 1], [0.5, 1.5], [1, 1]])
    with pytest.raises(TypeError, match="already registered"):
        OptimizerRule.register(type("Other", (SignSGD,), {"TYPE": "sgd"}))


# -- routing -------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_routing_is_deterministic_and_balanced() -> None:
    rng = np.random.default_rng(4)
    keys = rng.integers(I64.min, I64.max, 200_000, dtype=np.int64, endpoint=True)
    shards = shard_of(keys, 64)
    np.testing.assert_array_equal(shards, shard_of(keys.copy(), 64))
    np.testing.assert_array_equal(shard_of(keys[::-1], 64), shards[::-1])
    assert shards.min() >= 0 and shards.max() < 64
    counts = np.bincount(shards, minlength=64)
    assert counts.min() > 0.9 * counts.mean() and counts.max() < 1.1 * counts.mean()
    # sequential keys (ids 0..n) spread as well
    seq = np.bincount(shard_of(np.arange(64_000, dtype=np.int64), 64), minlength=64)
    assert seq.min() > 0.85 * 1000 and seq.max() < 1.15 * 1000
    # servers partition the shards; groups partition the keys
    owned = [shards_of_server(s, 3, 64) for s in range(3)]
    assert sorted(sum(owned, ())) == list(range(64)) and [len(o) for o in owned] == [22, 21, 21]
    groups = group_by_server(keys, 3, 64)
    assert np.array_equal(np.sort(np.concatenate(groups)), np.arange(keys.size))
    for s, idx in enumerate(groups):
        assert np.all(np.isin(shard_of(keys[idx], 64), owned[s]))
        assert np.all(np.diff(idx) > 0)
    with pytest.raises(ConfigError, match="num_servers"):
        shards_of_server(0, 65, 64)
    with pytest.raises(ConfigError, match="server_index"):
        shards_of_server(3, 3, 64)


@pytest.mark.timeout(30)
def test_hashes_are_pinned() -> None:
    """Shard files and initial values depend on these exact hashes: changing the mixer or a salt
    breaks every saved checkpoint and every deterministic init, so it must be deliberate."""
    keys = np.array([0, 1, -1, I64.min, I64.max, 123456789], dtype=np.int64)
    assert shard_of(keys, 64).tolist() == [7, 3, 14, 18, 41, 35]
    np.testing.assert_array_equal(
        Uniform(-1, 1).rows("emb", 0, keys[:2], 3),
        np.array(
            [
                [-0.7642558813095093, -0.9366052746772766, 0.2320856899023056],
                [0.035495318472385406, -0.34592488408088684, -0.06611516326665878],
            ],
            np.float32,
        ),
    )


def test_remembered_lookup_follows_every_change_of_the_mapping() -> None:
    """RowStore keeps the last large lookup: a repeat of the same keys is answered from it, and
    any insert, delete or compaction in between makes the next lookup probe again."""
    import numpy as np

    from ps_server.core.row_store import LOOKUP_CACHE_MIN_KEYS, RowStore

    store = RowStore({"values": ((2,), np.float32)})
    keys = np.arange(LOOKUP_CACHE_MIN_KEYS, dtype=np.int64) * 7 - 5000
    assert (store.lookup(keys) == -1).all()
    rows = store.allocate(keys[::2])
    got = store.lookup(keys)
    np.testing.assert_array_equal(got[::2], rows)
    assert (got[1::2] == -1).all()
    got[:] = 99  # the caller owns what it gets back
    np.testing.assert_array_equal(store.lookup(keys)[::2], rows)
    store.remove_rows(rows[:10])
    after = store.lookup(keys)
    assert (after[:20:2] == -1).all() and (after[20::2] == rows[10:]).all()
    store.compact()
    live = store.lookup(keys)
    np.testing.assert_array_equal(store.keys[live[20::2]], keys[20::2])


@pytest.mark.parametrize("compiled", [True, False])
def test_row_gather_and_scatter_helpers_equal_fancy_indexing(
    monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """``take_rows`` / ``put_rows`` (what the client routes with; compiled, or row views) give
    what numpy fancy indexing gives, for index arrays, slices, 1-D keys and empty batches."""
    from ps_server.core import kernels
    from ps_server.core.batch_ops import put_rows, take_rows

    monkeypatch.setattr(kernels, "ENABLED", compiled and kernels._c is not None)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((500, 3)).astype(np.float32)
    pos = rng.permutation(500)[:200]
    for p in (pos, slice(10, 60), np.zeros(0, np.int64)):
        np.testing.assert_array_equal(take_rows(a, p), a[p])
        out, ref = np.zeros_like(a), np.zeros_like(a)
        put_rows(out, p, a[p][::-1].copy())
        ref[p] = a[p][::-1]
        np.testing.assert_array_equal(out, ref)
    keys = rng.integers(0, 1 << 62, 500)
    np.testing.assert_array_equal(take_rows(keys, pos), keys[pos])
    out = np.zeros((500, 0), np.float32)
    put_rows(out, pos, np.zeros((200, 0), np.float32))
