"""Old module paths that keep importing after a module moved: ``import fleet.amp`` still works
and is ``fleet.meta_optimizers.amp`` itself (same object, so ``isinstance`` and monkeypatching
behave), with a :class:`DeprecationWarning` that names the new path.

One small import hook per package instead of a shim file per moved module::

    install_moved_modules("fleet", {"fleet.amp": "fleet.meta_optimizers.amp", ...})

called at the end of the package's ``__init__``. It is a meta path finder
that answers only for the old names it was given; the new module is imported on first use of
the old name (nothing is loaded eagerly). Shared by :mod:`fleet` and :mod:`ps_server`, which is
why it lives in the package both may import.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings
from collections.abc import Mapping
from types import ModuleType


class _MovedModuleLoader:
    """Returns the module at its new path as the module of the old one (an
    ``importlib.abc.Loader`` by protocol: importing ``importlib.abc`` costs ~5 ms of start-up)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"module {self.old} moved to {self.new}; import {self.new} instead (the old path "
            "will be removed in a later release)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the new module is already executed); the import system has just set
        ``__spec__`` to the old name's spec, so give the module its own back."""
        module.__spec__ = self._spec


class _MovedModuleFinder:
    """Finds the old names of moved modules (and nothing else); an
    ``importlib.abc.MetaPathFinder`` by protocol."""

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = dict(moved)

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = self.moved.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(fullname, new))


def install_moved_modules(package: str, moved: Mapping[str, str]) -> None:
    """Make every old module name in ``moved`` (old → new, full dotted names inside
    ``package``) import as its new module, with a DeprecationWarning. Idempotent per package."""
    for old, new in moved.items():
        if not (old.startswith(package + ".") and new.startswith(package + ".")):
            raise ValueError(f"moved module {old} -> {new}: both must be inside {package}")
    for finder in sys.meta_path:
        if isinstance(finder, _MovedModuleFinder) and set(moved) <= set(finder.moved):
            return
    sys.meta_path.insert(0, _MovedModuleFinder(moved))


__all__ = ["install_moved_modules"]
