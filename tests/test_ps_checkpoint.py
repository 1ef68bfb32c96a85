"""ps_server checkpoints: full and delta saves, N -> M server resharding, dense tables, and clear
errors for corrupted, truncated, incomplete or foreign-version checkpoints."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ps_server import (
    Adagrad,
    Adam,
    CountFilterEntry,
    DenseTable,
    DenseTableConfig,
    Normal,
    SparseTable,
    SparseTableConfig,
    block_shard,
    checkpoint,
    group_by_server,
)
from ps_server.core.row_store import SEEN
from ps_server.errors import CheckpointCorruptError, CheckpointError, CheckpointVersionError

I64 = np.iinfo(np.int64)
SPARSE = SparseTableConfig(
    "emb", 4, Adam(0.01), Normal(0.0, 0.1), entry=CountFilterEntry(2), num_shards=12, seed=3
)
DENSE = DenseTableConfig("dense", Adagrad(0.1, initial_accumulator_value=0.1), num_shards=6)
BLOCKS = {f"layer{i}.{p}": 3 + i for i in range(8) for p in ("weight", "bias")}


def servers(n: int) -> list[dict]:
    return [
        {"emb": SparseTable.for_server(SPARSE, s, n), "dense": DenseTable.for_server(DENSE, s, n)}
        for s in range(n)
    ]


def dense_owner(name: str, n: int) -> int:
    return block_shard(name, DENSE.num_shards) % n


def init_dense(group: list[dict]) -> None:
    for name, size in BLOCKS.items():
        group[dense_owner(name, len(group))]["dense"].init(
            name, np.linspace(-1, 1, size, dtype=np.float32)
        )


def train(group: list[dict], rng: np.random.Generator, pool: np.ndarray, steps: int) -> None:
    """Pull/push random batches (duplicates included) routed over the group, plus dense pushes."""
    n = len(group)
    for _ in range(steps):
        keys = pool[rng.integers(0, pool.size, 300)]
        grads = rng.standard_normal((keys.size, 4)).astype(np.float32)
        for s, idx in enumerate(group_by_server(keys, n, SPARSE.num_shards)):
            group[s]["emb"].pull(keys[idx])
            group[s]["emb"].push(keys[idx], grads[idx])
        for name, size in list(BLOCKS.items())[::3]:
            group[dense_owner(name, n)]["dense"].push(
                name, rng.standard_normal(size).astype(np.float32)
            )


def snapshot(group: list[dict]) -> dict:
    """Every row, pending key and dense block of a group of servers, keyed by key / name."""
    rows, pending, blocks = {}, {}, {}
    for srv in group:
        t = srv["emb"]
        st = t.store
        for i in st.live_rows():
            rows[int(st.keys[i])] = (
                st.cols["values"][i].tobytes(),
                st.cols["state"][i].tobytes(),
                int(st.cols["count"][i]),
                int(st.cols["unseen_days"][i]),
                bool(st.flags[i] & SEEN),
            )
        if t.pending is not None:
            p = t.pending
            for i in p.live_rows():
                pending[int(p.keys[i])] = (
                    int(p.cols["count"][i]),
                    int(p.cols["unseen_days"][i]),
                    bool(p.flags[i] & SEEN),
                )
        for name in srv["dense"].names():
            blocks[name] = (
                srv["dense"].pull(name).tobytes() + srv["dense"]._blocks[name].state.tobytes()
            )
    return {"rows": rows, "pending": pending, "blocks": blocks}


def save_all(group: list[dict], directory: Path, mode: str) -> None:
    for s, srv in enumerate(group):
        checkpoint.save(directory, srv, mode=mode, writer=f"server-{s}")


def load_into(n: int, *directories: Path) -> list[dict]:
    group = [checkpoint.create_tables(directories[0], s, n) for s in range(n)]
    for d in directories:
        for srv in group:
            checkpoint.load(d, srv)
    return group


@pytest.fixture
def trained() -> tuple[list[dict], np.random.Generator, np.ndarray]:
    rng = np.random.default_rng(0)
    pool = np.concatenate(
        [
            rng.integers(I64.min, I64.max, 1500, dtype=np.int64, endpoint=True),
            np.array([I64.min, I64.max, -1, 0], dtype=np.int64),
        ]
    )
    group = servers(2)
    init_dense(group)
    train(group, rng, pool, 6)
    for day in range(2):
        for srv in group:
            srv["emb"].end_day()
        train(group, rng, pool[: 400 - 200 * day], 2)
    return group, rng, pool


@pytest.mark.timeout(60)
def test_save_and_load_all(tmp_path: Path, trained) -> None:
    group, _, _ = trained
    want = snapshot(group)
    assert want["pending"] and want["rows"] and len(want["blocks"]) == len(BLOCKS)
    assert any(r[3] == 1 for r in want["rows"].values()) and any(
        r[4] for r in want["rows"].values()
    )
    save_all(group, tmp_path, "all")
    files = sorted(p.name for p in (tmp_path / "emb").iterdir())
    assert files == [f"shard-{s:05d}.bin" for s in range(12)]
    manifest = json.loads((tmp_path / "manifest.server-1.json").read_text())
    assert manifest["format_version"] == 1 and manifest["mode"] == "all"
    assert manifest["tables"]["emb"]["shards"] == list(range(1, 12, 2))
    assert manifest["tables"]["emb"]["config"]["optimizer"]["type"] == "adam"
    assert manifest["tables"]["emb"]["config"]["entry"] == {"type": "count_filter", "n": 2}
    info = checkpoint.read_checkpoint(tmp_path)
    assert info.tables["emb"].config == SPARSE and info.tables["dense"].config == DENSE
    restored = load_into(2, tmp_path)
    assert snapshot(restored) == want
    # loading "all" replaces what a table held
    checkpoint.load(tmp_path, group[0])
    assert snapshot(group) == want


@pytest.mark.timeout(60)
def test_delta_on_top_of_full(tmp_path: Path, trained) -> None:
    group, rng, pool = trained
    save_all(group, tmp_path / "full", "all")
    more = np.concatenate([pool, rng.integers(I64.min, I64.max, 500, dtype=np.int64)])
    train(group, rng, more, 3)
    for srv in group:
        srv["emb"].end_day()
        srv["emb"].end_day()
    train(group, rng, more[:200], 1)
    assert sum(srv["emb"].shrink(1) for srv in group) > 0
    train(group, rng, more[-300:], 2)
    want_1 = snapshot(group)
    save_all(group, tmp_path / "delta1", "delta")
    delta_rows = checkpoint.read_checkpoint(tmp_path / "delta1").tables["emb"].rows
    assert 0 < delta_rows < len(want_1["rows"])
    for srv in group:
        srv["emb"].end_day()
    train(group, rng, more[:50], 1)
    want_2 = snapshot(group)
    save_all(group, tmp_path / "delta2", "delta")
    assert snapshot(load_into(2, tmp_path / "full", tmp_path / "delta1")) == want_1
    assert (
        snapshot(load_into(2, tmp_path / "full", tmp_path / "delta1", tmp_path / "delta2"))
        == want_2
    )
    # and into another number of servers
    assert (
        snapshot(load_into(3, tmp_path / "full", tmp_path / "delta1", tmp_path / "delta2"))
        == want_2
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("n", "m"), [(2, 3), (3, 1)])
def test_reshard_n_to_m_servers(tmp_path: Path, n: int, m: int) -> None:
    rng = np.random.default_rng(n)
    pool = rng.integers(I64.min, I64.max, 1000, dtype=np.int64)
    group = servers(n)
    init_dense(group)
    train(group, rng, pool, 5)
    want = snapshot(group)
    save_all(group, tmp_path, "all")
    restored = load_into(m, tmp_path)
    assert snapshot(restored) == want
    for s, srv in enumerate(restored):
        assert srv["emb"].shards == tuple(range(s, SPARSE.num_shards, m))
    # training continues identically on both layouts
    train(group, np.random.default_rng(9), pool, 2)
    train(restored, np.random.default_rng(9), pool, 2)
    assert snapshot(restored) == snapshot(group)


@pytest.mark.timeout(60)
def test_corrupted_truncated_and_missing_files(tmp_path: Path, trained) -> None:
    group, _, _ = trained
    save_all(group, tmp_path, "all")
    target = servers(1)[0]
    target["emb"].pull(np.arange(5, dtype=np.int64))
    before = snapshot([target])
    shard = tmp_path / "emb" / "shard-00003.bin"
    good = shard.read_bytes()

    def broken(data: bytes, exc: type, text: str) -> None:
        shard.write_bytes(data)
        with pytest.raises(exc, match=text) as info:
            checkpoint.load(tmp_path, target)
        assert "shard-00003.bin" in str(info.value)
        assert snapshot([target]) == before  # files are verified before a table changes

    flipped = bytearray(good)
    flipped[200] ^= 0x01
    broken(bytes(flipped), CheckpointCorruptError, "payload checksum mismatch")
    broken(good[:-7], CheckpointCorruptError, "truncated")
    broken(good[:40], CheckpointCorruptError, "truncated")
    broken(b"NOTASHRD" + good[8:], CheckpointCorruptError, "bad magic")
    header_flip = bytearray(good)
    header_flip[24] ^= 0x01  # dim
    broken(bytes(header_flip), CheckpointCorruptError, "header checksum")
    v2 = bytearray(good)
    v2[8:12] = struct.pack("<I", 2)
    broken(bytes(v2), CheckpointVersionError, "version 2")
    shard.unlink()
    with pytest.raises(CheckpointCorruptError, match="cannot read"):
        checkpoint.load(tmp_path, target)
    shard.write_bytes(good)
    assert checkpoint.load(tmp_path, target)["emb"] == len(snapshot(group)["rows"])


@pytest.mark.timeout(60)
def test_manifest_errors(tmp_path: Path, trained) -> None:
    group, _, _ = trained
    with pytest.raises(CheckpointError, match="no manifest"):
        checkpoint.load(tmp_path, group[0])
    checkpoint.save(tmp_path, group[0], writer="server-0")  # server-1 never saved
    with pytest.raises(
        CheckpointError, match=r"table .dense. is incomplete: 3 of 6 shards missing \(\[1, 3, 5\]"
    ):
        checkpoint.load(tmp_path, servers(1)[0])
    checkpoint.save(tmp_path, group[1], writer="server-1")
    m = tmp_path / "manifest.server-1.json"
    data = json.loads(m.read_text())
    m.write_text(json.dumps({**data, "format_version": 7}))
    with pytest.raises(CheckpointVersionError, match="version 7"):
        checkpoint.read_checkpoint(tmp_path)
    m.write_text(json.dumps({**data, "mode": "delta"}))
    with pytest.raises(CheckpointError, match="disagree on the mode"):
        checkpoint.read_checkpoint(tmp_path)
    m.write_text(json.dumps(data))
    other = SparseTable(SparseTableConfig("emb", 8, Adam(0.01), Normal(0.0, 0.1), num_shards=12))
    with pytest.raises(CheckpointError, match=r"dim 4 \(checkpoint\) vs 8"):
        checkpoint.load(tmp_path, [other])
    with pytest.raises(CheckpointError, match="no table 'nope'"):
        checkpoint.load(tmp_path, [DenseTable(DenseTableConfig("nope", Adam(0.1)))])
    with pytest.raises(CheckpointError, match="mode must be"):
        checkpoint.save(tmp_path, group[0], mode="incremental")


@pytest.mark.timeout(30)
def test_pending_keys_admitted_under_a_lower_count_after_load(tmp_path: Path) -> None:
    cfg = SparseTableConfig("emb", 2, Adagrad(0.1), Normal(0, 1), entry=CountFilterEntry(5))
    t = SparseTable(cfg)
    key = np.array([77], dtype=np.int64)
    for _ in range(3):
        t.push(key, np.ones((1, 2), np.float32))
    assert (t.num_rows, t.num_pending) == (0, 1)
    checkpoint.save(tmp_path, [t])
    lower = SparseTable(
        SparseTableConfig("emb", 2, Adagrad(0.1), Normal(0, 1), entry=CountFilterEntry(2))
    )
    checkpoint.load(tmp_path, [lower])
    assert (lower.num_rows, lower.num_pending) == (0, 1)
    np.testing.assert_array_equal(lower.pull(key), t.pull(key))  # a pull admits: count 3 >= 2
    assert (lower.num_rows, lower.num_pending) == (1, 0)
    assert int(lower.store.cols["count"][lower.store.lookup(key)[0]]) == 3
