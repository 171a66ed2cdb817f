"""Which modules of a backend import more of vmm_core than its contract.

A backend that imports core internals (``vmm_core.memory.shim``, ``vmm_core.backend``)
breaks when core moves them; :mod:`vmm_core.plugin` and :mod:`vmm_core.errors` are the
names kept stable for backends.  The check reads the source (no import runs), so it also
covers modules that only import their framework when called.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CONTRACT_MODULES", "imports_outside_contract"]

#: the only modules of vmm_core a backend imports
CONTRACT_MODULES = frozenset({"vmm_core.plugin", "vmm_core.errors"})

_IMPORTERS = {"import_module", "__import__"}


def imports_outside_contract(paths: Iterable[str | Path]) -> list[str]:
    """``"file:line: what"`` for every import of vmm_core, in the Python files under
    ``paths`` (files or folders), that is not of :data:`CONTRACT_MODULES`: ``import
    vmm_core``, ``from vmm_core import X``, any other submodule, and
    ``importlib.import_module("vmm_core...")`` with a literal name."""
    found = []
    for path in _python_files(paths):
        tree = ast.parse(path.read_text(), filename=str(path))
        lines = sorted((node.lineno, name) for node in ast.walk(tree)
                       for name in _core_modules(node) if name not in CONTRACT_MODULES)
        found.extend(f"{path}:{line}: {name}" for line, name in lines)
    return found


def _python_files(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for path in map(Path, paths):
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def _core_modules(node: ast.AST) -> list[str]:
    """The vmm_core modules ``node`` imports (``from vmm_core import plugin`` imports
    ``vmm_core.plugin``; ``from vmm_core import Probe`` imports ``vmm_core``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module == "vmm_core":
            names = [f"vmm_core.{a.name}" if f"vmm_core.{a.name}" in CONTRACT_MODULES
                     else "vmm_core" for a in node.names]
        else:
            names = [node.module]
    elif isinstance(node, ast.Call) and _called_name(node.func) in _IMPORTERS \
            and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        names = [node.args[0].value]
    else:
        return []
    return [n for n in names if n == "vmm_core" or n.startswith("vmm_core.")]


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None
