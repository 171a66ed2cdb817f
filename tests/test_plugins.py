"""Backend discovery through the ``vmm_core.backends`` entry-point group.

Like pytest/pluggy, these tests fake ``importlib.metadata`` instead of pip-installing
packages: real ``EntryPoint`` objects (and, for the default registry, a real
``importlib.metadata.Distribution`` subclass that serves an ``entry_points.txt``) point at
plugin modules written into ``tmp_path`` and put on ``sys.path``.  The vendor plugins are
written as a vendor would: their own module, their own backend name, from
``vmm_core.plugin`` and ``vmm_core.errors`` alone, hooks built on the third-party backend
of tests/memfd_vendor.py (real memfd + mmap), so using one really maps memory.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vmm_core
from vmm_core import registry
from vmm_core.errors import (
    AmbiguousBackendError,
    BackendError,
    BackendNotFoundError,
    BackendUnavailableError,
    VMMPluginWarning,
)
from vmm_core.hookspecs import REQUIRED_HOOKS
from vmm_core.registry import ENTRY_POINT_GROUP, ENV_BACKEND, BackendRegistry
from vmm_core.testing.imports import imports_outside_contract

GROUP = ENTRY_POINT_GROUP
HOST_EP = importlib.metadata.EntryPoint("host", "vmm_backends.host.vmm_api:backend", GROUP)


def vendor_source(name: str, priority: int = 100, available: bool = True,
                  reason: str | None = None, probe_raises: str | None = None,
                  extra: str = "") -> str:
    """A third-party backend module, as a vendor would write it on top of MemfdBackend.

    ``extra`` holds more class-body source (methods), written at any indentation.
    """
    reason = reason or f"{name}: 1 accelerator (memfd-backed)"
    if probe_raises:
        probe_body = f"raise RuntimeError({probe_raises!r})"
    else:
        probe_body = (f"return Probe({available!r}, {reason!r}, "
                      f"device_count={int(available)}, priority={priority})")
    lines = [
        f'"""{name}: a third-party vmm_core backend shipped in its own distribution."""',
        "from memfd_vendor import MemfdBackend",
        "from vmm_core.plugin import Probe, hookimpl",
        "",
        "CALLS = []  # which of *this* plugin's hooks ran",
        "",
        "",
        "class VendorBackend(MemfdBackend):",
        f"    name = {name!r}",
        "",
        "    @hookimpl",
        "    def vmm_probe(self):",
        f"        {probe_body}",
        "",
        "    @hookimpl",
        "    def vmm_create_handle(self, device, size):",
        "        CALLS.append(('create_handle', size))",
        "        return super().vmm_create_handle(device, size)",
        "",
        "    @hookimpl",
        "    def vmm_map(self, device, address, size, handle, offset):",
        "        CALLS.append(('map', address, size))",
        "        return super().vmm_map(device, address, size, handle, offset)",
        "",
        textwrap.indent(textwrap.dedent(extra).strip("\n"), "    "),
        "",
        "",
        "backend = VendorBackend()",
        "",
    ]
    return "\n".join(lines)


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Factory: write a plugin module into tmp_path and return an EntryPoint for it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def make(ep_name: str, source: str, module: str | None = None,
             attr: str = "backend") -> importlib.metadata.EntryPoint:
        module = module or f"vendor_{ep_name}_vmm"
        (tmp_path / f"{module}.py").write_text(source)
        written.append(module)
        importlib.invalidate_caches()
        return importlib.metadata.EntryPoint(ep_name, f"{module}:{attr}", GROUP)

    yield make
    for module in written:
        sys.modules.pop(module, None)


@pytest.fixture
def clean_env(monkeypatch):
    """No backend forced, and no library override that makes an emulated driver usable
    (tests/emulated sets those for the rest of the session)."""
    for key in list(os.environ):
        if key.startswith("VMM_CORE_"):
            monkeypatch.delenv(key)


class FakeDistribution(importlib.metadata.Distribution):
    """An installed distribution as importlib.metadata sees one: METADATA + entry_points.txt."""

    def __init__(self, name: str, entry_points: dict[str, str]) -> None:
        self._name = name
        self._eps = entry_points

    def read_text(self, filename):
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: {self._name}\nVersion: 1.0\n"
        if filename == "entry_points.txt":
            lines = "".join(f"{k} = {v}\n" for k, v in self._eps.items())
            return f"[{GROUP}]\n{lines}"
        return None

    def locate_file(self, path):
        return path


@pytest.fixture
def default_registry_with(monkeypatch, clean_env):
    """Make the process-wide registry discover ``host`` plus the given fake distributions.

    ``importlib.metadata.entry_points`` is monkeypatched, the default registry is reset so
    that it rediscovers, and the original registry is put back afterwards.
    """
    saved = vmm_core.default_registry()

    def install(*dists: FakeDistribution, include_host: bool = True):
        def fake_entry_points(**params):
            eps = [HOST_EP] if include_host else []
            for dist in dists:
                eps.extend(dist.entry_points)  # real EntryPoints bound to the dist
            return importlib.metadata.EntryPoints(eps).select(**params)

        monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
        registry.reset()

    yield install
    registry.reset(saved)


def assert_aliases_across_spaces(backend) -> None:
    """A SharedVMMAllocator on ``backend`` maps the same bytes into two virtual spaces."""
    alloc = vmm_core.SharedVMMAllocator(backend=backend, reserve_bytes=1 << 22)
    try:
        assert alloc.backend is backend
        p0 = alloc.allocate(3 * alloc.granularity)
        ctypes.memset(p0, 0x5A, 3 * alloc.granularity)
        alloc.switch_to_new_virtual_space()
        p1 = alloc.allocate(3 * alloc.granularity)
        assert p1 != p0 and alloc.num_virtual_spaces == 2
        assert ctypes.string_at(p1, 3 * alloc.granularity) == b"\x5a" * (3 * alloc.granularity)
        ctypes.memset(p1 + 17, 0x33, 1)  # write through the new space, read in the old
        assert ctypes.string_at(p0 + 17, 1) == b"\x33"
        assert alloc.physical_bytes == 3 * alloc.granularity
    finally:
        alloc.close()


# ------------------------------------------------------------------ (a) third-party backend
def test_third_party_backend_is_found_detected_and_used(plugins, clean_env):
    acme = plugins("acme", vendor_source("acme"))
    reg = BackendRegistry(entry_points=[HOST_EP, acme])

    assert reg.names() == ["acme", "host"]
    assert not reg.load_errors
    probe = reg.backends()["acme"].probe()
    assert probe.available and probe.priority == 100
    assert reg.available() == ["acme", "host"], "priority 100 must rank above host (0)"

    sel = reg.select()
    assert sel.backend.name == "acme"
    assert "priority 100" in sel.reason
    assert sel.backend.plugin is sys.modules["vendor_acme_vmm"].backend

    calls = sys.modules["vendor_acme_vmm"].CALLS
    assert calls == []
    assert_aliases_across_spaces(sel.backend)
    # the vendor's own hooks did the work: one handle, mapped into both spaces
    assert [c[0] for c in calls].count("create_handle") == 1
    assert [c[0] for c in calls].count("map") == 2


def test_third_party_distribution_through_default_registry(plugins, default_registry_with):
    plugins("acme", vendor_source("acme"))
    default_registry_with(FakeDistribution("acme-vmm", {"acme": "vendor_acme_vmm:backend"}))

    assert vmm_core.available_backends() == ["acme", "host"]
    sel = vmm_core.select_backend()
    backend = sel.backend
    assert backend.name == "acme" and "auto-detected" in sel.reason
    assert vmm_core.get_backend() is backend
    assert_aliases_across_spaces(vmm_core.SharedVMMAllocator().backend)
    # a name is enough to build an allocator on the vendor backend
    alloc = vmm_core.SharedVMMAllocator("acme", reserve_bytes=1 << 20)
    try:
        assert alloc.backend is backend
    finally:
        alloc.close()


# ------------------------------------------------------------------ (b)-(e) broken plugins
def test_plugin_whose_import_raises_is_skipped_with_a_warning(plugins, clean_env):
    broken = plugins("broken", "raise ImportError('libbroken.so.2: cannot open shared object')\n")
    acme = plugins("acme", vendor_source("acme"))
    reg = BackendRegistry(entry_points=[broken, acme, HOST_EP])

    with pytest.warns(VMMPluginWarning, match=r"'broken' skipped") as rec:
        reg.load()
    assert len(rec) == 1
    message = str(rec[0].message)
    assert "vendor_broken_vmm:backend" in message and "libbroken.so.2" in message
    assert reg.names() == ["acme", "host"], "the other plugins still load"
    assert "ImportError" in reg.load_errors["broken"]
    with pytest.raises(BackendNotFoundError,
                       match=r"'broken' was found but rejected: import of .* failed"):
        reg.get("broken")
    assert reg.select().backend.name == "acme"


def test_plugin_with_a_missing_attribute_is_skipped(plugins, clean_env):
    ep = plugins("noattr", vendor_source("noattr"), attr="no_such_object")
    reg = BackendRegistry(entry_points=[ep, HOST_EP])
    with pytest.warns(VMMPluginWarning, match=r"'noattr' skipped.*AttributeError"):
        assert reg.names() == ["host"]


def test_misspelled_hook_fails_at_load_time(plugins, clean_env):
    typo = plugins("typo", vendor_source("typo", extra='''
        @hookimpl
        def vmm_reserv(self, device, size, alignment):  # misspelled vmm_reserve
            return 0
    '''))
    acme = plugins("acme", vendor_source("acme"))
    reg = BackendRegistry(entry_points=[typo, acme, HOST_EP])

    with pytest.warns(VMMPluginWarning, match=r"'typo' skipped") as rec:
        reg.load()  # at load time, before any hook of it is called
    message = str(rec[0].message)
    assert "unknown hook" in message and "vmm_reserv" in message
    assert reg.names() == ["acme", "host"]
    # nothing of the rejected plugin is left in the plugin manager
    typo_plugin = sys.modules["vendor_typo_vmm"].backend
    assert not reg.pm.is_registered(typo_plugin)
    reg.pm.check_pending()  # the rejected impl does not poison later checks
    assert reg.select().backend.name == "acme"


def test_plugin_missing_required_hooks_lists_them(plugins, clean_env):
    partial = plugins("partial", textwrap.dedent('''\
        from vmm_core.plugin import BackendCapabilities, Probe, hookimpl

        class Partial:
            @hookimpl
            def vmm_probe(self):
                return Probe(True, "partial", device_count=1, priority=100)

            @hookimpl
            def vmm_capabilities(self, device):
                return BackendCapabilities(granularity=4096)

            @hookimpl
            def vmm_reserve(self, device, size, alignment):
                return 0

        backend = Partial()
        '''))
    reg = BackendRegistry(entry_points=[partial, HOST_EP])
    with pytest.warns(VMMPluginWarning, match=r"'partial' skipped: missing required hooks"):
        reg.load()
    listed = reg.load_errors["partial"].split("missing required hooks:", 1)[1]
    listed = {h.strip() for h in listed.split(",")}
    assert listed == set(REQUIRED_HOOKS) - {"vmm_probe", "vmm_capabilities", "vmm_reserve"}
    assert reg.names() == ["host"]
    assert reg.select().backend.name == "host", "an incomplete plugin is never selected"
    # asked for by name, it is reported as found and rejected, with the hooks it lacks
    with pytest.raises(BackendNotFoundError) as info:
        reg.select("partial")
    message = str(info.value)
    assert "'partial' was found but rejected: missing required hooks: vmm_" in message
    assert "no vmm_core backend named" not in message


def test_plugin_whose_probe_raises_is_unavailable_not_a_crash(plugins, clean_env):
    flaky = plugins("flaky", vendor_source("flaky", probe_raises="firmware query timed out"))
    reg = BackendRegistry(entry_points=[flaky, HOST_EP])

    backend = reg.get("flaky")
    probe = backend.probe()
    assert probe.available is False
    assert "firmware query timed out" in probe.reason and "vmm_probe" in probe.reason
    assert reg.available() == ["host"]
    assert reg.select().backend.name == "host"
    with pytest.raises(BackendUnavailableError, match="firmware query timed out"):
        reg.select("flaky")


# ------------------------------------------------------------------ (e2) one vocabulary
def test_core_asks_for_the_allocator_adapter_once_per_device(plugins, clean_env):
    """The decision lives in vmm_core.Backend: the hook is asked until it gives an adapter
    (None means "not installed now"), then never again for that device."""
    acme = plugins("acme", vendor_source("acme", extra="""
        @hookimpl
        def vmm_allocator_adapter(self, device):
            CALLS.append(("allocator_adapter", device))
            if len(CALLS) == 1:
                return None  # its framework is not importable yet
            return super().vmm_allocator_adapter(device)
    """))
    backend = BackendRegistry(entry_points=[acme]).get("acme")
    calls = sys.modules["vendor_acme_vmm"].CALLS
    assert backend.allocator_adapter(0) is None
    adapter = backend.allocator_adapter(0)
    assert adapter is not None
    assert all(backend.allocator_adapter(0) is adapter for _ in range(3))
    pool = vmm_core.GraphPool(0, backend=backend, reads=())
    try:
        assert pool.adapter is adapter  # what every pool of the device uses
    finally:
        pool.close()
    assert calls == [("allocator_adapter", 0)] * 2


@pytest.mark.parametrize("declared, refused", [
    ({"shareable_handles": "posix_fd"},
     "shareable_handles='posix_fd' (one of None, 'fd', 'integer')"),
    ({"granularity": 3 << 20}, "granularity=3145728 (a positive power of two"),
    ({"default_reserve_bytes": (1 << 30) + 1}, "default_reserve_bytes=1073741825"),
])
def test_capabilities_outside_the_one_vocabulary_are_refused(plugins, clean_env, declared,
                                                             refused):
    """Core compares these values: a vendor's own spelling would take the wrong branch
    silently (no sharing where it could, every granularity check off)."""
    odd = plugins("odd", vendor_source("odd", extra=f"""
        @hookimpl
        def vmm_capabilities(self, device):
            import dataclasses
            return dataclasses.replace(super().vmm_capabilities(device), **{declared!r})
    """))
    backend = BackendRegistry(entry_points=[odd]).get("odd")
    with pytest.raises(BackendError, match=re.escape(f"backend 'odd': vmm_capabilities "
                                                     f"declared {refused}")):
        backend.capabilities(0)
    with pytest.raises(BackendError, match=re.escape(refused)):
        vmm_core.SharedVMMAllocator(backend)


def test_every_builtin_reads_its_library_override_by_the_one_rule(monkeypatch):
    """The override variable is VMM_CORE_<NAME>_LIB after the backend's name, beside
    VMM_CORE_BACKEND, whatever the vendor calls its library (the emulated drivers are
    loaded through these same variables)."""
    from vmm_backends.ascend import vmm_api as ascend
    from vmm_backends.mlu import vmm_api as mlu
    from vmm_core.plugin import library_env

    assert (ascend.ENV_LIBRARY, mlu.ENV_LIBRARY) == ("VMM_CORE_ASCEND_LIB", "VMM_CORE_MLU_LIB")
    for name, module in (("ascend", ascend), ("mlu", mlu)):
        assert module.ENV_LIBRARY == library_env(name)
        monkeypatch.setenv(module.ENV_LIBRARY, f"/nonexistent/{name}.so")
        probe = type(module.backend)().vmm_probe()
        assert not probe.available and module.ENV_LIBRARY in probe.reason
        assert f"/nonexistent/{name}.so" in probe.reason


# ------------------------------------------------------------------ (f)-(h) selection
def test_env_var_naming_an_unknown_backend_lists_the_choices(plugins, default_registry_with,
                                                            monkeypatch):
    plugins("acme", vendor_source("acme"))
    default_registry_with(FakeDistribution("acme-vmm", {"acme": "vendor_acme_vmm:backend"}))
    monkeypatch.setenv(ENV_BACKEND, "nonexistent")

    with pytest.raises(BackendNotFoundError) as info:
        vmm_core.get_backend()
    message = str(info.value)
    assert "'nonexistent'" in message
    assert "registered backends: acme, host" in message
    assert ENV_BACKEND in message


def test_env_var_forces_host_over_a_detected_accelerator(plugins, default_registry_with,
                                                        monkeypatch):
    plugins("acme", vendor_source("acme"))
    default_registry_with(FakeDistribution("acme-vmm", {"acme": "vendor_acme_vmm:backend"}))
    assert vmm_core.get_backend().name == "acme"  # without the override

    monkeypatch.setenv(ENV_BACKEND, "host")
    sel = vmm_core.select_backend()
    assert sel.backend.name == "host"
    assert sel.reason == f"forced by {ENV_BACKEND}=host"
    # an explicit name still wins over the environment
    assert vmm_core.get_backend("acme").name == "acme"


def test_two_equal_accelerators_are_ambiguous(plugins, default_registry_with, monkeypatch):
    plugins("acme", vendor_source("acme"))
    plugins("zeta", vendor_source("zeta"))
    default_registry_with(FakeDistribution("acme-vmm", {"acme": "vendor_acme_vmm:backend"}),
                          FakeDistribution("zeta-vmm", {"zeta": "vendor_zeta_vmm:backend"}))

    assert vmm_core.available_backends() == ["acme", "zeta", "host"]
    with pytest.raises(AmbiguousBackendError) as info:
        vmm_core.get_backend()
    message = str(info.value)
    assert "acme" in message and "zeta" in message and ENV_BACKEND in message
    assert "host" not in message.split(".")[0], "host (priority 0) is not a candidate"

    monkeypatch.setenv(ENV_BACKEND, "zeta")
    assert vmm_core.get_backend().name == "zeta"


def test_a_higher_priority_breaks_the_tie(plugins, clean_env):
    acme = plugins("acme", vendor_source("acme", priority=100))
    zeta = plugins("zeta", vendor_source("zeta", priority=150))
    reg = BackendRegistry(entry_points=[acme, zeta, HOST_EP])
    assert reg.available() == ["zeta", "acme", "host"]
    assert reg.select().backend.name == "zeta"


def test_requesting_an_unavailable_backend_says_why(plugins, default_registry_with,
                                                   monkeypatch):
    why = "libacme.so.3 not found: install the acme driver"
    plugins("acme", vendor_source("acme", available=False, reason=why))
    default_registry_with(FakeDistribution("acme-vmm", {"acme": "vendor_acme_vmm:backend"}))

    assert vmm_core.available_backends() == ["host"]
    assert vmm_core.get_backend().name == "host", "an unusable accelerator is not detected"
    with pytest.raises(BackendUnavailableError, match="libacme.so.3 not found") as info:
        vmm_core.get_backend("acme")
    assert "'acme'" in str(info.value) and "vmm-core info" in str(info.value)
    monkeypatch.setenv(ENV_BACKEND, "acme")
    with pytest.raises(BackendUnavailableError, match="install the acme driver"):
        vmm_core.get_backend()
    with pytest.raises(BackendUnavailableError, match="libacme.so.3"):
        vmm_core.SharedVMMAllocator("acme")


def test_no_usable_backend_explains_each(plugins, default_registry_with):
    plugins("acme", vendor_source("acme", available=False, reason="no acme device visible"))
    default_registry_with(FakeDistribution("acme-vmm", {"acme": "vendor_acme_vmm:backend"}),
                          include_host=False)
    with pytest.raises(BackendUnavailableError, match="acme: no acme device visible"):
        vmm_core.get_backend()


def test_builtin_cuda_unavailable_says_libcuda(clean_env):
    reg = BackendRegistry()
    cuda = reg.get("cuda")
    if cuda.available:
        pytest.skip("a CUDA driver is present here")
    with pytest.raises(BackendUnavailableError, match="libcuda"):
        reg.select("cuda")


# ------------------------------------------------------------------ (i) cheap import
def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("VMM_CORE_")}


def test_import_does_not_load_vendor_frameworks(tmp_path):
    code = textwrap.dedent('''\
        import json, sys

        def frameworks():
            roots = ("torch", "torch_npu", "torch_mlu")
            return sorted(m for m in sys.modules
                          if m.split(".")[0] in roots or m == "cuda.bindings"
                          or m.startswith("cuda.bindings."))

        import vmm_core
        after_import = frameworks()
        names = vmm_core.available_backends()
        after_probe = frameworks()
        print(json.dumps({"after_import": after_import, "available": names,
                          "after_probe": after_probe,
                          "registered": vmm_core.default_registry().names()}))
        ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_clean_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["after_import"] == [], "import vmm_core must not import a framework"
    assert result["after_probe"] == [], "probing must use ctypes, not the frameworks"
    assert "host" in result["available"]
    assert set(result["registered"]) >= {"host", "cuda", "ascend", "mlu"}


# ------------------------------------------------------------------ (j) built-ins
def test_builtin_backends_are_registered_through_the_entry_point_group():
    eps = importlib.metadata.entry_points(group=GROUP)
    ours = {ep.name: ep for ep in eps
            if ep.dist is not None and ep.dist.metadata["Name"].replace("-", "_") == "vmm_core"}
    assert set(ours) == {"host", "cuda", "ascend", "mlu"}
    assert ours["host"].value == "vmm_backends.host.vmm_api:backend"
    for name in ("cuda", "ascend", "mlu"):
        assert ours[name].value == f"vmm_backends.{name}.vmm_api:backend"

    # the registry holds exactly the objects those entry points load
    reg = BackendRegistry()
    backends = reg.backends()
    for name, ep in ours.items():
        assert backends[name].plugin is ep.load()


# ------------------------------------------------------------------ (k) the one contract
BACKENDS_DIR = Path(__file__).resolve().parents[1] / "backends"


def test_builtin_backends_import_only_the_plugin_contract():
    """The built-in backends are written as a third party must write one: of vmm_core,
    only ``vmm_core.plugin`` and ``vmm_core.errors``, so nothing they need is missing
    from the contract and core's internals can move under them."""
    files = sorted(BACKENDS_DIR.rglob("*.py"))
    assert len(files) >= 16, files  # every vendor folder is read
    assert imports_outside_contract([BACKENDS_DIR]) == []


def test_the_import_check_names_every_way_to_reach_past_the_contract(tmp_path):
    vendor = tmp_path / "vendor_vmm.py"
    vendor.write_text(textwrap.dedent('''\
        import importlib

        import vmm_core
        import vmm_core.errors
        from vmm_core import Probe, errors, plugin
        from vmm_core.errors import MappingError
        from vmm_core.memory.shim import load_shim
        from vmm_core.plugin import hookimpl


        def later():
            from vmm_core.graphs import graph_ops
            return importlib.import_module("vmm_core.backend"), graph_ops
        '''))
    assert imports_outside_contract([tmp_path]) == [
        f"{vendor}:3: vmm_core", f"{vendor}:5: vmm_core", f"{vendor}:7: vmm_core.memory.shim",
        f"{vendor}:12: vmm_core.graphs", f"{vendor}:13: vmm_core.backend"]
