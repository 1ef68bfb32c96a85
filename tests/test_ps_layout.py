"""ps_server's rooms: the module paths from before the subpackages still import (the same module,
with a DeprecationWarning naming the new path), and ``import ps_server`` stays free of gRPC.

Which room may import which is import-linter's (the ps_server contracts in pyproject.toml).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_old_module_paths_import_as_the_new_modules_with_a_warning() -> None:
    code = (
        "import importlib, json, warnings, ps_server\n"
        "report = {}\n"
        "for old, new in ps_server.MOVED_MODULES.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        mod = importlib.import_module(old)\n"
        "    report[old] = [new, mod is importlib.import_module(new), mod.__name__ == new,\n"
        "                   [str(w.message) for w in caught if w.category is DeprecationWarning]]\n"
        "print(json.dumps(report))\n"
    )
    report = json.loads(_run(code))
    assert "ps_server.sparse_table" in report and "ps_server.proto.ps_pb2_grpc" in report
    for old, (new, same, named, warned) in report.items():
        assert same and named, old
        assert warned and f"moved to {new};" in warned[0], (old, warned)


def test_import_ps_server_stays_light_and_old_names_resolve() -> None:
    """``import ps_server`` loads no gRPC and warns nothing; ``ps_server.checkpoint`` (a module
    before, the package now) keeps the old module's names; ``from old import name`` and attribute
    access to an old module on the package (``ps_server.routing``) reach the new modules."""
    out = _run(
        "import sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "import ps_server\n"
        "from ps_server.checkpoint import create_tables, load, read_checkpoint, save, shard_path\n"
        "assert 'grpc' not in sys.modules, 'import ps_server loaded grpc'\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from ps_server.sparse_table import SparseTable\n"
        "from ps_server.status import PSNotFoundError\n"
        "from ps_server.shard_file import SparseShardData\n"
        "from ps_server.core.sparse_table import SparseTable as New\n"
        "assert SparseTable is New and ps_server.routing.shard_of is ps_server.shard_of\n"
        "print('ok')\n"
    )
    assert out.strip() == "ok"
