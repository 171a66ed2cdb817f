"""The Ascend backend against the emulated libascendcl (tests/emulated/ascendcl_emu.c).

Every documented constraint the emulator enforces must come back through the backend as
the vmm_core exception of its kind, with a message naming the ACL call and its code.
Each test loads its own copy of the emulated library so driver state (aclInit, live
handles, the memory limit) starts fresh.  No Ascend hardware is involved.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading

import emulated  # tests/emulated: builds the fake vendor libraries
import pytest

from vmm_backends.ascend import acl_bindings
from vmm_backends.ascend.acl_bindings import SIGNATURES, AclrtMemLocation, AclrtPhysicalMemProp
from vmm_backends.ascend.vmm_api import ENV_LIBRARY, AscendBackend
from vmm_core.errors import BackendError, MappingError, OutOfMemoryError
from vmm_core.registry import BackendRegistry
from vmm_core.testing.tools import read_bytes, write_bytes

MiB = 1 << 20
_GOOD_PROP = AscendBackend._prop  # before any test patches it


@pytest.fixture(scope="module")
def built():
    try:
        return emulated.build("ascend")
    except emulated.NotBuildable as exc:
        pytest.skip(f"emulated libascendcl cannot be built: {exc}")


@pytest.fixture
def lib_copy(built, tmp_path):
    """A private copy of the emulated library: a separate dlopen, so separate state."""
    path = tmp_path / "libascendcl.so"
    shutil.copy(built, path)
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        getattr(lib, name).restype = restype
        getattr(lib, name).argtypes = argtypes
    for name in ("emu_live_handles", "emu_live_mappings", "emu_live_reservations",
                 "emu_prop_layout", "emu_physical_bytes"):
        getattr(lib, name).restype = ctypes.c_size_t
    lib.emu_set_memory_limit.argtypes = [ctypes.c_size_t]
    lib.emu_set_memory_limit.restype = None
    return path, lib


@pytest.fixture
def be(lib_copy, monkeypatch):
    """The real backend plugin on the private copy, seen through a vmm_core Backend."""
    path, _ = lib_copy
    monkeypatch.setenv(ENV_LIBRARY, str(path))
    registry = BackendRegistry(entry_points=[])
    backend = registry.register(AscendBackend(), name="ascend")
    assert backend.probe().available, backend.probe().reason
    return backend


@pytest.fixture
def g(be):
    return be.capabilities(0).granularity


def _raises(exc_type, call: str, code: int):
    """pytest.raises for ``exc_type`` whose message names ``call`` and ``code``."""
    return pytest.raises(exc_type, match=rf"{call}\(.*{code}")


def _prop(**changes) -> AclrtPhysicalMemProp:
    prop = _GOOD_PROP(0)
    for key, value in changes.items():
        if key.startswith("location_"):
            setattr(prop.location, key[len("location_"):], value)
        else:
            setattr(prop, key, value)
    return prop


# ------------------------------------------------------------------ no library / probe
def test_import_is_cheap_and_probe_names_the_env_var_without_library(tmp_path):
    code = (
        "import sys\n"
        "import vmm_backends.ascend.vmm_api as m\n"
        "assert 'torch_npu' not in sys.modules and 'torch' not in sys.modules\n"
        "p = m.backend.vmm_probe()\n"
        "assert not p.available, p\n"
        "print(p.reason)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ENV_LIBRARY}
    for override in (None, str(tmp_path / "missing" / "libascendcl.so")):
        if override:
            env[ENV_LIBRARY] = override
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "libascendcl.so not found" in out.stdout
        assert ENV_LIBRARY in out.stdout and "set_env.sh" in out.stdout
        if override:
            assert override in out.stdout


def test_probe_rejects_a_library_without_the_vmm_api(monkeypatch):
    monkeypatch.setenv(ENV_LIBRARY, "libc.so.6")
    probe = AscendBackend().vmm_probe()
    assert not probe.available and "lacks aclInit" in probe.reason


def test_probe_tolerates_repeat_initialize(be, lib_copy):
    _, lib = lib_copy
    assert lib.aclInit(None) == acl_bindings.ACL_ERROR_REPEAT_INITIALIZE
    assert be.probe(refresh=True).available
    assert be.probe().device_count == 2 and be.probe().priority == 100
    # the library in Probe.library, as every backend names it, not under a version key
    assert be.probe().library == str(lib_copy[0]) and be.probe().versions == {}


def test_capabilities(be, g):
    caps = be.capabilities(0)
    assert g == 2 * MiB
    assert caps.partial_map is False and caps.needs_set_access is False
    assert caps.graph_pool is False and "torch_npu" in caps.notes  # not installed here


def test_struct_layout_matches_the_c_header(lib_copy):
    _, lib = lib_copy
    assert lib.emu_prop_layout(0) == ctypes.sizeof(AclrtPhysicalMemProp) == 32
    assert lib.emu_prop_layout(1) == AclrtPhysicalMemProp.location.offset == 12
    assert lib.emu_prop_layout(2) == AclrtPhysicalMemProp.reserve.offset == 24
    assert lib.emu_prop_layout(3) == ctypes.sizeof(AclrtMemLocation) == 8
    assert lib.emu_prop_layout(4) == AclrtPhysicalMemProp.memAttr.offset == 8


# ------------------------------------------------------------------ mapping constraints
def test_partial_map_is_refused(be, g):
    a = be.reserve(0, 4 * g, g)
    h = be.create_handle(0, 2 * g)
    with _raises(MappingError, "aclrtMapMem", 107000):
        be.map(0, a, g, h, 0)
    be.release_handle(0, h)
    be.release_range(0, a, 4 * g)


def test_nonzero_offset_is_refused(be, g):
    a = be.reserve(0, 4 * g, g)
    h = be.create_handle(0, 2 * g)
    with _raises(MappingError, "aclrtMapMem", 107000):
        be.map(0, a, 2 * g, h, g)
    be.release_handle(0, h)
    be.release_range(0, a, 4 * g)


def test_unaligned_address_is_refused(be, g):
    a = be.reserve(0, 4 * g, g)
    h = be.create_handle(0, g)
    with _raises(MappingError, "aclrtMapMem", 107008):
        be.map(0, a + 4096, g, h, 0)
    be.release_handle(0, h)
    be.release_range(0, a, 4 * g)


def test_unaligned_sizes_are_refused(be, g):
    with _raises(BackendError, "aclrtMallocPhysical", 107000):
        be.create_handle(0, g + 4096)
    with _raises(MappingError, "aclrtReserveMemAddress", 107000):
        be.reserve(0, g + 4096, g)


def test_map_outside_a_reservation_or_overlapping_is_refused(be, g, lib_copy):
    _, lib = lib_copy
    a = be.reserve(0, 2 * g, g)
    h = be.create_handle(0, g)
    h2 = be.create_handle(0, g)
    with _raises(MappingError, "aclrtMapMem", 107000):
        be.map(0, a + 2 * g, g, h, 0)  # past the end of the reservation
    be.map(0, a, g, h, 0)
    with _raises(MappingError, "aclrtMapMem", 107000):
        be.map(0, a, g, h2, 0)  # overlaps the live mapping
    be.unmap(0, a, g)
    for handle in (h, h2):
        be.release_handle(0, handle)
    be.release_range(0, a, 2 * g)
    assert (lib.emu_live_handles(), lib.emu_live_mappings(), lib.emu_live_reservations()) \
        == (0, 0, 0)


def test_unmap_not_at_start_of_mapping_is_refused(be, g):
    a = be.reserve(0, 4 * g, g)
    h = be.create_handle(0, 2 * g)
    be.map(0, a, 2 * g, h, 0)
    with _raises(MappingError, "aclrtUnmapMem", 107000):
        be.unmap(0, a + g, g)
    be.unmap(0, a, 2 * g)
    with _raises(MappingError, "aclrtUnmapMem", 107000):
        be.unmap(0, a, 2 * g)  # already unmapped
    be.release_handle(0, h)
    be.release_range(0, a, 4 * g)


def test_free_of_a_mapped_handle_is_refused(be, g, lib_copy):
    """CANN frees a mapped handle at its last unmap (aclrtFreePhysical, CANN 9.0.0); the
    backend refuses it so physical_bytes cannot drop memory the driver still holds."""
    _, lib = lib_copy
    a = be.reserve(0, 2 * g, g)
    h = be.create_handle(0, g)
    be.map(0, a, g, h, 0)
    with pytest.raises(MappingError, match="aclrtFreePhysical: .*still has 1 mapping"):
        be.release_handle(0, h)
    assert lib.emu_live_handles() == 1 and h.ptr, "a refused free must keep the handle"
    assert lib.emu_physical_bytes(0) == g
    be.unmap(0, a, g)
    be.release_handle(0, h)
    assert lib.emu_physical_bytes(0) == 0
    with pytest.raises(MappingError, match="aclrtFreePhysical"):
        be.release_handle(0, h)  # double free is caught before the driver
    be.release_range(0, a, 2 * g)


def test_emulator_defers_the_free_of_a_mapped_handle_to_its_last_unmap(be, g, lib_copy):
    """Doc rule R4 (aclrtFreePhysical, aclcppdevg_03_0113, CANN 9.0.0): the call succeeds,
    the memory stays held and readable until the last aclrtUnmapMem."""
    _, lib = lib_copy
    lib.emu_deferred_frees.restype = ctypes.c_size_t
    a = be.reserve(0, 2 * g, g)
    b = be.reserve(0, 2 * g, g)
    h = be.create_handle(0, g)
    be.map(0, a, g, h, 0)
    be.map(0, b, g, h, 0)
    write_bytes(be, 0, a, b"still here")
    assert lib.aclrtFreePhysical(ctypes.c_void_p(h.ptr)) == 0
    assert lib.emu_live_handles() == 0 and lib.emu_deferred_frees() == 1
    assert lib.emu_physical_bytes(0) == g  # not freed while mapped
    assert read_bytes(be, 0, b, 10) == b"still here"
    assert lib.aclrtMapMem(ctypes.c_void_p(a + g), g, 0, ctypes.c_void_p(h.ptr), 0) == \
        107017  # the freed handle is dead to new maps
    assert lib.aclrtUnmapMem(ctypes.c_void_p(a)) == 0
    assert lib.emu_physical_bytes(0) == g and lib.emu_deferred_frees() == 1
    assert lib.aclrtUnmapMem(ctypes.c_void_p(b)) == 0  # the last mapping: now it is freed
    assert lib.emu_physical_bytes(0) == 0 and lib.emu_deferred_frees() == 0
    assert lib.aclrtReleaseMemAddress(ctypes.c_void_p(a)) == 0
    assert lib.aclrtReleaseMemAddress(ctypes.c_void_p(b)) == 0


def test_release_of_a_range_with_mappings_is_refused(be, g, lib_copy):
    _, lib = lib_copy
    a = be.reserve(0, 2 * g, g)
    h = be.create_handle(0, g)
    be.map(0, a + g, g, h, 0)
    with _raises(MappingError, "aclrtReleaseMemAddress", 107000):
        be.release_range(0, a, 2 * g)
    be.unmap(0, a + g, g)
    be.release_range(0, a, 2 * g)
    with _raises(MappingError, "aclrtReleaseMemAddress", 107000):
        be.release_range(0, a, 2 * g)  # no longer a reservation
    be.release_handle(0, h)
    assert lib.emu_live_reservations() == 0


@pytest.mark.parametrize("field, value", [
    ("handleType", 2),          # ACL_MEM_HANDLE_TYPE_POSIX: only NONE is accepted
    ("handleType", 77),
    ("allocationType", 1),      # only ACL_MEM_ALLOCATION_TYPE_PINNED (0)
    ("location_type", 2),       # ACL_MEM_LOCATION_TYPE_UNREGISTERED
    ("memAttr", 2),             # ACL_DDR_MEM_HUGE is host-only
    ("memAttr", 99),            # not an aclrtMemAttr
])
def test_wrong_struct_fields_are_refused(be, monkeypatch, field, value):
    monkeypatch.setattr(AscendBackend, "_prop",
                        staticmethod(lambda device: _prop(**{field: value})))
    with _raises(BackendError, "aclrtMallocPhysical", 100000):
        be.create_handle(0, 2 * MiB)


def test_reserved_arguments_and_bogus_handles_return_vendor_codes(be, lib_copy):
    _, lib = lib_copy
    assert lib.aclrtSetDevice(0) == 0 and lib.aclrtSetDevice(2) == 107001
    p = ctypes.c_void_p()
    assert lib.aclrtReserveMemAddress(ctypes.byref(p), 2 * MiB, 2 * MiB, None, 0) == 100000
    assert lib.aclrtReserveMemAddress(ctypes.byref(p), 2 * MiB, 0, 0x1000, 0) == 207000
    assert lib.aclrtReserveMemAddress(ctypes.byref(p), 2 * MiB, 0, None, 5) == 100000
    assert lib.aclrtReserveMemAddress(ctypes.byref(p), 0, 0, None, 0) == 100000
    assert lib.aclrtFreePhysical(0xDEAD0000) == 107017  # never dereferenced by the emulator
    out = ctypes.c_size_t()
    prop = _prop()
    assert lib.aclrtMemGetAllocationGranularity(ctypes.byref(prop), 7, ctypes.byref(out)) \
        == 100000
    assert lib.aclrtMemGetAllocationGranularity(ctypes.byref(prop), 1, ctypes.byref(out)) == 0
    assert out.value == 2 * MiB


# ------------------------------------------------------------------ init / device order
def test_calls_before_acl_init_are_refused(lib_copy, monkeypatch):
    path, lib = lib_copy  # a fresh copy: aclInit has not run in it
    prop = _prop()
    h = ctypes.c_void_p()
    assert lib.aclrtMallocPhysical(ctypes.byref(h), 2 * MiB, ctypes.byref(prop), 0) == 100001
    assert lib.aclrtSetDevice(0) == 100001
    monkeypatch.setenv(ENV_LIBRARY, str(path))
    backend = AscendBackend()
    backend._open()  # library loaded, but vmm_probe (which calls aclInit) never ran
    backend._device_count = 1
    with pytest.raises(BackendError, match=r"aclrtSetDevice\(0\).*100001.*aclInit"):
        backend.vmm_create_handle(device=0, size=2 * MiB)


def test_calls_before_set_device_are_refused(be, lib_copy):
    _, lib = lib_copy
    codes = []

    def fresh_thread():  # aclInit ran, but this thread never called aclrtSetDevice
        prop = _prop()
        h = ctypes.c_void_p()
        codes.append(lib.aclrtMallocPhysical(ctypes.byref(h), 2 * MiB, ctypes.byref(prop), 0))
        codes.append(lib.aclrtSynchronizeDevice())

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    assert codes == [107002, 107002]
    err = acl_bindings.error_for("aclrtMallocPhysical", 107002, "size=2097152")
    assert isinstance(err, BackendError) and "aclrtSetDevice" in str(err)


def test_backend_selects_the_device_on_every_thread(be, g):
    results = []

    def worker():
        h = be.create_handle(0, g)
        be.release_handle(0, h)
        results.append(True)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert results == [True]
    with pytest.raises(BackendError, match="device 5"):
        be.create_handle(5, g)


# ------------------------------------------------------------------ memory and copies
def test_out_of_memory_is_out_of_memory_error(be, g, lib_copy):
    _, lib = lib_copy
    lib.emu_set_memory_limit(3 * g)
    h = be.create_handle(0, 2 * g)
    with _raises(OutOfMemoryError, "aclrtMallocPhysical", 207001):
        be.create_handle(0, 2 * g)
    assert lib.emu_live_handles() == 1 and lib.emu_physical_bytes(0) == 2 * g
    be.release_handle(0, h)


def test_memcpy_checks_kind_destmax_and_mapping(be, g, lib_copy):
    _, lib = lib_copy
    a = be.reserve(0, 2 * g, g)
    h = be.create_handle(0, g)
    be.map(0, a, g, h, 0)
    host = ctypes.create_string_buffer(64)
    hp = ctypes.addressof(host)
    assert lib.aclrtMemcpy(a, 64, hp, 64, acl_bindings.ACL_MEMCPY_DEVICE_TO_HOST) == 107000
    assert lib.aclrtMemcpy(hp, 64, a, 64, acl_bindings.ACL_MEMCPY_HOST_TO_DEVICE) == 107000
    assert lib.aclrtMemcpy(a, 64, hp, 64, 42) == 100000
    assert lib.aclrtMemcpy(a, 32, hp, 64, acl_bindings.ACL_MEMCPY_HOST_TO_DEVICE) == 107000
    assert lib.aclrtMemcpy(a, 64, hp, 64, acl_bindings.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    with _raises(BackendError, "aclrtMemcpy", 107000):
        be.copy_to_host(0, a + g - 32, hp, 64)  # runs into the unmapped half
    be.copy_device(0, a, a + 1024, 64)
    be.synchronize(0)
    be.unmap(0, a, g)
    be.release_handle(0, h)
    be.release_range(0, a, 2 * g)


def test_alignment_above_granularity_over_reserves(be, g, lib_copy):
    _, lib = lib_copy
    starts = [be.reserve(0, 2 * g, 8 * g) for _ in range(4)]
    assert all(s % (8 * g) == 0 for s in starts)
    for s in starts:
        be.release_range(0, s, 2 * g)
    assert lib.emu_live_reservations() == 0


def test_set_access_validates_and_is_a_noop(be, g):
    a = be.reserve(0, 4 * g, g)
    h1, h2 = be.create_handle(0, g), be.create_handle(0, g)
    be.map(0, a, g, h1, 0)
    be.map(0, a + g, g, h2, 0)
    assert not be.capabilities(0).set_access_spans_mappings
    be.set_access(0, a, g)
    be.set_access(0, a + g, g)
    for size in (2 * g, 3 * g):  # a run of mappings is not one aclrtMapMem range
        with pytest.raises(MappingError, match="vmm_set_access.*one live aclrtMapMem"):
            be.set_access(0, a, size)
    for off, h in ((0, h1), (g, h2)):
        be.unmap(0, a + off, g)
        be.release_handle(0, h)
    be.release_range(0, a, 4 * g)


def test_emulator_set_access_covers_exactly_one_map_call(be, g):
    """Doc rule R3 (aclrtMemSetAccess, aclcppdevg_03_2044): virPtr and size must equal
    those of one aclrtMapMem call."""
    from vmm_backends.ascend.acl_bindings import AclrtMemAccessDesc

    lib = be.plugin._acl
    a = be.reserve(0, 4 * g, g)
    h1, h2 = be.create_handle(0, 2 * g), be.create_handle(0, g)
    be.map(0, a, 2 * g, h1, 0)
    be.map(0, a + 2 * g, g, h2, 0)
    desc = AclrtMemAccessDesc()
    desc.flags, desc.location.id, desc.location.type = 0x3, 0, 1
    assert lib.aclrtMemSetAccess(a, 3 * g, ctypes.byref(desc), 1) == 107000  # two maps
    assert lib.aclrtMemSetAccess(a, g, ctypes.byref(desc), 1) == 107000  # part of one
    assert lib.aclrtMemSetAccess(a + g, g, ctypes.byref(desc), 1) == 107000  # not its start
    assert lib.aclrtMemSetAccess(a, 2 * g, ctypes.byref(desc), 1) == 0
    assert lib.aclrtMemSetAccess(a + 2 * g, g, ctypes.byref(desc), 1) == 0
    be.unmap(0, a, 2 * g)
    be.unmap(0, a + 2 * g, g)
    be.release_handle(0, h1)
    be.release_handle(0, h2)
    be.release_range(0, a, 4 * g)


def test_error_codes_map_to_one_exception_hierarchy():
    assert isinstance(acl_bindings.error_for("aclrtMapMem", 207001), OutOfMemoryError)
    assert isinstance(acl_bindings.error_for("aclrtUnmapMem", 107000), MappingError)
    assert type(acl_bindings.error_for("aclrtMemcpy", 107000)) is BackendError
    msg = str(acl_bindings.error_for("aclrtFreePhysical", 107000, "0x10"))
    assert msg.startswith("aclrtFreePhysical(0x10) failed with aclError 107000 "
                          "(ACL_ERROR_RT_PARAM_INVALID)") and "aclrtUnmapMem" in msg
