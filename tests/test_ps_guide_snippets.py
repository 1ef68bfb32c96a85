"""The parameter-server guide's whole scripts run as written: each ```python block marked
``<!-- guide-script: NAME -->`` in docs/ps/*.md is copied verbatim into a file and run as a
fleetrun job (1 server + 2 trainers) over slot files written by the CTR example's generator,
in a scratch directory that holds ``data/ctr_slots/part-*`` as the guide says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO, gen_slot_files, run_fleetrun

MARK = re.compile(r"<!-- guide-script: (\w+) -->\n```python\n(.*?)\n```", re.S)


def _scripts() -> dict[str, str]:
    found = {}
    for page in sorted((REPO / "docs" / "ps").glob("*.md")):
        for name, code in MARK.findall(page.read_text()):
            found[f"{page.stem}:{name}"] = code + "\n"
    return found


SCRIPTS = _scripts()


def test_the_guide_marks_its_scripts() -> None:
    assert "datasets:datasets" in SCRIPTS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_guide_script_runs_as_written(tmp_path: Path, name: str) -> None:
    gen_slot_files(tmp_path / "data" / "ctr_slots", 2, 4000)
    script = tmp_path / "train.py"
    script.write_text(SCRIPTS[name])
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "2",
        "--log_dir",
        str(tmp_path / "log"),
        str(script),
        cwd=tmp_path,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    log = (tmp_path / "log" / "workerlog.0").read_text()
    assert "[train] done:" in log, log[-3000:]
