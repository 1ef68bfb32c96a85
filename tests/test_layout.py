"""The house's shape: no import cycle (imports inside functions counted), the facade imported by
nothing inside fleet, the launcher's start free of torch, and the module paths from before the
subpackages still importing (same module, with a DeprecationWarning).

The layer contracts themselves are import-linter's (pyproject.toml), run by scripts/test.sh.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fleet", "ps_server", "launcher", "collective")
HEAVY = ("torch", "numpy", "grpc", "ray", "kubernetes")


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.timeout(120)
def test_no_import_cycle_counting_function_local_imports() -> None:
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    modules = sorted(graph.modules)
    edges = {
        m: {
            t for t in graph.find_modules_directly_imported_by(m) if not _only_compiled(graph, m, t)
        }
        for m in modules
    }
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in edges:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    assert not cycles, f"import cycles: {cycles}"


def _import_at(module: str, line: int) -> ast.stmt:
    """The import statement of ``module`` that starts on ``line`` (parsed from the whole file:
    grimp gives only the first line of a parenthesised multi-line import)."""
    path = ROOT.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom) and node.lineno == line:
            return node
    raise AssertionError(f"no import statement at {path}:{line}")


def _only_compiled(graph: object, importer: str, imported: str) -> bool:
    """True when every import of package ``imported`` by ``importer`` is ``from imported import
    X`` of a compiled extension X (grimp sees those as imports of the package itself; an
    extension runs no Python import, so it closes no cycle)."""
    directory = ROOT.joinpath(*imported.split("."))
    if not (directory / "__init__.py").exists():
        return False
    details = graph.get_import_details(importer=importer, imported=imported)  # type: ignore[attr-defined]
    for detail in details:
        node = _import_at(importer, int(detail["line_number"]))
        if not isinstance(node, ast.ImportFrom):
            return False
        for alias in node.names:
            if not any(p.suffix != ".py" for p in directory.glob(alias.name + ".*")):
                return False
    return bool(details)


def test_nothing_inside_fleet_imports_the_facade() -> None:
    offenders = []
    for path in (ROOT / "fleet").rglob("*.py"):
        if path == ROOT / "fleet" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "fleet" and node.level == 0:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Import) and any(a.name == "fleet" for a in node.names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"modules inside fleet importing the facade: {offenders}"


@pytest.mark.timeout(60)
def test_launcher_start_and_strategy_load_no_heavy_module() -> None:
    code = (
        "import sys, json, launcher.cli, fleet\n"
        "s = fleet.DistributedStrategy(); s.gradient_merge = True\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    assert json.loads(_run(code)) == []


# torch modules that cost seconds at import (FSDP, DTensor and sympy behind them): a fleet job pays
# them only when it uses a feature that needs them (sharding stage 3, TP, localsgd, checkpoints).
SLOW_TORCH = (
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.optim",
    "torch.distributed.checkpoint",
    "sympy",
)


@pytest.mark.timeout(120)
def test_plain_data_parallel_entry_points_load_no_slow_torch_module() -> None:
    code = (
        "import sys, json, fleet\n"
        "from fleet.parallelize import model, optimizer\n"
        "from fleet.meta_optimizers import comm_hooks, localsgd, dgc\n"
        f"print(json.dumps([m for m in {SLOW_TORCH!r} if m in sys.modules]))\n"
    )
    assert json.loads(_run(code)) == []


@pytest.mark.timeout(60)
def test_every_scheduler_behind_one_interface_loads_no_heavy_module() -> None:
    code = (
        "import sys, json\n"
        "from launcher.schedulers import SCHEDULERS, get_scheduler\n"
        "from launcher.schedulers.base import Scheduler\n"
        "got = {k: [isinstance(s := get_scheduler(k), Scheduler), str(s.kind)] for k in SCHEDULERS}\n"
        f"print(json.dumps([got, [m for m in {HEAVY!r} if m in sys.modules]]))\n"
    )
    got, heavy = json.loads(_run(code))
    assert got == {k: [True, k] for k in ("local", "ray", "k8s")}
    assert heavy == []


@pytest.mark.timeout(60)
def test_fleetrun_help_loads_no_heavy_module() -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "launcher", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    loaded = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


@pytest.mark.timeout(120)
def test_moved_fleet_modules_still_import_as_the_same_module() -> None:
    code = (
        "import importlib, json, warnings, fleet\n"
        "report = {}\n"
        "for old, new in fleet.MOVED_MODULES.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        mod = importlib.import_module(old)\n"
        "    report[old] = [mod is importlib.import_module(new), mod.__name__ == new,\n"
        "                   [str(w.message) for w in caught if w.category is DeprecationWarning]]\n"
        "print(json.dumps(report))\n"
    )
    report = json.loads(_run(code))
    assert report, "fleet.MOVED_MODULES is empty"
    for old, (same, named, warned) in report.items():
        assert same and named, old
        assert warned and "moved to" in warned[0], (old, warned)
    # `from old import name` works too, and attribute access on the facade never warns.
    _run(
        "import warnings\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from fleet.topology import HybridCommunicateGroup, build_topology\n"
        "from fleet.amp import GradScaler\n"
        "warnings.simplefilter('error')\n"
        "import fleet\n"
        "fleet.sharding, fleet.util.get_file_shard, fleet.utils.recompute, fleet.role_maker\n"
    )
