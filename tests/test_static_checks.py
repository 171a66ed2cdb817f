"""Lint (ruff: errors, warnings, import order), the type check of the public API (mypy)
and the house rules a reader of the source can check, as part of the test command, so CI
runs them with every test run.

ruff and mypy are pinned in the ``test`` extra; their configuration is in pyproject.toml.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    pytest.importorskip(tool, reason=f"{tool} is not installed (pip install -e '.[test]')")
    cmd = [sys.executable, "-m", tool, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    proc = _run("ruff", "check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_checks_the_public_api():
    proc = _run("mypy")
    assert proc.returncode == 0, proc.stdout + proc.stderr


#: the library: what users import.  bench/ (the benchmark, imported as vmm_bench) and
#: tests/ are not library modules: a scenario or a test file reads as one story, and
#: no user code builds on them.
LIBRARY = ("vmm_core", "backends")
MAX_MODULE_LINES = 700


def _library_modules() -> list[Path]:
    return [path for top in LIBRARY for path in sorted((ROOT / top).rglob("*.py"))]


def test_no_library_or_benchmark_module_passes_the_line_limit():
    """A module past the limit is cut along a seam, not squeezed.  The benchmark is held
    to it too: a scenario is read as a story, and one file of a thousand lines is not."""
    modules = _library_modules() + sorted((ROOT / "bench").rglob("*.py"))
    long = {str(path.relative_to(ROOT)): n for path in modules
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_only_forksafe_registers_fork_callbacks():
    """``os.register_at_fork`` is called in vmm_core.forksafe alone, which runs every
    module's callbacks in one declared order (``forksafe.at_fork(stage, ...)``; a backend
    reaches it as ``vmm_core.plugin.at_fork``)."""
    calls = set()
    for path in _library_modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and "register_at_fork" in (
                    getattr(node.func, "attr", None), getattr(node.func, "id", None)):
                calls.add(str(path.relative_to(ROOT)))
    assert calls == {"vmm_core/forksafe.py"}, calls
