"""Every example in examples/ runs: on a CPU those that can, the rest on a GPU.

An example not listed in ``NEEDS`` must run on a CPU, so a new one is run by CI as soon
as it is added (or listed here with what it needs).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
#: examples that cannot run on a CPU, and the fixture (tests/conftest.py) that provides it
NEEDS = {"engine_runner.py": "cuda"}


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("VMM_CORE_")}


def test_every_listed_example_exists():
    assert set(NEEDS) <= {p.name for p in EXAMPLES.glob("*.py")}


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs(request, tmp_path, name):
    if name in NEEDS:
        request.getfixturevalue(NEEDS[name])  # skips without it; fails when required
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True,
                          text=True, cwd=tmp_path, env=_env(), timeout=600)
    assert proc.returncode == 0, f"{name}:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
