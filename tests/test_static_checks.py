"""Lint (ruff: errors, warnings, import order) and the type check of the public API (mypy),
as part of the test command, so CI runs them with every test run.

Both are pinned in the ``test`` extra; their configuration is in pyproject.toml.
"""

from __future__ import annotations

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
