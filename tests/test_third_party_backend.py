"""A third party's backend, installed the way a vendor ships one (its own module, and an
entry point in its distribution's metadata on ``sys.path``), auto-selected over ``host``
by its probe's priority: its contract run as ``vmm_core.testing`` tells vendors to run it,
then ``vmm-core bench`` on it, each in a fresh process as a user runs them.

Its handles are plain ints (an index into its own table), not the host backend's memfd
objects, and it implements only the required hooks: what runs on it uses nothing but the
vmm_api contract.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import vmm_core.testing

VENDOR = '''
"""intvendor: a vmm_core backend whose physical memory handles are ints."""

import dataclasses

from vmm_core import Probe, hookimpl
from vmm_backends.host.vmm_api import HostBackend

_pages = HostBackend()  # the memory behind it (memfd + mmap), driven through its hooks


class IntHandleBackend:
    name = "intvendor"

    def __init__(self):
        self._handles = {}
        self._next = 0

    @hookimpl
    def vmm_probe(self):
        return Probe(True, "intvendor: 1 device", device_count=1, priority=1)

    @hookimpl
    def vmm_capabilities(self, device):
        return dataclasses.replace(_pages.vmm_capabilities(device), shareable_handles=None,
                                   notes="ints for handles")

    @hookimpl
    def vmm_reserve(self, device, size, alignment):
        return _pages.vmm_reserve(device, size, alignment)

    @hookimpl
    def vmm_release_range(self, device, address, size):
        _pages.vmm_release_range(device, address, size)

    @hookimpl
    def vmm_create_handle(self, device, size):
        self._next += 1
        self._handles[self._next] = _pages.vmm_create_handle(device, size)
        return self._next

    @hookimpl
    def vmm_release_handle(self, device, handle):
        _pages.vmm_release_handle(device, self._handles.pop(handle))

    @hookimpl
    def vmm_map(self, device, address, size, handle, offset):
        _pages.vmm_map(device, address, size, self._handles[handle], offset)

    @hookimpl
    def vmm_set_access(self, device, address, size):
        _pages.vmm_set_access(device, address, size)

    @hookimpl
    def vmm_unmap(self, device, address, size):
        _pages.vmm_unmap(device, address, size)

    @hookimpl
    def vmm_synchronize(self, device):
        _pages.vmm_synchronize(device)

    @hookimpl
    def vmm_copy_to_host(self, device, address, host_address, size):
        _pages.vmm_copy_to_host(device, address, host_address, size)

    @hookimpl
    def vmm_copy_from_host(self, device, host_address, address, size):
        _pages.vmm_copy_from_host(device, host_address, address, size)


backend = IntHandleBackend()
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A folder holding the vendor's module and its distribution's metadata, and the
    environment of a process that has it on its path (a user's shell: nothing forced)."""
    root = tmp_path_factory.mktemp("site")
    (root / "intvendor_vmm.py").write_text(VENDOR)
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
