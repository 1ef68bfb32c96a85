"""``cache_bytes`` and ``max_capacity`` of SSD tables: the memory tier sized in bytes, and a
row limit that counts both tiers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("rocksdict")

from collective.errors import ConfigError
from ps_server.checkpoint import load, save
from ps_server.config import config_from_dict, config_to_dict
from ps_server.core import ssd_capacity
from ps_server.core.factory import make_table
from ps_server.core.ssd_table import SsdSparseTable
from ps_server.errors import TableCapacityError

sys.path.insert(0, str(Path(__file__).parent))
from test_ps_ssd_table import _assert_same_rows, _config, _rows


@pytest.mark.timeout(30)
def test_cache_bytes_sizes_the_memory_tier(tmp_path: Path) -> None:
    cfg = _config("ssd", cache_rows=None, cache_bytes=100_000)
    assert config_from_dict(config_to_dict(cfg)) == cfg
    table = make_table(cfg, ssd_root=str(tmp_path))
    assert isinstance(table, SsdSparseTable)
    row = table.store.row_bytes  # dim 8 + Adagrad: 8 + 1 + 32 + 32 + 4 + 2 + 8
    assert row == 87 and table.cache_rows == 100_000 // row
    table.pull(np.arange(5000, dtype=np.int64))
    s = table.stats()
    assert s["cache_rows"] == 100_000 // row and s["hot_rows"] <= 100_000 // row
    assert s["num_rows"] == 5000
    table.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kw", "key", "fragment"),
    [
        ({"cache_rows": 10, "cache_bytes": 1000}, "cache_bytes", "not both"),
        ({"cache_rows": None, "cache_bytes": 0}, "cache_bytes", "cache_bytes=0"),
        ({"cache_rows": None, "cache_bytes": -4}, "cache_bytes", "cache_bytes=-4"),
        ({"cache_rows": None, "cache_bytes": True}, "cache_bytes", "cache_bytes=True"),
        ({"cache_rows": None, "cache_bytes": 1.5e6}, "cache_bytes", "cache_bytes=1500000.0"),
    ],
)
def test_bad_cache_bytes_are_refused_naming_the_field(
    kw: dict[str, Any], key: str, fragment: str
) -> None:
    with pytest.raises(ConfigError, match=f"'emb'.*{fragment}") as err:
        _config("ssd", **kw)
    assert err.value.key == key


@pytest.mark.timeout(30)
def test_cache_bytes_on_memory_tables_and_below_one_row(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cache_bytes applies to storage='ssd' only") as err:
        _config(cache_bytes=10_000)
    assert err.value.key == "cache_bytes"
    with pytest.raises(ConfigError, match="cache_bytes=50 holds no row of 87 bytes") as err:
        make_table(_config("ssd", cache_rows=None, cache_bytes=50), ssd_root=str(tmp_path))
    assert err.value.key == "cache_bytes"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slack", [0.0, 0.05])
def test_max_capacity_counts_both_tiers(
    tmp_path: Path, slack: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ssd_capacity, "CAPACITY_SLACK", slack)
    mem = make_table(_config(max_capacity=1000))
    ssd = make_table(_config("ssd", cache_rows=150, max_capacity=1000), ssd_root=str(tmp_path))
    for day in range(10):  # 300 new keys a day; the oldest days' rows must go
        keys = np.arange(300 * day, 300 * day + 300, dtype=np.int64)
        grads = np.full((300, 8), 0.1, dtype=np.float32)
        for t in (mem, ssd):
            t.pull(keys)  # creates the rows, deleting old ones past max_capacity
            t.push(keys, grads)
            t.end_day()
        assert ssd.num_rows <= 1000 and ssd.stats()["cold_rows"] > 0
    assert mem.num_rows == 1000
    kept_mem, kept_ssd = _rows(mem), _rows(ssd)
    # the SSD table kept the newest rows, a few fewer with the slack; where both kept a row it is
    # the same row
    assert 1000 - int(slack * 1000) - 300 <= ssd.num_rows <= 1000
    assert kept_ssd["keys"].min() >= 3000 - 1000 - 300
    both, im, iss = np.intersect1d(kept_mem["keys"], kept_ssd["keys"], return_indices=True)
    assert both.shape[0] >= ssd.num_rows - 300
    for f in ("values", "state", "count", "unseen_days"):
        assert np.array_equal(kept_mem[f][im], kept_ssd[f][iss]), f
    assert ssd.stats()["rows_evicted"] == 3000 - ssd.num_rows
    if slack == 0.0:
        assert ssd.num_rows == 1000 and ssd.stats()["rows_evicted"] == mem.stats()["rows_evicted"]
    with pytest.raises(TableCapacityError, match="max_capacity is 1000"):
        ssd.pull(np.arange(10**6, 10**6 + 1001, dtype=np.int64))
    ssd.close()


@pytest.mark.timeout(60)
def test_rows_deleted_for_capacity_are_in_the_next_delta(tmp_path: Path) -> None:
    (tmp_path / "tier").mkdir()
    ssd = make_table(
        _config("ssd", cache_rows=150, max_capacity=1000), ssd_root=str(tmp_path / "tier")
    )
    grads = np.full((300, 8), 0.1, dtype=np.float32)
    for day in range(10):
        keys = np.arange(300 * day, 300 * day + 300, dtype=np.int64)
        ssd.pull(keys)
        ssd.push(keys, grads)
        ssd.end_day()
        if day == 3:
            save(tmp_path / "base", [ssd])
    save(tmp_path / "delta", [ssd], mode="delta")
    into = make_table(_config())
    load(tmp_path / "base", [into])
    load(tmp_path / "delta", [into])
    assert ssd.stats()["rows_evicted"] > 2000
    _assert_same_rows(ssd, into)
    ssd.close()
