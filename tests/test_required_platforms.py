"""``VMM_CORE_REQUIRE`` turns the skips of the platforms it names into failures; a name
no test requires stops the run before any test, listing the valid names, so a misspelled
requirement cannot let every test it meant skip green.  Run on a small suite with this
suite's conftest.py and pytest configuration."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REQUIREMENTS

TESTS = Path(__file__).resolve().parent

SUITE = '''
from vmm_core.testing.platforms import skip_or_fail


def test_needs_a_gpu():
    skip_or_fail("cuda", "no GPU here")
'''


def _run(tmp_path, require: str) -> subprocess.CompletedProcess:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(TESTS.parent / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMM_CORE_")}
    env["VMM_CORE_REQUIRE"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_suite.py"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)


def test_a_misspelled_name_stops_the_run_with_the_valid_names(tmp_path):
    proc = _run(tmp_path, "cdua,vllm")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "VMM_CORE_REQUIRE names 'cdua'" in proc.stderr, proc.stderr
    for name in REQUIREMENTS:
        assert f"\n  {name} " in proc.stderr, (name, proc.stderr)
    assert "passed" not in proc.stdout and "skipped" not in proc.stdout, proc.stdout


def test_a_named_platform_fails_instead_of_skipping(tmp_path):
    proc = _run(tmp_path, "cuda")
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout + proc.stderr
    assert "VMM_CORE_REQUIRE requires 'cuda' but it is unusable: no GPU here" in proc.stdout


def _id(name: str) -> str:
    return f"require={name}"  # not read as a platform by the per-platform counts


@pytest.mark.parametrize("name", sorted(set(REQUIREMENTS) - {"cuda", "cuda-2gpu"}), ids=_id)
def test_every_valid_name_is_accepted(tmp_path, name):
    proc = _run(tmp_path, name)
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout


@pytest.mark.parametrize("name", sorted(REQUIREMENTS), ids=_id)
def test_every_valid_name_is_one_a_test_skips_under(name):
    """The list names what the tests require, nothing more: a name no test skips under
    would fail nothing."""
    platform = name.split("-")[0]
    sources = "".join(p.read_text() for p in TESTS.glob("*.py"))
    calls = (f'skip_or_fail("{name}"', f'require_backend("{name}")',
             f'_emulated("{platform}")')
    assert any(call in sources for call in calls), name
