"""SSD sparse tables (``storage="ssd"``): hot rows in memory, cold rows in RocksDB.

An SSD table and a memory table fed the same calls end with identical rows (values, optimizer
state, show counts, unseen days) with a cache far smaller than the key set; eviction under
concurrent calls; shrink, show decay and checkpoints over both tiers; every bad input."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("rocksdict")

from collective.errors import ConfigError
from ps_server import PSClient, PSServer
from ps_server.checkpoint import load, save
from ps_server.config import SparseStorage, SparseTableConfig, config_from_dict, config_to_dict
from ps_server.core import ssd_tier
from ps_server.core.entry import CountFilterEntry
from ps_server.core.factory import make_table
from ps_server.core.initializers import Constant, Uniform
from ps_server.core.optimizers import SGD, Adagrad
from ps_server.core.sparse_table import SparseTable
from ps_server.core.ssd_table import SsdSparseTable
from ps_server.errors import SsdTierError

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_cluster import start_server_process, stop_process

FIELDS = ("keys", "values", "state", "count", "unseen_days", "flags")


def _config(storage: str = "memory", **kw: Any) -> SparseTableConfig:
    base: dict[str, Any] = {
        "name": "emb",
        "dim": 8,
        "optimizer": Adagrad(lr=0.05),
        "initializer": Uniform(-0.01, 0.01),
        "num_shards": 8,
        "seed": 3,
    }
    base.update(kw)
    if storage == "ssd":
        base.setdefault("cache_rows", 200)
    base["storage"] = storage
    return SparseTableConfig(**base)


def _pair(root: Path, **kw: Any) -> tuple[SparseTable, SsdSparseTable]:
    mem = make_table(_config(**kw))
    ssd = make_table(_config("ssd", **kw), ssd_root=str(root))
    assert isinstance(mem, SparseTable) and isinstance(ssd, SsdSparseTable)
    return mem, ssd


def _rows(table: SparseTable) -> dict[str, np.ndarray]:
    """Every row of ``table`` (both tiers), sorted by key."""
    with table.lock:
        payloads = table.export_shards(delta=False)
    keys = np.concatenate([p.keys for p in payloads.values()])
    order = np.argsort(keys)
    return {f: np.concatenate([getattr(p, f) for p in payloads.values()])[order] for f in FIELDS}


def _assert_same_rows(a: SparseTable, b: SparseTable) -> None:
    ra, rb = _rows(a), _rows(b)
    for f in FIELDS:
        assert np.array_equal(ra[f], rb[f]), f
    assert a.num_rows == b.num_rows == ra["keys"].shape[0]
    assert a.num_pending == b.num_pending


def _drive(tables: list[SparseTable], steps: int, num_keys: int, seed: int = 0) -> None:
    """The same random pulls, pushes, GEO deltas (some with show counts and state deltas, as
    a pass cache sends) and end_days on every table; pulls must agree."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        keys = rng.integers(0, num_keys, 400).astype(np.int64)
        op = step % 4
        if op == 0 and step % 8 == 4:  # a pass: its pull (rows and state), then its push
            got = [t.pull_with_state(keys) for t in tables]
            for values, state in got[1:]:
                assert np.array_equal(got[0][0], values) and np.array_equal(got[0][1], state)
            d = rng.standard_normal((400, 8)).astype(np.float32) * 0.01
            shows = rng.integers(1, 5, 400)
            moved = rng.random((400, 8)).astype(np.float32)
            # an SSD table's pass pull creates no row (its push does): compare the rest
            stats = [t.add_delta(keys, d, shows, moved).to_dict() for t in tables]
            for s in stats:
                s.pop("created"), s.pop("evicted")
            assert all(s == stats[0] for s in stats), stats
        elif op == 0:
            outs = [t.pull(keys) for t in tables]
            for out in outs[1:]:
                assert np.array_equal(outs[0], out), step
        elif op == 3:
            d = rng.standard_normal((400, 8)).astype(np.float32) * 0.01
            shows = moved = None
            if step % 8 == 7:  # a pass cache's push: show counts and state deltas
                shows = rng.integers(0, 5, 400)
                moved = rng.random((400, 8)).astype(np.float32)
            stats = [t.add_delta(keys, d, shows, moved).to_dict() for t in tables]
            assert all(s == stats[0] for s in stats), stats
        else:
            g = rng.standard_normal((400, 8)).astype(np.float32)
            stats = [t.push(keys, g).to_dict() for t in tables]
            assert all(s == stats[0] for s in stats), stats
        if step % 25 == 24:
            for t in tables:
                t.end_day()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry", [None, CountFilterEntry(2)], ids=["all", "count-filter"])
def test_same_rows_as_memory_table_with_small_cache(tmp_path: Path, entry: Any) -> None:
    mem, ssd = _pair(tmp_path, entry=entry, show_decay_rate=0.8)
    _drive([mem, ssd], steps=100, num_keys=5000)
    stats = ssd.stats()
    assert stats["hot_rows"] <= 200 and stats["cold_rows"] > 3000
    assert stats["hot_rows"] + stats["cold_rows"] == stats["num_rows"] == mem.num_rows
    _assert_same_rows(mem, ssd)
    for key in ("rows_created", "pull_keys", "push_keys", "pushes_filtered", "pulls_unadmitted"):
        assert stats[key] == mem.stats()[key], key


@pytest.mark.timeout(30)
def test_initial_values_do_not_depend_on_the_tier_or_path(tmp_path: Path) -> None:
    mem, ssd = _pair(tmp_path)
    keys = np.arange(1000, dtype=np.int64)
    by_pull = ssd.pull(keys)  # created by pulls, most rows then evicted to disk
    assert ssd.stats()["cold_rows"] > 700
    assert np.array_equal(ssd.pull(keys[::-1]), by_pull[::-1])  # read back from disk
    zero = np.zeros((1000, 8), dtype=np.float32)
    mem.push(keys, zero)  # created by pushes: the same initial values
    assert np.array_equal(mem.pull(keys), by_pull)
    assert np.array_equal(by_pull, ssd.initial_values(keys))


@pytest.mark.timeout(30)
def test_pass_pull_reads_through_and_its_push_creates_the_rows(tmp_path: Path) -> None:
    """A pull with state (a pass cache's) reads hot rows, queued and RocksDB rows where they
    are and the initial values of keys without a row: nothing promoted, evicted or created.
    The pass's delta push then creates the rows, equal to a memory table's."""
    mem, ssd = _pair(tmp_path)
    old = np.arange(1000, dtype=np.int64)
    grads = np.ones((1000, 8), dtype=np.float32)
    for t in (mem, ssd):
        t.push(old, grads)
    ssd.flush()
    before = ssd.stats()
    assert before["cold_rows"] > 700 and before["num_rows"] == 1000
    keys = np.concatenate([old[::3], np.arange(5000, 6500, dtype=np.int64), old[:10]])
    values, state = ssd.pull_with_state(keys)
    ref_values, ref_state = mem.pull_with_state(keys)
    assert np.array_equal(values, ref_values) and np.array_equal(state, ref_state)
    after = ssd.stats()
    for key in ("num_rows", "hot_rows", "cold_rows", "rows_created", "tier_evictions"):
        assert after[key] == before[key], key
    assert after["cold_hits"] > before["cold_hits"]
    assert after["pull_keys"] == before["pull_keys"] + keys.shape[0]
    delta = np.full((keys.shape[0], 8), 0.5, dtype=np.float32)
    shows = np.ones(keys.shape[0], dtype=np.int64)
    for t in (mem, ssd):
        t.add_delta(keys, delta, shows, np.zeros_like(state))
    assert ssd.num_rows == mem.num_rows == 2500
    _assert_same_rows(mem, ssd)


@pytest.mark.timeout(60)
def test_shrink_and_show_decay_cover_both_tiers(tmp_path: Path) -> None:
    mem, ssd = _pair(tmp_path, show_decay_rate=0.5)
    rng = np.random.default_rng(1)
    for day in range(4):
        keys = np.arange(day * 1000, day * 1000 + 1500, dtype=np.int64)
        grads = rng.standard_normal((keys.shape[0], 8)).astype(np.float32)
        for t in (mem, ssd):
            t.push(np.concatenate([keys, keys[:300]]), np.concatenate([grads, grads[:300]]))
            t.end_day()
    _assert_same_rows(mem, ssd)
    assert mem.shrink(1) == ssd.shrink(1) > 0
    assert ssd.stats()["rows_shrunk"] == mem.stats()["rows_shrunk"]
    _assert_same_rows(mem, ssd)
    for t in (mem, ssd):
        t.end_day()
        t.end_day()
    assert mem.shrink(2) == ssd.shrink(2)
    _assert_same_rows(mem, ssd)
    assert ssd.stats()["cold_rows"] + ssd.stats()["hot_rows"] == mem.num_rows


@pytest.mark.timeout(30)
def test_stats_report_both_tiers(tmp_path: Path) -> None:
    _, ssd = _pair(tmp_path)
    keys = np.arange(3000, dtype=np.int64)
    ssd.pull(keys)
    ssd.flush()  # the evicted rows in RocksDB, not in the write-behind queue
    ssd.pull(keys[:100])
    s = ssd.stats()
    assert s["storage"] == "ssd" and s["cache_rows"] == 200
    assert s["num_rows"] == 3000 and s["hot_rows"] <= 200
    assert s["tier_evictions"] >= 2800 and s["cold_hits"] + s["hot_hits"] == 100
    assert s["hot_misses"] == 3000 + s["cold_hits"] and s["cold_hits"] > 0
    assert s["hot_hit_rate"] == s["hot_hits"] / 3100
    assert s["ssd_reads"] >= 1 and s["ssd_read_seconds"] > 0
    assert s["ssd_bytes"] > 0
    assert os.path.isdir(tmp_path / "emb" / "shards-00000")


@pytest.mark.timeout(60)
def test_eviction_under_concurrent_pulls_and_pushes(tmp_path: Path) -> None:
    kw = {"optimizer": SGD(lr=1.0), "initializer": Constant(0.0)}
    mem, ssd = _pair(tmp_path, **kw)
    rngs = [np.random.default_rng(s) for s in range(4)]
    batches = [[r.integers(0, 4000, 300).astype(np.int64) for _ in range(25)] for r in rngs]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for keys in batches[i]:
                ssd.pull(keys)
                ssd.push(keys, np.ones((keys.shape[0], 8), dtype=np.float32))
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not errors and not any(t.is_alive() for t in threads)
    for worker_batches in batches:  # integer sums: exact in any order
        for keys in worker_batches:
            mem.pull(keys)
            mem.push(keys, np.ones((keys.shape[0], 8), dtype=np.float32))
    assert ssd.stats()["tier_evictions"] > 0
    ra, rb = _rows(mem), _rows(ssd)
    for f in ("keys", "values", "count"):
        assert np.array_equal(ra[f], rb[f]), f


@pytest.mark.timeout(60)
def test_checkpoint_holds_both_tiers_and_loads_into_either_storage(tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    root.mkdir()
    mem, ssd = _pair(root)
    _drive([mem, ssd], steps=40, num_keys=3000)
    save(tmp_path / "ckpt", [ssd])
    into_mem = make_table(_config())
    load(tmp_path / "ckpt", [into_mem])
    _assert_same_rows(mem, into_mem)
    other = tmp_path / "ssd2"
    other.mkdir()
    into_ssd = make_table(_config("ssd", cache_rows=100), ssd_root=str(other))
    load(tmp_path / "ckpt", [into_ssd])
    assert into_ssd.stats()["hot_rows"] <= 100
    _assert_same_rows(mem, into_ssd)
    _drive([mem, into_ssd], steps=12, num_keys=3000, seed=5)  # training goes on identically
    _assert_same_rows(mem, into_ssd)


@pytest.mark.timeout(30)
def test_tier_files_are_scratch_emptied_at_creation(tmp_path: Path) -> None:
    _, ssd = _pair(tmp_path)
    ssd.pull(np.arange(2000, dtype=np.int64))
    ssd.close()
    again = make_table(_config("ssd"), ssd_root=str(tmp_path))
    assert again.num_rows == 0  # no row of the previous table is served
    again.pull(np.arange(10, dtype=np.int64))
    assert again.num_rows == 10


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("rows", [0, -5, None, 2.5, True])
def test_ssd_needs_positive_cache_rows(rows: Any) -> None:
    with pytest.raises(ConfigError, match="'emb'.*cache_rows") as err:
        _config("ssd", cache_rows=rows)
    assert err.value.key == "cache_rows"


@pytest.mark.timeout(30)
def test_config_refuses_cache_rows_on_memory_and_unknown_storage() -> None:
    with pytest.raises(ConfigError, match="cache_rows applies to storage='ssd' only"):
        _config(cache_rows=100)
    with pytest.raises(ConfigError, match="must be 'memory' or 'ssd', got 'disk'"):
        _config(storage="disk")
    cfg = _config("ssd", cache_rows=7)
    assert cfg.storage is SparseStorage.SSD
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert "storage" not in config_to_dict(_config())  # memory configs read as before


@pytest.mark.timeout(30)
def test_bad_ssd_directories_name_the_table_and_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config("ssd")
    with pytest.raises(SsdTierError, match="'emb'.*--ssd_root"):
        make_table(cfg)
    missing = tmp_path / "missing"
    with pytest.raises(SsdTierError, match=f"'emb'.*{missing}.*does not exist"):
        make_table(cfg, ssd_root=str(missing))
    # outside the root: the table's directory is a symlink out of it
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "emb").symlink_to(outside)
    with pytest.raises(SsdTierError, match="'emb'.*outside the SSD root"):
        make_table(cfg, ssd_root=str(root))
    # unwritable (os.access is patched: the tests may run as root)
    writable = tmp_path / "w"
    writable.mkdir()
    monkeypatch.setattr(ssd_tier.os, "access", lambda *a, **k: False)
    with pytest.raises(SsdTierError, match=f"'emb'.*{writable}.*not writable"):
        make_table(cfg, ssd_root=str(writable))


@pytest.mark.timeout(30)
def test_foreign_or_garbage_directories_are_refused_not_emptied(tmp_path: Path) -> None:
    import rocksdict

    cfg = _config("ssd")
    tier = tmp_path / "emb" / "shards-00000"
    rocksdict.Rdict(str(tier)).close()  # someone else's RocksDB
    with pytest.raises(SsdTierError, match="'emb'.*shards-00000.*foreign RocksDB"):
        make_table(cfg, ssd_root=str(tmp_path))
    assert (tier / "CURRENT").exists()  # left alone
    other = tmp_path / "o"
    (other / "emb" / "shards-00000").mkdir(parents=True)
    (other / "emb" / "shards-00000" / "notes.txt").write_text("keep me")
    with pytest.raises(SsdTierError, match="not a fleetrun SSD tier"):
        make_table(cfg, ssd_root=str(other))
    # a corrupt tier this server wrote before is scratch: emptied and rebuilt
    third = tmp_path / "t"
    third.mkdir()
    make_table(cfg, ssd_root=str(third)).close()
    db = third / "emb" / "shards-00000" / "db"
    for f in db.iterdir():
        if f.is_file():
            f.write_bytes(b"garbage")
    table = make_table(cfg, ssd_root=str(third))
    assert table.num_rows == 0 and table.pull(np.arange(3, dtype=np.int64)).shape == (3, 8)


@pytest.mark.timeout(30)
def test_missing_rocksdict_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssd_tier, "_rocksdict", lambda: None)
    with pytest.raises(SsdTierError, match=r'pip install "fleetrun\[ssd\]"'):
        make_table(_config("ssd"), ssd_root=str(tmp_path))


@pytest.mark.timeout(30)
def test_server_refuses_a_missing_ssd_root(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ssd_root"):
        PSServer(ssd_root=str(tmp_path / "nope"))


# -- end to end --------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_server_process_serves_an_ssd_table(tmp_path: Path) -> None:
    ssd_root = tmp_path / "ssd"
    ssd_root.mkdir()
    proc, endpoint = start_server_process(
        "--port", "0", "--ssd_root", str(ssd_root), "--checkpoint_root", str(tmp_path)
    )
    try:
        client = PSClient([endpoint], timeout_s=20)
        try:
            client.create_table(
                "emb",
                8,
                Adagrad(lr=0.05),
                Uniform(-0.01, 0.01),
                num_shards=8,
                seed=3,
                storage="ssd",
                cache_rows=50,
            )
            ref = make_table(_config())
            rng = np.random.default_rng(2)
            for _ in range(6):
                keys = rng.integers(0, 2000, 256).astype(np.int64)
                assert np.array_equal(client.pull_sparse("emb", keys), ref.pull(keys))
                grads = rng.standard_normal((256, 8)).astype(np.float32)
                client.push_sparse("emb", keys, grads)
                ref.push(keys, grads)
            keys = np.arange(2000, dtype=np.int64)
            assert np.array_equal(client.pull_sparse("emb", keys), ref.pull(keys))
            stats = [s for s in client.stats() if "tables" in s][0]["tables"]
            emb = stats["emb"] if isinstance(stats, dict) else stats[0]
            assert emb["cold_rows"] > 0 and emb["hot_rows"] <= 50
        finally:
            client.close()
    finally:
        stop_process(proc)
    assert (ssd_root / "emb" / "shards-00000" / ssd_tier.MARKER).exists()


@pytest.mark.timeout(30)
def test_a_tier_in_use_is_not_emptied_by_a_second_table(tmp_path: Path) -> None:
    first = make_table(_config("ssd", cache_rows=10), ssd_root=str(tmp_path))
    first.pull(np.arange(100, dtype=np.int64))
    with pytest.raises(SsdTierError, match="'emb'.*in use by another table"):
        make_table(_config("ssd", cache_rows=10), ssd_root=str(tmp_path))
    assert np.array_equal(
        first.pull(np.arange(100, dtype=np.int64)), first.initial_values(np.arange(100))
    )


@pytest.mark.timeout(90)
def test_restarted_server_serves_the_checkpoint_not_newer_tier_rows(tmp_path: Path) -> None:
    ssd_root = tmp_path / "ssd"
    ssd_root.mkdir()
    args = ("--port", "0", "--ssd_root", str(ssd_root), "--checkpoint_root", str(tmp_path))
    keys = np.arange(1500, dtype=np.int64)
    grads = np.ones((1500, 8), dtype=np.float32)
    proc, endpoint = start_server_process(*args)
    try:
        client = PSClient([endpoint], timeout_s=20)
        try:
            client.create_table("emb", 8, num_shards=8, storage="ssd", cache_rows=100)
            client.push_sparse("emb", keys, grads)
            client.save(str(tmp_path / "ckpt"))
            saved = client.pull_sparse("emb", keys)
            client.push_sparse("emb", keys, grads)  # after the checkpoint, mostly on disk
            assert not np.array_equal(client.pull_sparse("emb", keys), saved)
        finally:
            client.close()
    finally:
        stop_process(proc)  # killed: the tier files stay behind
    proc, endpoint = start_server_process(*args, "--load", str(tmp_path / "ckpt"))
    try:
        client = PSClient([endpoint], timeout_s=20)
        try:
            assert np.array_equal(client.pull_sparse("emb", keys), saved)
        finally:
            client.close()
    finally:
        stop_process(proc)


@pytest.mark.timeout(30)
def test_prometheus_reports_the_tiers(tmp_path: Path) -> None:
    from ps_server import telemetry
    from ps_server.rpc.service import ServerState

    _, ssd = _pair(tmp_path)
    ssd.pull(np.arange(1000, dtype=np.int64))
    ssd.pull(np.arange(10, dtype=np.int64))
    state = ServerState(tables={"emb": ssd})
    collector = telemetry.TableCollector()
    collector.add(state)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }
    keys = telemetry.SSD_KEYS
    cold_hits = samples[(keys, (("result", "cold_hit"), ("table", "emb")))]
    assert cold_hits + samples[(keys, (("result", "hot_hit"), ("table", "emb")))] == 10
    assert cold_hits > 0
    assert samples[(keys, (("result", "evicted"), ("table", "emb")))] >= 800
    assert samples[(keys, (("result", "hot_miss"), ("table", "emb")))] >= 1000
    assert samples[(telemetry.SSD_BYTES, (("table", "emb"),))] > 0
    assert samples[(telemetry.TABLE_ROWS, (("table", "emb"),))] == 1000
