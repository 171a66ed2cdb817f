"""What the end of a test run shows: skips counted per reason, then the per-platform
counts, as the last lines before pytest's totals (not one SKIPPED line per test location
above them).  Run on a small suite with this suite's conftest.py and pytest
configuration."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SUITE = '''
import pytest


def test_on_every_platform(vmm_platform):
    if vmm_platform == "cuda":
        pytest.skip("no such device here")


@pytest.mark.parametrize("n", range(3))
def test_needs_a_tool(n):
    pytest.skip("the tool is not installed")


def test_that_fails():
    assert 1 == 2
'''


def test_skips_are_counted_per_reason_and_the_platforms_come_last(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(TESTS.parent / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "test_suite.py").write_text(SUITE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_suite.py"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout  # a failure still fails the run
    lines = proc.stdout.rstrip().splitlines()
    assert not [ln for ln in lines if ln.startswith("SKIPPED [")], proc.stdout
    assert any(ln.startswith("FAILED test_suite.py::test_that_fails") for ln in lines)
    tail = lines[-9:]
    assert "skipped, by reason" in tail[0], proc.stdout
    assert tail[1:3] == ["    3  the tool is not installed", "    1  no such device here"]
    assert "contract suite per platform" in tail[3]
    assert tail[4:8] == ["platform host: 1 passed, 0 failed, 0 skipped",
                         "platform ascend-emulated: 1 passed, 0 failed, 0 skipped",
                         "platform mlu-emulated: 1 passed, 0 failed, 0 skipped",
                         "platform cuda: 0 passed, 0 failed, 1 skipped"]
    assert tail[8].startswith("1 failed, 3 passed, 4 skipped"), tail[8]
