"""The pass cache (``fleet.ps.pass_cache``): a pass's rows pulled once into a trainer-local
table, trained with the table's own rule, pushed back once as a delta.

On real in-process parameter servers (127.0.0.1, port 0) through a SYNC communicator: a
pass-cached single-trainer run and a non-cached one over the same batches end with the same
rows and optimizer state (SGD, Adagrad and Adam over two passes: the state travels with the
rows); one pull and one push per table per pass; two trainers' value and state deltas both
reach the rows; a pass too large for its budget is a ConfigError before anything is pulled;
checkpoints refuse inside a pass.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from collective.errors import ConfigError
from fleet.base.data_position import DataPosition
from fleet.data.batch import Batch, SparseBatch
from fleet.ps import pass_cache, pass_keys
from fleet.ps.communicator import SyncCommunicator
from fleet.ps.embedding import DistributedEmbedding
from fleet.ps.pass_store import TorchRows
from fleet.ps.runtime import lookups_from
from ps_server import SGD, Adagrad, Adam, Uniform
from ps_server.core import kernels

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import cluster

pytestmark = pytest.mark.timeout(120)

DIM = 4
SLOTS = ("a", "b")


def _slot(rng: np.random.Generator, batch: int, vocab: int) -> SparseBatch:
    lens = torch.from_numpy(rng.integers(0, 4, batch).astype(np.int64))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    values = torch.from_numpy(rng.integers(0, vocab, int(lens.sum())).astype(np.int64))
    return SparseBatch(values, lens, offsets)


def _batches(seed: int, n: int = 12, batch: int = 16, vocab: int = 60) -> list[Batch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = Batch({s: _slot(rng, batch, vocab) for s in SLOTS})
        b["click"] = torch.from_numpy(rng.integers(0, 2, (batch, 1)).astype(np.int64))
        out.append(b)
    return out


class _Net(torch.nn.Module):
    def __init__(self, emb: DistributedEmbedding) -> None:
        super().__init__()
        self.emb = emb
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(len(SLOTS) * DIM, 1)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.fc(torch.cat(self.emb([batch[s] for s in SLOTS]), dim=1))


def _train(net: _Net, comm: SyncCommunicator, batches: list[Batch]) -> None:
    """Sparse training only: the dense layer stays as seeded. (Updating it would make the rows'
    gradients depend on MKL's matrix products, whose float summation order can change from run
    to run with the tensors' memory alignment: the bit-for-bit comparison of two runs is about
    the sparse path.)"""
    net.fc.requires_grad_(False)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    with lookups_from(comm):
        for b in batches:
            loss = loss_fn(net(b), b["click"].float())
            loss.backward()
            comm.step()


class _Counted:
    """Counts the client's logical sparse calls per table."""

    def __init__(self, client: Any) -> None:
        self.calls: list[tuple[str, str]] = []
        self.client = client
        self._pull, self._push = client.pull_sparse, client.push_sparse
        self._pull_state = client.pull_sparse_with_state

        def pull(table: str, keys: Any) -> Any:
            self.calls.append(("pull", table))
            return self._pull(table, keys)

        def pull_state(table: str, keys: Any) -> Any:
            self.calls.append(("pull", table))
            return self._pull_state(table, keys)

        def push(table: str, *a: Any, **kw: Any) -> Any:
            self.calls.append(("push", table))
            return self._push(table, *a, **kw)

        client.pull_sparse, client.push_sparse = pull, push
        client.pull_sparse_with_state = pull_state


def _run(rule: Any, passes: list[list[Batch]], cached: bool, name: str) -> tuple[Any, list]:
    """((rows, optimizer state) of every key after training ``passes``, the client's sparse
    calls of each pass)."""
    emb = DistributedEmbedding(
        name, DIM, optimizer=rule, initializer=Uniform(-0.5, 0.5), pooling="sum"
    )
    net = _Net(emb)
    keys = np.arange(60, dtype=np.int64)
    with cluster(1) as (_, client):
        client.create_table_from_config(emb.table_config())
        comm = SyncCommunicator(client, 1, lambda: None)
        comm.add_table(name, DIM, 0.1)
        counted = _Counted(client)
        per_pass = []
        for batches in passes:
            counted.calls.clear()
            if cached:
                pass_cache.start([emb], batches, client, comm, device="cpu")
                _train(net, comm, batches)
                stats = pass_cache.finish()
                assert stats.rpcs == 2 and stats.tables[name].pulls == 1
            else:
                _train(net, comm, batches)
            per_pass.append(list(counted.calls))
        rows = counted._pull_state(name, keys)
    return rows, per_pass


@pytest.mark.parametrize("store", ["kernels", "torch"])
@pytest.mark.parametrize(
    "rule", [SGD(0.3), Adagrad(0.2, initial_accumulator_value=0.1), Adam(0.05)]
)
def test_cached_pass_equals_sync_training(
    rule: Any, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two passes over the same rows: the second starts from the state the first left on the
    servers (Adagrad's accumulators, Adam's moments and per-row step). Both stores: the
    server's compiled kernels on the local columns, and the torch tensors with the rule's numpy
    update (what CUDA and other rules use)."""
    if store == "torch":
        monkeypatch.setattr(pass_cache, "make_rows", TorchRows)
    else:
        assert kernels.ENABLED
    passes = [_batches(seed) for seed in range(2)]
    name = f"pc_eq_{rule.TYPE}"
    (plain, plain_state), _ = _run(rule, passes, cached=False, name=name)
    (cached, cached_state), calls = _run(rule, passes, cached=True, name=name)
    if store == "kernels" and rule.TYPE == "sgd":  # the server's own push, locally
        np.testing.assert_array_equal(cached, plain)
    np.testing.assert_allclose(cached, plain, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(cached_state, plain_state, rtol=1e-6, atol=1e-7)
    assert not np.allclose(plain, _run(rule, [], cached=False, name=name)[0][0])  # it trained
    for c in calls:  # one pull and one push per table per pass, nothing per step
        assert c == [("pull", name), ("push", name)], c


def test_two_trainers_deltas_merge() -> None:
    """Each trainer's value and Adagrad state deltas add up on the servers (the accumulators
    hold both trainers' squared gradients)."""
    emb = DistributedEmbedding(
        "pc_merge", DIM, optimizer=Adagrad(0.5, initial_accumulator_value=0.1), pooling="sum"
    )
    net = _Net(emb)
    data = [_batches(10, n=4), _batches(11, n=4)]
    keys = np.arange(60, dtype=np.int64)
    with cluster(2) as (servers, client):
        client.create_table_from_config(emb.table_config())
        before, state_before = client.pull_sparse_with_state("pc_merge", keys)
        comms = [SyncCommunicator(client, 1, lambda: None) for _ in data]
        caches = []
        for comm, batches in zip(comms, data):  # both pull the same rows before either pushes
            comm.add_table("pc_merge", DIM, 0.5)
            caches.append(pass_cache.start([emb], batches, client, comm, register=False))
        deltas, state_deltas = [], []
        shows = np.zeros(keys.shape[0], np.int64)
        for comm, cache, batches in zip(comms, caches, data):
            _train(net, comm, batches)
            table = cache.tables["pc_merge"]
            k, d, sd = table.delta()
            full, full_state = np.zeros_like(before), np.zeros_like(state_before)
            full[k], full_state[k] = d, sd
            deltas.append(full)
            state_deltas.append(full_state)
            shows[k] += table.show[np.searchsorted(table.keys_np, k)]
            pass_cache.finish(cache, barrier=False)
            assert "pc_merge" in comm.tables  # given back to the communicator
        after, state_after = client.pull_sparse_with_state("pc_merge", keys)
        counts = _server_counts(servers, "pc_merge", keys)
    assert np.abs(deltas[0]).sum() > 0 and np.abs(deltas[1]).sum() > 0
    assert (state_deltas[0] >= 0).all() and state_deltas[0].sum() > 0
    np.testing.assert_allclose(after, before + deltas[0] + deltas[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        state_after, state_before + state_deltas[0] + state_deltas[1], rtol=1e-5, atol=1e-6
    )
    # the servers counted each row's occurrences in both passes' examples (Paddle's show)
    assert shows.sum() > len(keys) and np.array_equal(counts, shows)


def _server_counts(servers: list[Any], table: str, keys: np.ndarray) -> np.ndarray:
    """Each key's show count on whichever in-process server holds its row (0: no row)."""
    out = np.zeros(keys.shape[0], np.int64)
    for server in servers:
        t = server.state.tables[table]
        with t.lock:
            rows = t.store.lookup(keys)
            out[rows >= 0] = t.store.cols["count"][rows[rows >= 0]]
    return out


@pytest.mark.parametrize("num_keys", [40, 20_000], ids=["bytes", "shm"])
def test_delta_push_carries_show_counts(num_keys: int) -> None:
    """``push_sparse(mode="delta", shows=...)`` through gRPC bytes and the same-host segment:
    each row's count grows by its key's shows; shows for another mode or of the wrong length
    are refused before anything is sent."""
    from ps_server import SparseTableConfig
    from ps_server.errors import TableInputError

    keys = np.arange(num_keys, dtype=np.int64) * 7919
    shows = (np.arange(num_keys) % 5).astype(np.int64)
    with cluster(2) as (servers, client):
        client.create_table_from_config(
            SparseTableConfig("pc_shows", DIM, SGD(0.1), Uniform(-0.1, 0.1))
        )
        zeros = np.zeros((num_keys, DIM), np.float32)
        client.push_sparse("pc_shows", keys, zeros + 1, mode="delta", shows=shows)
        client.push_sparse("pc_shows", keys[:3], zeros[:3], mode="delta")  # one a key
        assert all((len(x.state.shm) > 0) == (num_keys > 1000) for x in servers)
        want = shows.copy()
        want[:3] += 1
        assert np.array_equal(_server_counts(servers, "pc_shows", keys), want)
        with pytest.raises(ConfigError, match="mode='delta'"):
            client.push_sparse("pc_shows", keys, zeros, shows=shows)
        with pytest.raises(TableInputError, match="show counts"):
            client.push_sparse("pc_shows", keys, zeros, mode="delta", shows=shows[1:])
        with pytest.raises(TableInputError, match=r"\[0, 2\*\*32 - 1\]"):
            client.push_sparse("pc_shows", keys, zeros, mode="delta", shows=shows - 1)
        assert np.array_equal(_server_counts(servers, "pc_shows", keys), want)


def test_too_large_pass_is_a_clear_error_before_any_pull() -> None:
    emb = DistributedEmbedding("pc_big", DIM, optimizer=Adagrad(0.1), pooling="sum")
    batches = _batches(3)
    with cluster(1) as (_, client):
        client.create_table_from_config(emb.table_config())
        comm = SyncCommunicator(client, 1, lambda: None)
        counted = _Counted(client)
        with pytest.raises(ConfigError) as err:
            pass_cache.start([emb], batches, client, comm, memory_budget_bytes=1000)
        assert counted.calls == []
        assert not pass_cache.in_pass()
    text = str(err.value)
    n = len(np.unique(np.concatenate([b[s].values.numpy() for b in batches for s in SLOTS])))
    per_key = pass_cache.bytes_per_key(DIM, emb.optimizer)
    assert f"{n} unique keys" in text and f"about {1000 // per_key} keys fit" in text, text


def test_checkpoints_refuse_inside_a_pass_and_counts() -> None:
    """Explicit checkpoints refuse; automatic ones record the pass's start; show/click."""
    emb = DistributedEmbedding("pc_ckpt", DIM, pooling="sum", cache="pass", cache_slots=["a"])
    batches = _batches(4, n=3)
    with cluster(1) as (_, client):
        client.create_table_from_config(emb.table_config())
        comm = SyncCommunicator(client, 1, lambda: None)
        comm.add_table("pc_ckpt", DIM, 0.01)
        cache = pass_cache.start([emb], batches, client, comm)
        try:
            with pytest.raises(ConfigError, match="fleet.end_pass"):
                pass_cache.refuse_in_pass("fleet.ps.checkpoint()")
            with pass_cache.automatic_cut():  # an automatic checkpoint: at the pass's start
                pass_cache.refuse_in_pass("fleet.ps.checkpoint()")
            inside = DataPosition(pass_index=2, step_in_pass=5, step=40)
            assert pass_cache.cut_position(inside) == DataPosition(2, 0, 35)
            table = cache.tables["pc_ckpt"]
            a_ids = np.concatenate([b["a"].values.numpy() for b in batches])
            assert np.array_equal(table.keys_np, np.unique(a_ids))  # only its slot's keys
            assert int(table.show.sum()) == a_ids.shape[0]
            labels = np.concatenate(
                [np.repeat(b["click"].numpy()[:, 0], b["a"].lengths.numpy()) for b in batches]
            )
            assert int(table.click.sum()) == int(labels.sum())
            with pytest.raises(Exception, match="not in the pass"):
                table.pull(np.array([10**9], np.int64))
        finally:
            pass_cache.finish()
        pass_cache.refuse_in_pass("fleet.ps.checkpoint()")  # after end_pass: allowed
        assert pass_cache.cut_position(inside) == inside


@pytest.mark.gpu
def test_cuda_pass_equals_cpu_pass() -> None:
    rule = Adagrad(0.2)
    out = {}
    emb = DistributedEmbedding("pc_dev", DIM, optimizer=rule, pooling="sum")
    for device in ("cpu", "cuda"):
        net = _Net(emb)
        batches = _batches(7)
        with cluster(1) as (_, client):
            client.create_table_from_config(emb.table_config())
            comm = SyncCommunicator(client, 1, lambda: None)
            comm.add_table(emb.table, DIM, 0.2)
            cache = pass_cache.start([emb], batches, client, comm, device=device)
            assert cache.tables[emb.table].rows.values.device.type == device
            _train(net, comm, batches)
            k, d, _ = cache.tables[emb.table].delta()
            pass_cache.finish()
        out[device] = (k, d)
    assert np.array_equal(out["cpu"][0], out["cuda"][0])
    np.testing.assert_allclose(out["cpu"][1], out["cuda"][1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("store", ["kernels", "torch"])
def test_tensor_lookups_equal_array_lookups(store: str) -> None:
    """What a module on the pass's device calls (``pull_tensor`` / ``record_tensor``: tensors
    in and out, no host copy on that device) reads and trains the rows as ``pull`` /
    ``record`` do; a slot layout moved to another device keeps its indices and is reused."""
    from fleet.ps.embedding import _KEYED
    from fleet.ps.pass_store import KernelRows

    rule = Adagrad(0.3)
    rng = np.random.default_rng(2)
    keys = np.arange(0, 40, dtype=np.int64)
    rows = rng.normal(0, 1, (40, DIM)).astype(np.float32)
    made = []
    for _ in range(2):
        steps = [0]  # this table's step count
        table = pass_cache.PassTable(  # each its own copy: the stores train the rows in place
            "t",
            rule,
            keys,
            rows.copy(),
            keys * 0,
            keys * 0,
            torch.device("cpu"),
            lambda s=steps: s[0],
        )
        if store == "torch":
            table.rows = TorchRows(rule, keys, rows.copy(), torch.device("cpu"))
        else:
            assert isinstance(table.rows, KernelRows)
        made.append((table, steps))
    (arrays, s1), (tensors, s2) = made
    lookup = np.array([3, 7, 11, 39], np.int64)
    grad = rng.normal(0, 1, (4, DIM)).astype(np.float32)
    for step in range(3):
        np.testing.assert_array_equal(tensors.pull_tensor(lookup).numpy(), arrays.pull(lookup))
        arrays.record(lookup, grad * (step + 1))
        tensors.record_tensor(lookup, torch.from_numpy(grad * (step + 1)))
        s1[0] += 1
        s2[0] += 1
    for a, b in zip(arrays.delta(), tensors.delta()):
        np.testing.assert_array_equal(a, b)
    slot = SparseBatch(torch.tensor([5, 6, 5]), torch.tensor([2, 1]), torch.tensor([0, 2, 3]))
    layout = _KEYED.get([slot], "t", "slot")
    assert layout.on(torch.device("cpu")) is layout
    moved = layout.on(torch.device("meta"))
    assert moved.inverse.device.type == "meta" and moved.starts.device.type == "meta"
    assert moved.keys is layout.keys and layout.on(torch.device("meta")) is moved
    assert layout.inverse.device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")
@pytest.mark.parametrize("cached", [False, True], ids=["per-step", "pass"])
def test_module_on_cuda_trains_as_on_cpu(cached: bool) -> None:
    """A model moved to CUDA: its DistributedEmbedding returns rows on the GPU (per step:
    copied from the pulled rows; in a CUDA pass: read from the pass's device table, no copy to
    the host) and the rows and state after training equal the CPU run's."""
    keys = np.arange(60, dtype=np.int64)
    out = {}
    for device in ("cpu", "cuda"):
        emb = DistributedEmbedding(
            f"pc_gpu_{int(cached)}",
            DIM,
            optimizer=Adagrad(0.2),
            initializer=Uniform(-0.5, 0.5),
            pooling="sum",
        )
        net = _Net(emb).to(device)
        net.fc.requires_grad_(False)
        assert emb.device.type == device
        batches = _batches(3)
        with cluster(1) as (_, client):
            client.create_table_from_config(emb.table_config())
            comm = SyncCommunicator(client, 1, lambda: None)
            comm.add_table(emb.table, DIM, 0.2)
            if cached:
                pass_cache.start([emb], batches, client, comm, device=device)
            with lookups_from(comm):
                for b in batches:
                    pooled = net(b)
                    assert pooled.device.type == device
                    loss = torch.nn.BCEWithLogitsLoss()(pooled, b["click"].float().to(device))
                    loss.backward()
                    comm.step()
            if cached:
                pass_cache.finish()
            out[device] = client.pull_sparse_with_state(emb.table, keys)
    for cpu, cuda in zip(out["cpu"], out["cuda"]):
        np.testing.assert_allclose(cuda, cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "rule",
    [
        SGD(0.3),
        Adagrad(0.2, initial_accumulator_value=0.1),
        Adam(0.01),
        SGD(1.0, weight_bounds=(-0.5, 0.5)),
    ],
)
def test_torch_rules_match_the_server_formulas(rule: Any) -> None:
    """The torch form of each built-in rule (what a CUDA pass runs), here on CPU tensors,
    against the server's numpy ``update`` over three steps."""
    from fleet.ps import pass_rules
    from ps_server.core.optimizers import RowsMeta

    rng = np.random.default_rng(5)
    w = rng.normal(0, 1, (50, DIM)).astype(np.float32)
    s = np.empty((50, rule.state_dim(DIM)), np.float32)
    rule.init_state(s)
    tw, ts = torch.from_numpy(w.copy()), torch.from_numpy(s.copy())
    meta = RowsMeta(count=np.ones(50, np.uint32), unseen_days=np.zeros(50, np.uint16))
    for _ in range(3):
        g = rng.normal(0, 1, (50, DIM)).astype(np.float32)
        rule.update(w, s, g, meta)
        pass_rules._TORCH_RULES[type(rule)](rule, tw, ts, torch.from_numpy(g))
        if rule.weight_bounds is not None:
            tw.clamp_(*rule.weight_bounds)
    np.testing.assert_allclose(tw.numpy(), w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ts.numpy(), s, rtol=1e-6, atol=1e-6)


def test_a_streamed_dataset_is_refused() -> None:
    from fleet.data.dataset import QueueDataset

    with pytest.raises(ConfigError, match="InMemoryDataset"):
        pass_keys.collect_keys(QueueDataset(), {"t": None})
