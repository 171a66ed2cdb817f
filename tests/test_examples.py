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


def test_a_gpu_example_says_in_one_line_what_it_needs(tmp_path):
    """It ended in torch's AssertionError (Torch not compiled with CUDA enabled)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is usable here: the example runs (test_example_runs)")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "engine_runner.py")],
                          capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["examples/engine_runner.py needs a CUDA GPU (torch.cuda.is_available() "
                     "is False); examples/host_graph_pool.py makes the same calls on a CPU"]
