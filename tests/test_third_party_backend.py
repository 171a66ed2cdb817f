"""A third party's backend, installed the way a vendor ships one (its own module, and an
entry point in its distribution's metadata on ``sys.path``), auto-selected over ``host``
by its probe's priority: its contract run as ``vmm_core.testing`` tells vendors to run it,
then ``vmm-core bench`` on it, each in a fresh process as a user runs them.

The vendor is tests/memfd_vendor.py: written from ``vmm_core.plugin`` and
``vmm_core.errors`` alone, its handles plain ints (an index into its own table), and
every role (allocator adapter, graph ops, copy queue) filled through the plugin's bases,
so the contract suite's role tests run on it too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vmm_core.testing
from vmm_core.testing.imports import imports_outside_contract

#: the vendor's module: its own hooks and roles, on vmm_core.plugin and vmm_core.errors
VENDOR = Path(__file__).resolve().parent / "memfd_vendor.py"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A folder holding the vendor's module and its distribution's metadata, and the
    environment of a process that has it on its path (a user's shell: nothing forced)."""
    root = tmp_path_factory.mktemp("site")
    (root / "intvendor_vmm.py").write_text(VENDOR.read_text())
    info = root / "intvendor-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: intvendor\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[vmm_core.backends]\nintvendor = intvendor_vmm:backend\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMM_CORE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in sys.path if p])
    return root, env


def _run(argv, env, cwd, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


def test_the_vendor_is_written_from_the_plugin_contract_alone(installed):
    """What a third party can write: of vmm_core, the plugin and the errors; nothing of
    the built-in backends."""
    root, _ = installed
    module = root / "intvendor_vmm.py"
    assert imports_outside_contract([module]) == []
    assert "vmm_backends" not in module.read_text()


def test_the_vendor_backend_is_chosen_over_host(installed):
    root, env = installed
    proc = _run(["-c", "import vmm_core; print(vmm_core.get_backend().name)"], env, root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "intvendor"


def _usage_snippet() -> str:
    """The code block of ``vmm_core.testing``'s docstring, as a vendor copies it."""
    return textwrap.dedent(vmm_core.testing.__doc__.split("::\n", 1)[1])


def test_the_contract_runs_as_the_testing_docs_tell_a_vendor(installed, tmp_path):
    """The docs named a file to put the suite in; pytest collected nothing there (exit 5)
    when that file was conftest.py."""
    _, env = installed
    doc = vmm_core.testing.__doc__
    named = re.findall(r"\(``(test_\w+\.py)``\)", doc)
    assert named, doc
    (tmp_path / named[0]).write_text(_usage_snippet().replace('"myvendor"', '"intvendor"'))
    proc = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], env,
                tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 30, proc.stdout[-2000:]
    # the roles it fills ran, not skipped: the copy queue, the adapter, the graph ops
    proc = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path), "-k",
                 "copy_queue or adapter or graph_ops"], env, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\b4 passed", proc.stdout) and "skipped" not in proc.stdout, \
        proc.stdout[-2000:]


def test_bench_runs_on_a_vendor_backend_through_the_contract_only(installed, tmp_path):
    """It assumed host handles (``handle.fd``) and failed with AttributeError."""
    _, env = installed
    out = tmp_path / "bench.json"
    proc = _run(["-m", "vmm_core", "bench", "--sizes", "1,2,4,8", "--orders",
                 "ascending,random", "--sleep", "--sleep-gib", "0.01", "--json", str(out)],
                env, tmp_path)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("backend 'intvendor' (")
    result = json.loads(out.read_text())
    assert result["backend"] == "intvendor" and result["ok"] is True
    for row in result["rows"]:
        assert row["backend"] == "intvendor"
        assert row["aliasing_verified"] and row["sleep_wake_verified"]
        # measured at the backend's hooks: one working set held, not the sum
        assert row["physical_bytes"] == row["largest_working_set_bytes"]
        assert row["sum_of_working_sets_bytes"] > row["physical_bytes"]
    assert result["sleep"]["ok"]
    assert all(r["bytes_restored"] for s in result["sleep"]["sizes"] for r in s["rows"])
