"""InMemoryDataset.global_shuffle in a real 2-trainer fleetrun job (CPU, gloo): every trainer
loads its file shard (unequal on purpose), the shuffle deals the examples out at random, the union
is exactly the input, each share is within 10 % of equal, and the sizes summed over trainers
agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SCRIPTS, run_fleetrun

SCRIPT = SCRIPTS / "data_global_shuffle.py"


def write_files(root: Path, sizes: list[int]) -> list[str]:
    files, uid = [], 0
    for k, n in enumerate(sizes):
        lines = []
        for _ in range(n):
            ids = " ".join(str(uid * 10 + j) for j in range(uid % 4))
            lines.append(f"1 {uid} {uid % 4} {ids} 2 {uid} -{uid}".replace("  ", " "))
            uid += 1
        path = root / f"part-{k}"
        path.write_text("\n".join(lines) + "\n")
        files.append(str(path))
    return files


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "sizes,loaded",
    [
        ([700, 500, 900, 300, 600], [2100, 900]),  # shards of unequal size
        ([700, 500, 900, 0, 0], [2100, 0]),  # trainer 1 loads nothing, still takes part
    ],
)
def test_global_shuffle_over_two_trainers(
    tmp_path: Path, sizes: list[int], loaded: list[int]
) -> None:
    files = write_files(tmp_path, sizes)
    out = tmp_path / "out"
    r = run_fleetrun(
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(tmp_path / "log"),
        str(SCRIPT),
        "--files",
        ",".join(files),
        "--out",
        str(out),
        timeout=170,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    recs = [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]
    total = sum(sizes)
    assert [rec["loaded"] for rec in recs] == loaded
    for rec in recs:
        assert rec["world"] == 2 and rec["consistent"] and rec["moved"]
        assert rec["loaded_total"] == rec["memory_total"] == rec["shuffle_total"] == total
        assert rec["shuffle_local"] == rec["held"] == len(rec["uids"])
        assert abs(rec["held"] - total / 2) <= 0.1 * total / 2, rec["held"]
    union = recs[0]["uids"] + recs[1]["uids"]
    assert sorted(union) == list(range(total))  # every example once, none lost or doubled
    # a random order, not the file order
    assert recs[0]["uids"] != sorted(recs[0]["uids"])
