"""fleet.data's datasets in one process: Slot and init validation, the batch layout (dense
tensors, SparseBatch for nn.EmbeddingBag), InMemoryDataset's methods (load, preload, shuffles,
sizes, release), bad input raised with nothing lost or skipped and counted, QueueDataset's
batches and its flat memory on a file larger than its queue."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil
import pytest
import torch
from prometheus_client import REGISTRY

from collective.errors import ConfigError, DatasetFormatError, FleetNotImplementedError
from fleet.data import InMemoryDataset, QueueDataset, Slot, SparseBatch, columns, parser

SLOTS = [Slot("click", dense=True), Slot("ids"), Slot("dense", dtype="float32", dense=True, dim=2)]


def example(i: int) -> str:
    ids = " ".join(str(i * 100 + k) for k in range(i % 4))
    return f"1 {i % 2} {i % 4} {ids} 2 {i}.5 -{i}".replace("  ", " ")


def write(path: Path, lines) -> str:
    path.write_text("".join(example(i) + "\n" for i in lines))
    return str(path)


def make(cls=InMemoryDataset, files=(), **init):
    ds = cls()
    ds.init(**{"batch_size": 4, "thread_num": 2, "use_var": SLOTS, **init})
    ds.set_filelist(list(files))
    return ds


def examples(ds) -> list[tuple[int, tuple[int, ...], tuple[float, ...]]]:
    """(click, ids, dense) per example, in batch order."""
    out = []
    for b in ds:
        sb = b["ids"]
        v, o = sb.values.tolist(), sb.offsets.tolist()
        for k in range(b.batch_size):
            out.append(
                (int(b["click"][k, 0]), tuple(v[o[k] : o[k + 1]]), tuple(b["dense"][k].tolist()))
            )
    return out


def want(lines) -> list[tuple[int, tuple[int, ...], tuple[float, ...]]]:
    return [(i % 2, tuple(i * 100 + k for k in range(i % 4)), (i + 0.5, float(-i))) for i in lines]


@pytest.mark.timeout(30)
def test_slot_and_init_validation_name_the_field() -> None:
    for kwargs, key in [
        ({"name": ""}, "Slot.name"),
        ({"name": "a", "dtype": "float64"}, "Slot.dtype"),
        ({"name": "a", "dense": True, "dim": 0}, "Slot.dim"),
        ({"name": "a", "dim": 3}, "Slot.dim"),
        ({"name": "a", "dense": 1}, "Slot.dense"),
    ]:
        with pytest.raises(ConfigError) as info:
            Slot(**kwargs)
        assert info.value.key == key
    assert Slot("x", dtype="float32").dtype == "float32"
    ds = InMemoryDataset()
    for kwargs, key in [
        ({"batch_size": 0}, "batch_size"),
        ({"thread_num": 1.5}, "thread_num"),
        ({"use_var": [Slot("a"), Slot("a")]}, "use_var"),
        ({"use_var": ["a"]}, "use_var"),
        ({"on_error": "ignore"}, "on_error"),
        ({"pipe_command": ""}, "pipe_command"),
        ({"input_type": 2}, "input_type"),
        ({"fs_name": "namenode:9000"}, "fs_name"),
        ({"no_such_arg": 1}, "no_such_arg"),
    ]:
        with pytest.raises(ConfigError) as info:
            ds.init(**{"use_var": SLOTS, **kwargs})
        assert info.value.key == key
    with pytest.raises(FleetNotImplementedError, match="merge_size"):
        ds.init(use_var=SLOTS, merge_size=2)
    # Paddle's settings that do not apply here are accepted
    ds.init(
        use_var=SLOTS,
        input_type=1,
        data_feed_type="MultiSlotInMemoryDataFeed",
        queue_num=4,
        fleet_send_batch_size=1024,
        fleet_send_sleep_seconds=0,
        fea_eval=True,
        candidate_size=100,
        merge_size=-1,
        parse_ins_id=False,
        parse_content=False,
    )
    ds.update_settings(batch_size=9, thread_num=3)
    assert (ds.batch_size, ds.thread_num) == (9, 3)
    with pytest.raises(FleetNotImplementedError):
        ds.set_date("20240101")


@pytest.mark.timeout(60)
def test_batch_layout_embedding_bag_and_drop_last(tmp_path: Path) -> None:
    f = write(tmp_path / "a", range(10))
    ds = make(files=[f], batch_size=4)
    ds.load_into_memory()
    batches = list(ds)
    assert [b.batch_size for b in batches] == [4, 4, 2]
    b = batches[0]
    assert list(b) == ["click", "ids", "dense"]
    assert b["click"].dtype == torch.int64 and b["click"].shape == (4, 1)
    assert b["dense"].dtype == torch.float32 and b["dense"].shape == (4, 2)
    sb = b["ids"]
    assert isinstance(sb, SparseBatch) and sb.values.dtype == torch.int64
    assert sb.lengths.tolist() == [0, 1, 2, 3] and sb.offsets.tolist() == [0, 0, 1, 3, 6]
    assert sb.values.tolist() == [100, 200, 201, 300, 301, 302]
    bag = torch.nn.EmbeddingBag(400, 3, mode="sum")
    pooled = sb.pool(bag)
    assert pooled.shape == (4, 3) and torch.equal(pooled[0], torch.zeros(3))  # empty bag
    assert torch.allclose(pooled[2], bag.weight[200] + bag.weight[201])
    inp, offsets = sb.embedding_bag_inputs()
    assert torch.equal(bag(inp, offsets), pooled)
    moved = b.to("cpu")
    assert torch.equal(moved["ids"].values, sb.values) and moved.batch_size == 4
    b["dense"].add_(1000)  # a batch never aliases the dataset
    assert examples(ds) == want(range(10))
    ds.update_settings(drop_last=True)
    assert [x.batch_size for x in ds] == [4, 4]


@pytest.mark.timeout(60)
def test_in_memory_load_sizes_shuffles_and_release(tmp_path: Path) -> None:
    f1, f2 = write(tmp_path / "a", range(30)), write(tmp_path / "b", range(30, 50))
    ds = make(files=[f1], block_bytes=64)
    ds.load_into_memory()
    ds.set_filelist([f2])
    ds.load_into_memory()  # appends
    assert len(ds) == ds.get_memory_data_size() == ds.get_memory_data_size(fleet=True) == 50
    assert examples(ds) == want(range(50))
    payload = sum(8 + 8 * (i % 4) + 8 + 8 for i in range(50))  # click, ids, offset, 2 floats
    assert payload <= ds.nbytes <= payload + 8 * 60  # + one offset per chunk
    assert ds.get_shuffle_data_size() == 0
    ds.set_shuffle_seed(7)
    ds.local_shuffle()
    first = examples(ds)
    assert sorted(first) == sorted(want(range(50))) and first != want(range(50))
    assert ds.get_shuffle_data_size() == ds.get_shuffle_data_size(fleet=True) == 50
    ds.global_shuffle()  # no process group: a local shuffle
    assert sorted(examples(ds)) == sorted(want(range(50)))
    again = make(files=[f1, f2])
    again.load_into_memory()
    again.set_shuffle_seed(7)
    again.local_shuffle()
    assert examples(again) == first  # a seed makes shuffles reproducible
    ds.release_memory()
    assert len(ds) == 0 and list(ds) == [] and ds.nbytes == 0


@pytest.mark.timeout(60)
def test_slots_shuffle_permutes_only_the_named_slot(tmp_path: Path) -> None:
    ds = make(files=[write(tmp_path / "a", range(40))])
    ds.load_into_memory()
    ds.slots_shuffle(["ids"])
    got, ref = examples(ds), want(range(40))
    assert [(c, d) for c, _, d in got] == [(c, d) for c, _, d in ref]
    assert sorted(i for _, i, _ in got) == sorted(i for _, i, _ in ref)
    assert [i for _, i, _ in got] != [i for _, i, _ in ref]
    with pytest.raises(ConfigError, match="unknown slots"):
        ds.slots_shuffle(["nope"])


@pytest.mark.timeout(60)
def test_preload_and_wait(tmp_path: Path) -> None:
    ds = make(files=[write(tmp_path / "a", range(25))])
    with pytest.raises(ConfigError, match="no preload"):
        ds.wait_preload_done()
    ds.preload_into_memory(thread_num=3)
    with pytest.raises(ConfigError, match="wait_preload_done"):
        ds.load_into_memory()
    ds.wait_preload_done()
    assert examples(ds) == want(range(25))
    bad = tmp_path / "bad"
    bad.write_text("1 0 0 2 1.0\n")
    ds.set_filelist([str(bad)])
    ds.preload_into_memory()
    with pytest.raises(DatasetFormatError):
        ds.wait_preload_done()
    assert len(ds) == 25


@pytest.mark.timeout(60)
def test_bad_line_raises_and_keeps_what_was_loaded(tmp_path: Path) -> None:
    good = write(tmp_path / "good", range(20))
    bad = tmp_path / "bad"
    lines = [example(i) for i in range(50)]
    lines[36] = "1 1 2 7 -"  # line 37: '-' is no id
    bad.write_text("\n".join(lines) + "\n")
    ds = make(files=[good])
    ds.load_into_memory()
    ds.set_filelist([good, str(bad)])
    with pytest.raises(DatasetFormatError) as info:
        ds.load_into_memory()
    err = info.value
    assert (err.path, err.line, err.slot, err.text) == (str(bad), 37, "ids", "-")
    assert f"{bad}, line 37: not a number in slot 'ids'" in str(err)
    assert len(ds) == 20 and examples(ds) == want(range(20))  # the earlier load is intact
    for threads in (1, 3):  # the last parser thread failing still fails the load
        one = make(files=[str(bad)], thread_num=threads, block_bytes=64)
        with pytest.raises(DatasetFormatError, match="line 37"):
            one.load_into_memory()
        assert len(one) == 0
        with pytest.raises(DatasetFormatError, match="line 37"):
            examples(make(QueueDataset, files=[str(bad)], thread_num=threads))


@pytest.mark.timeout(60)
def test_skip_counts_logs_and_exports_skipped_lines(tmp_path: Path, caplog) -> None:
    bad = tmp_path / "bad"
    lines = [example(i) for i in range(30)]
    lines[3] = "1 0 1 99999999999999999999 2 1 1"  # beyond int64 and uint64
    lines[10] = "1 0 0 2 1.0 2.0 extra"
    lines[11] = "1 0"
    bad.write_text("\n".join(lines) + "\n")
    metric = ("fleet_data_skipped_lines_total", {"dataset": "inmemory"})
    before = REGISTRY.get_sample_value(*metric)
    ds = make(files=[str(bad)], on_error="skip")
    with caplog.at_level(logging.WARNING, logger="fleet.data"):
        ds.load_into_memory()
    assert len(ds) == 27 and ds.skipped_lines == 3
    assert examples(ds) == want([i for i in range(30) if i not in (3, 10, 11)])
    assert REGISTRY.get_sample_value(*metric) == before + 3
    assert "skipped 3 malformed lines" in caplog.text and f"{bad}, line 4" in caplog.text
    q = make(QueueDataset, files=[str(bad)], on_error="skip")
    assert len(examples(q)) == 27 and q.skipped_lines == 3


@pytest.mark.timeout(60)
def test_python_parser_and_numpy_gathers_give_the_same_dataset(tmp_path: Path, monkeypatch) -> None:
    files = [write(tmp_path / "a", range(60)), write(tmp_path / "b", range(60, 90))]
    ds = make(files=files, block_bytes=128)
    ds.load_into_memory()
    ds.set_shuffle_seed(3)
    ds.local_shuffle()
    ref = examples(ds)
    monkeypatch.setattr(parser, "ENABLED", False)
    monkeypatch.setattr(columns, "_c", None)
    ds2 = make(files=files, block_bytes=128)
    ds2.load_into_memory()
    ds2.set_shuffle_seed(3)
    ds2.local_shuffle()
    assert examples(ds2) == ref


@pytest.mark.timeout(60)
def test_queue_dataset_streams_every_example(tmp_path: Path) -> None:
    files = [write(tmp_path / f"p{k}", range(k * 25, k * 25 + 25)) for k in range(3)]
    q = make(QueueDataset, files=files, thread_num=1, block_bytes=64)
    assert examples(q) == want(range(75))  # one thread: the file order
    q.init(batch_size=4, thread_num=3, use_var=SLOTS, block_bytes=64, drop_last=True)
    got = examples(q)
    assert len(got) == 72 and set(got) <= set(want(range(75)))
    q.init(batch_size=4, thread_num=3, use_var=SLOTS, block_bytes=64)
    assert sorted(examples(q)) == sorted(want(range(75)))  # a second pass, any order
    it = iter(q)
    next(it)
    it.close()  # stopping early ends the threads
    with pytest.raises(FleetNotImplementedError, match="InMemoryDataset"):
        q.local_shuffle()


@pytest.mark.timeout(120)
def test_queue_dataset_memory_stays_flat_on_a_file_larger_than_its_queue(tmp_path: Path) -> None:
    slots = [
        Slot("click", dense=True),
        *(Slot(f"s{k}") for k in range(8)),
        Slot("dense", dtype="float32", dense=True, dim=8),
    ]
    row = (
        "1 1 "
        + " ".join(f"1 {1000000007 * (k + 1)}" for k in range(8))
        + " 8 "
        + " ".join(["0.123456"] * 8)
        + "\n"
    )
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        f.writelines(row * 5000 for _ in range(60))
    size = os.path.getsize(big)
    assert size > 40 << 20
    q = QueueDataset()
    q.init(batch_size=256, thread_num=2, use_var=slots, block_bytes=256 << 10, queue_blocks=2)
    q.set_filelist([str(big)])
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, count = base, 0
    for i, batch in enumerate(q):
        count += batch.batch_size
        if i % 20 == 0:
            peak = max(peak, proc.memory_info().rss)
    assert count == 300000
    # a few 256 KiB blocks in flight, not the file (an in-memory load would hold ~110 MB)
    assert peak - base < 24 << 20, f"RSS grew {(peak - base) >> 20} MiB on a {size >> 20} MiB file"
