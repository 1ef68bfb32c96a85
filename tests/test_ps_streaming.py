"""Online day/pass training: ``fleet.train_days`` through
``examples/ctr/online.py`` in real fleetrun PS jobs (2 servers + 2 trainers, async) over 2 days x
2 passes of slot files.

Job A stops after 3 passes (day 0 complete with its base, day 1 pass 0 with its delta); job B,
started again on the same output directory, resumes after the donefile's last record and
finishes day 1. Then, from the files alone: each delta holds exactly the rows its pass touched;
``shrink(0)`` at the end of a day keeps exactly the rows of that day; base(day 0) + the deltas of
day 1 + end_day + shrink loaded into fresh tables equal base(day 1) row for row; the progressive
AUC of the first pass is the untrained model's. A malformed line is named by file and line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, gen_slot_files, run_fleetrun

from collective.errors import DatasetFormatError
from ps_server.checkpoint import create_tables, load, read_checkpoint
from ps_server.checkpoint.shard_file import read_shard

DAYS = ("20261120", "20261121")
FILES, LINES = 2, 2500  # per pass: 5000 examples
TABLE = "ctr_emb"
ONLINE = str(REPO / "examples" / "ctr" / "online.py")


def _gen(root: Path) -> None:
    gen_slot_files(root, FILES, LINES, "--days", ",".join(DAYS), "--passes", "2")


def _job(cwd: Path, name: str, *args: str) -> tuple[str, list[dict]]:
    out = cwd / f"{name}.jsonl"
    r = run_fleetrun(
        "--server_num",
        "2",
        "--worker_num",
        "2",
        "--log_dir",
        f"log-{name}",
        ONLINE,
        "--data_root",
        "data",
        "--output_dir",
        "model",
        "--shrink_unseen_days",
        "0",
        "--batch_size",
        "64",
        "--json",
        str(out),
        *args,
        cwd=cwd,
        timeout=150,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return r.stdout + r.stderr, lines


def _ids(root: Path, *folders: str) -> set[int]:
    """Every sparse id in the slot files of the given day/pass folders."""
    ids: set[int] = set()
    for folder in folders:
        for path in sorted((root / folder).glob("part-*")):
            for line in path.read_text().splitlines():
                tok = line.split()
                ids.update(int(tok[3 + 2 * i]) for i in range(26))  # "1 <label> 1 <id> 1 <id> ..."
    return ids


def _rows(directory: Path, table: str) -> dict[str, np.ndarray]:
    """The rows a save holds for ``table``, sorted by key (shard files read and verified)."""
    info = read_checkpoint(directory)
    parts = [
        read_shard(directory / table / f"shard-{s:05d}.bin", info.record(table, s))[1]
        for s in info.tables[table].shards
    ]
    keys = np.concatenate([p.keys for p in parts])
    order = np.argsort(keys)
    return {
        "keys": keys[order],
        **{
            f: np.concatenate([getattr(p, f) for p in parts])[order]
            for f in ("values", "state", "count", "unseen_days")
        },
    }


def _state_of(tables: dict) -> dict[str, dict[str, np.ndarray]]:
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, t in tables.items():
        parts = list(t.export_shards(False).values())
        if t.KIND == "dense":
            out[name] = {
                f"{b.name}.{f}": getattr(b, f)
                for p in parts
                for b in p.blocks
                for f in ("values", "state")
            }
            continue
        keys = np.concatenate([p.keys for p in parts])
        order = np.argsort(keys)
        out[name] = {
            "keys": keys[order],
            **{
                f: np.concatenate([getattr(p, f) for p in parts])[order]
                for f in ("values", "state", "count", "unseen_days")
            },
        }
    return out


@pytest.mark.timeout(330)
def test_day_pass_stream_deltas_bases_resume(tmp_path: Path) -> None:
    _gen(tmp_path / "data")
    out_a, a = _job(tmp_path, "a", "--max_passes", "3")
    assert [(r["day"], r["pass"]) for r in a] == [
        (DAYS[0], "00"),
        (DAYS[0], "01"),
        (DAYS[1], "00"),
    ], out_a
    out_b, b = _job(tmp_path, "b")
    assert [(r["day"], r["pass"]) for r in b] == [(DAYS[1], "01")], out_b  # nothing retrained
    assert (
        f"resumed after day {DAYS[1]} pass 00: from base model/{DAYS[0]}/base, 1 delta(s) replayed"
    ) in out_b, out_b[-3000:]

    model = tmp_path / "model"
    done = [line.split("\t") for line in (model / "donefile.txt").read_text().splitlines()]
    assert [(d, p, k) for d, p, _, k in done] == [
        (DAYS[0], "00", "delta"),
        (DAYS[0], "01", "delta"),
        (DAYS[0], "-1", "base"),
        (DAYS[1], "00", "delta"),
        (DAYS[1], "01", "delta"),
        (DAYS[1], "-1", "base"),
    ]

    # progressive validation runs before training: the first pass meets an untrained model
    assert abs(a[0]["progressive_auc"] - 0.5) < 0.08, a[0]
    for r in a + b:
        assert 0.0 < r["progressive_auc"] < 1.0 and 0.0 < r["train_auc"] < 1.0, r
        assert r["examples"] == FILES * LINES and r["train_examples_per_s"] > 0, r
    # after the resume the model is the trained one, not a fresh start
    assert b[0]["progressive_auc"] > a[0]["progressive_auc"] + 0.03, (a, b)

    data = tmp_path / "data"
    # a delta holds exactly the rows its pass touched
    for day, p in ((DAYS[0], "01"), (DAYS[1], "00"), (DAYS[1], "01")):
        delta = _rows(model / day / f"delta-{p}", TABLE)
        assert set(delta["keys"].tolist()) == _ids(data, f"{day}/{p}"), (day, p)
        assert read_checkpoint(model / day / f"delta-{p}").mode == "delta"
    # end_day + shrink(0): a day's base keeps exactly the rows pushed that day
    base0, base1 = _rows(model / DAYS[0] / "base", TABLE), _rows(model / DAYS[1] / "base", TABLE)
    day0, day1 = (
        _ids(data, f"{DAYS[0]}/00", f"{DAYS[0]}/01"),
        _ids(data, f"{DAYS[1]}/00", f"{DAYS[1]}/01"),
    )
    assert set(base0["keys"].tolist()) == day0
    assert set(base1["keys"].tolist()) == day1
    assert f"shrink removed {len(day0 - day1)} rows" in out_b, out_b[-3000:]
    assert len(day0 - day1) > 0

    # base(day 0) + deltas of day 1 (+ the day's end_day and shrink) == base(day 1)
    tables = create_tables(model / DAYS[0] / "base")
    load(model / DAYS[0] / "base", tables)
    for p in ("00", "01"):
        load(model / DAYS[1] / f"delta-{p}", tables)
    for t in tables.values():
        if t.KIND == "sparse":
            t.end_day()
            t.shrink(0)
    expect = create_tables(model / DAYS[1] / "base")
    load(model / DAYS[1] / "base", expect)
    got, want = _state_of(tables), _state_of(expect)
    assert sorted(got) == sorted(want)
    for name in want:
        assert sorted(got[name]) == sorted(want[name]), name
        for field, w in want[name].items():
            np.testing.assert_array_equal(got[name][field], w, err_msg=f"{name}.{field}")


@pytest.mark.timeout(60)
def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    """The online example's dataset over a pass with a broken line: the error names both."""
    from examples.ctr.online import make_dataset_factory, parse_args

    good = "1 0 " + " ".join(f"1 {i}" for i in range(26)) + " 13 " + " ".join(["0.5"] * 13)
    bad = "1 0 " + " ".join(f"1 {i}" for i in range(25)) + " 1 x7 13 " + " ".join(["0.5"] * 13)
    path = tmp_path / "part-00000"
    path.write_text(f"{good}\n{good}\n{bad}\n{good}\n")
    args = parse_args(["--data_root", str(tmp_path), "--output_dir", str(tmp_path / "m")])
    with pytest.raises(DatasetFormatError) as err:
        for _ in make_dataset_factory(args)([str(path)]):
            pass
    assert f"{path}, line 3" in str(err.value), str(err.value)


@pytest.mark.timeout(60)
def test_donefile_and_config_errors(tmp_path: Path) -> None:
    """A malformed donefile line and bad settings are named."""
    from collective.errors import ConfigError, FleetError
    from fleet.streaming import StreamingConfig, list_passes, read_donefile

    (tmp_path / "donefile.txt").write_text("20261120\t00\tmodel/20261120/delta-00\tdelta\nbroken\n")
    with pytest.raises(FleetError, match=r"donefile.txt:2"):
        read_donefile(str(tmp_path))
    with pytest.raises(ConfigError, match="shrink_unseen_days"):
        StreamingConfig(data_root="d", output_dir="m", shrink_unseen_days=-1)
    with pytest.raises(ConfigError, match="data_root"):
        list_passes(StreamingConfig(data_root=os.path.join(str(tmp_path), "nope"), output_dir="m"))


@pytest.mark.timeout(60)
def test_end_day_decays_show_counts_and_deltas_replay_it(tmp_path: Path) -> None:
    """SparseTableConfig.show_decay_rate (Paddle's show_click_decay_rate): every end_day scales
    the show counts (rounded down); a delta saved after it reloads to the same counts."""
    from ps_server import SGD, Constant, SparseTableConfig
    from ps_server.checkpoint import save
    from ps_server.core.factory import make_table

    config = SparseTableConfig(
        "t", 2, optimizer=SGD(0.1), initializer=Constant(0.0), num_shards=4, show_decay_rate=0.5
    )
    table = make_table(config)
    keys = np.arange(1, 9, dtype=np.int64)
    for _ in range(4):
        table.push(keys, np.ones((8, 2), np.float32))
    table.push(keys[:2], np.ones((2, 2), np.float32))  # keys 1, 2 shown 5 times
    save(tmp_path / "base", [table], "all")
    table.end_day()
    table.push(keys[:1], np.ones((1, 2), np.float32))  # key 1: floor(5 * 0.5) + 1
    save(tmp_path / "delta", [table], "delta")
    got = {
        int(k): int(c) for p in table.export_shards(False).values() for k, c in zip(p.keys, p.count)
    }
    assert got == {1: 3, 2: 2, **{k: 2 for k in range(3, 9)}}, got
    copy = create_tables(tmp_path / "base")
    load(tmp_path / "base", copy)
    load(tmp_path / "delta", copy)
    again = {
        int(k): int(c)
        for p in copy["t"].export_shards(False).values()
        for k, c in zip(p.keys, p.count)
    }
    assert again == got
    with pytest.raises(Exception, match="show_decay_rate"):
        SparseTableConfig("t", 2, optimizer=SGD(0.1), initializer=Constant(0.0), show_decay_rate=0)
