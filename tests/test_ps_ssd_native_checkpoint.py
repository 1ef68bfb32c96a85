"""Checkpoints of SSD tables whose cold rows are a RocksDB checkpoint of the tier: hard links
where the filesystem allows (copies elsewhere), one cut across both tiers, loads that adopt the
files, and every reader that needs rows (memory tables, resharding, serving exports)."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rocksdict")

from ps_server import PSClient, PSServer
from ps_server.checkpoint import load, save
from ps_server.checkpoint.save_load import take_snapshot, write_snapshot
from ps_server.checkpoint.series import commit
from ps_server.checkpoint.serving import load_serving
from ps_server.core.factory import make_table
from ps_server.core.initializers import Uniform
from ps_server.core.optimizers import Adagrad
from ps_server.core.sparse_table import SparseTable
from ps_server.core.ssd_table import SsdSparseTable
from ps_server.core.table import ChangeLog
from ps_server.errors import CheckpointCorruptError, PSError, SsdTierError

sys.path.insert(0, str(Path(__file__).parent))
from test_ps_ssd_table import FIELDS, _assert_same_rows, _config, _drive, _rows


def _ssd(root: Path, cache_rows: int = 200, index: int = 0, servers: int = 1) -> SsdSparseTable:
    root.mkdir(parents=True, exist_ok=True)
    cfg = _config("ssd", cache_rows=cache_rows, show_decay_rate=0.9)
    table = make_table(cfg, index, servers, ssd_root=str(root))
    assert isinstance(table, SsdSparseTable)
    return table


def _mem(index: int = 0, servers: int = 1) -> SparseTable:
    table = make_table(_config(show_decay_rate=0.9), index, servers)
    assert isinstance(table, SparseTable)
    return table


def _manifest(directory: Path, writer: str = "server-0") -> dict:
    return json.loads((directory / f"manifest.{writer}.json").read_text())


def _union(tables: list[SparseTable]) -> dict[str, np.ndarray]:
    parts = [_rows(t) for t in tables]
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    return {f: np.concatenate([p[f] for p in parts])[order] for f in FIELDS}


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    for f in FIELDS:
        assert np.array_equal(a[f], b[f]), f


def _ssts(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.sst"))


@pytest.mark.timeout(120)
def test_save_links_the_tier_files_and_loads_back_every_row(tmp_path: Path) -> None:
    mem, ssd = _mem(), _ssd(tmp_path / "tier")
    _drive([mem, ssd], steps=40, num_keys=5000)
    for t in (mem, ssd):
        t.end_day()  # cold rows age from the day they were written
    ssd.flush()
    assert ssd.stats()["cold_rows"] > 3000
    tier_bytes = ssd.cold.disk_bytes
    save(tmp_path / "ckpt", [mem])
    save(tmp_path / "ssd", [ssd])

    (item,) = _manifest(tmp_path / "ssd")["tables"]["emb"]["cold"]
    assert item["format"] == "rocksdb-checkpoint" and item["dir"] == "emb/rocksdb-00000"
    assert item["copied"] == 0 and item["linked"] >= 3  # one filesystem: every file linked
    assert item["rows"] == ssd.stats()["cold_rows"]
    assert item["keyfilter"] == "emb/keyfilter-00000.npz"  # a load needs no key scan
    saved = tmp_path / "ssd" / item["dir"]
    live = {os.stat(p).st_ino for p in _ssts(Path(ssd.cold.path) / "db")}
    assert _ssts(saved) and all(os.stat(p).st_ino in live for p in _ssts(saved))
    assert all(os.stat(p).st_nlink >= 2 for p in _ssts(saved))
    own = sum(os.stat(p).st_size for p in saved.iterdir() if os.stat(p).st_ino not in live)
    assert own < 64 << 10 and tier_bytes > 20 << 10  # it adds the small files, not the rows
    assert not (Path(ssd.cold.path) / "checkpoints").exists() or not any(
        (Path(ssd.cold.path) / "checkpoints").iterdir()
    )  # the staged checkpoint is gone

    into = _ssd(tmp_path / "into", cache_rows=300)
    into.background = False
    assert load(tmp_path / "ssd", [into]) == {"emb": mem.num_rows}
    stats = into.stats()
    assert stats["ssd_writes"] == 0  # no row went through a write batch
    assert stats["filter_rebuilds"] == 0  # the saved key filter, not a key scan
    assert stats["cold_rows"] == item["rows"] + mem.num_rows - item["rows"] - stats["hot_rows"]
    linked = {os.stat(p).st_ino for p in _ssts(saved)}
    assert linked & {os.stat(p).st_ino for p in _ssts(Path(into.cold.path) / "db")}
    _assert_same_rows(mem, into)
    as_memory = _mem()  # a reader that needs rows: the RocksDB files opened read-only
    load(tmp_path / "ssd", [as_memory])
    _assert_same_rows(mem, as_memory)
    ref = _mem()
    load(tmp_path / "ckpt", [ref])
    _drive([ref, into, as_memory], steps=24, num_keys=6000, seed=5)  # and they train on alike
    _assert_same_rows(ref, into)
    _assert_same_rows(ref, as_memory)
    for t in (ssd, into):
        t.close()


@pytest.mark.timeout(120)
def test_a_save_during_pushes_is_one_cut_across_both_tiers(tmp_path: Path) -> None:
    ssd = _ssd(tmp_path / "tier")
    rng = np.random.default_rng(4)
    batches = [
        (
            rng.integers(0, 4000, 300).astype(np.int64),
            rng.standard_normal((300, 8)).astype(np.float32),
        )
        for _ in range(400)
    ]
    done: list[int] = []
    stop = threading.Event()
    cut_taken = threading.Event()

    def pushes() -> None:
        for i, (keys, grads) in enumerate(batches):
            if stop.is_set():
                return
            if i == 200:  # the cut falls within the first 200 pushes: some always follow it
                cut_taken.wait(60)
            with ssd.lock:  # the push and its record are one step for the save
                ssd.push(keys, grads)
                done.append(i)

    worker = threading.Thread(target=pushes)
    worker.start()
    try:
        while len(done) < 40:
            worker.join(0.01)
        with ssd.lock:  # the cut and its count together (the table's lock is reentrant)
            snap = take_snapshot([ssd], "all", ChangeLog.SAVE)
            at_cut = len(done)
        cut_taken.set()
        while worker.is_alive() and len(done) < at_cut + 30:
            worker.join(0.01)
    finally:
        cut_taken.set()
        stop.set()
        worker.join(60)
    assert 40 <= at_cut < len(done)  # pushes ran on after the cut
    write_snapshot(tmp_path / "ckpt", snap)
    ref = _mem()
    for keys, grads in batches[:at_cut]:
        ref.push(keys, grads)
    loaded = _mem()
    load(tmp_path / "ckpt", [loaded])
    _assert_same_rows(ref, loaded)
    ssd.close()


@pytest.mark.timeout(120)
def test_delta_saves_after_a_native_full_save(tmp_path: Path) -> None:
    mem, ssd = _mem(), _ssd(tmp_path / "tier")
    _drive([mem, ssd], steps=30, num_keys=5000)
    for t, d in ((mem, "mem"), (ssd, "ssd")):
        save(tmp_path / d / "0", [t])
    _drive([mem, ssd], steps=20, num_keys=6000, seed=2)
    for t in (mem, ssd):
        t.end_day()
    assert mem.shrink(2) == ssd.shrink(2)
    for t, d in ((mem, "mem"), (ssd, "ssd")):
        save(tmp_path / d / "1", [t], mode="delta")
    assert "cold" not in _manifest(tmp_path / "ssd" / "1")["tables"]["emb"]
    for into in (_mem(), _ssd(tmp_path / "into")):
        for step in ("0", "1"):
            load(tmp_path / "ssd" / step, [into])
        _assert_same_rows(mem, into)
        if isinstance(into, SsdSparseTable):
            into.close()
    ssd.close()


@pytest.mark.timeout(180)
def test_reshard_two_servers_native_checkpoint_into_three(tmp_path: Path) -> None:
    mem = _mem()
    _drive([mem], steps=40, num_keys=6000)
    save(tmp_path / "mem", [mem])
    servers = [_ssd(tmp_path / f"s{i}", cache_rows=150, index=i, servers=2) for i in range(2)]
    for i, t in enumerate(servers):
        load(tmp_path / "mem", [t])
        save(tmp_path / "two", [t], writer=f"server-{i}")
    cold = _manifest(tmp_path / "two", "server-1")["tables"]["emb"]["cold"]
    assert cold[0]["shards"] == list(servers[1].shards) and cold[0]["rows"] > 1000
    want = _rows(mem)
    as_memory = [_mem(i, 3) for i in range(3)]
    as_ssd = [_ssd(tmp_path / f"t{i}", cache_rows=150, index=i, servers=3) for i in range(3)]
    for t in as_memory + as_ssd:
        load(tmp_path / "two", [t])
    _assert_same(want, _union(as_memory))
    _assert_same(want, _union(as_ssd))
    same = [_ssd(tmp_path / f"u{i}", cache_rows=150, index=i, servers=2) for i in range(2)]
    for t in same:  # the same two servers: each adopts its files
        load(tmp_path / "two", [t])
        assert t.stats()["ssd_writes"] == 0
    _assert_same(want, _union(same))
    for t in servers + as_ssd + same:
        t.close()


@pytest.mark.timeout(120)
def test_serving_export_of_a_checkpoint_snapshot_and_of_a_loaded_table(tmp_path: Path) -> None:
    mem, ssd = _mem(), _ssd(tmp_path / "tier")
    _drive([mem, ssd], steps=30, num_keys=5000)
    save(tmp_path / "ckpt", [ssd])
    loaded = _ssd(tmp_path / "into")
    load(tmp_path / "ckpt", [loaded])
    for i, t in enumerate((ssd, loaded, mem)):
        # a checkpoint's snapshot (cold rows staged as a RocksDB checkpoint) written as an export
        snap = take_snapshot([t], "all", None)
        write_snapshot(tmp_path / f"export{i}", snap, kind="serving", min_show=1)
        commit(tmp_path / f"export{i}", step=1)
    served = [load_serving([tmp_path / f"export{i}"])[0]["emb"] for i in range(3)]
    keys = _rows(mem)["keys"]
    assert keys.shape[0] > 3000
    want = served[2].pull(keys)
    for t in served[:2]:
        assert np.array_equal(t.pull(keys), want)
    for t in (ssd, loaded):
        t.close()


@pytest.mark.timeout(120)
def test_copies_where_links_fail_and_the_copy_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mem, ssd = _mem(), _ssd(tmp_path / "tier")
    _drive([mem, ssd], steps=30, num_keys=5000)

    def no_links(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")  # EXDEV: another filesystem

    monkeypatch.setattr(os, "link", no_links)
    save(tmp_path / "ckpt", [ssd])
    (item,) = _manifest(tmp_path / "ckpt")["tables"]["emb"]["cold"]
    assert item["linked"] == 0 and item["copied"] >= 3
    saved = tmp_path / "ckpt" / item["dir"]
    assert all(os.stat(p).st_nlink == 1 for p in _ssts(saved))
    into = _ssd(tmp_path / "into")
    load(tmp_path / "ckpt", [into])
    _assert_same_rows(mem, into)
    for t in (ssd, into):
        t.close()


@pytest.mark.timeout(120)
def test_a_damaged_or_missing_sst_names_the_table_and_file(tmp_path: Path) -> None:
    mem, ssd = _mem(), _ssd(tmp_path / "tier")
    _drive([mem, ssd], steps=30, num_keys=5000)
    save(tmp_path / "ckpt", [ssd])
    sst = _ssts(tmp_path / "ckpt" / "emb" / "rocksdb-00000")[0]
    into = _ssd(tmp_path / "into")
    load(tmp_path / "ckpt", [into])
    before = _rows(into)
    # damage a copy: the file is a hard link to the live tier's
    raw = bytearray(sst.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    sst.unlink()
    sst.write_bytes(bytes(raw))
    for target in (into, _mem()):
        with pytest.raises(CheckpointCorruptError, match=rf"table 'emb'.*{sst.name}.*CRC-32"):
            load(tmp_path / "ckpt", [target])
    _assert_same(before, _rows(into))  # nothing changed
    sst.unlink()
    with pytest.raises(CheckpointCorruptError, match=rf"table 'emb'.*{sst}"):
        load(tmp_path / "ckpt", [into])
    _assert_same(before, _rows(into))
    _assert_same_rows(mem, ssd)  # the saving table is untouched by the damage
    for t in (ssd, into):
        t.close()


@pytest.mark.timeout(60)
def test_a_pending_save_of_a_cleared_table_fails_naming_it(tmp_path: Path) -> None:
    ssd = _ssd(tmp_path / "tier")
    _drive([ssd], steps=20, num_keys=4000)
    snap = take_snapshot([ssd], "all", None)
    ssd.clear()  # a full load into the table while its save is pending
    with pytest.raises(SsdTierError, match="table 'emb'.*cleared or closed while its checkpoint"):
        write_snapshot(tmp_path / "void", snap)
    ssd.close()


@pytest.mark.timeout(120)
def test_the_server_keeps_serving_when_an_sst_is_damaged(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    (tmp_path / "ssd").mkdir()
    server = PSServer(
        host="127.0.0.1", port=0, ssd_root=str(tmp_path / "ssd"), checkpoint_root=str(root)
    )
    port = server.start()
    client = PSClient([f"127.0.0.1:{port}"], timeout_s=30)
    try:
        for name, kw in (("cold", {"storage": "ssd", "cache_rows": 100}), ("warm", {})):
            client.create_table(
                name, 8, Adagrad(lr=0.05), Uniform(-0.01, 0.01), num_shards=4, seed=3, **kw
            )
        keys = np.arange(3000, dtype=np.int64)
        for name in ("cold", "warm"):
            client.push_sparse(name, keys, np.ones((3000, 8), np.float32))
        client.save(str(root / "c1"))
        before = {n: client.pull_sparse(n, keys) for n in ("cold", "warm")}
        sst = _ssts(root / "c1" / "cold" / "rocksdb-00000")[0]
        sst.unlink()
        with pytest.raises(PSError, match=rf"table 'cold'.*{sst.name}"):
            client.load(str(root / "c1"))
        for n in ("cold", "warm"):  # both tables still serve their rows
            assert np.array_equal(client.pull_sparse(n, keys), before[n])
    finally:
        client.close()
        server.stop()
